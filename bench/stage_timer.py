"""Run one ``tpgrpo`` command in this process and time what it spends importing, loading and computing.

    python -m bench.stage_timer --timings t.json stage rollout --iter 1 --params params.yaml
    accelerate launch --num_processes 2 bench/stage_timer.py --timings t.json stage update --iter 2 ...

Writes ``{"import_s", "load_s", "text_load_s", "peak_rss_gib"}`` to ``--timings`` (under accelerate, the
main process's; the others write ``t.json.rank<N>``): ``import_s`` the CLI's import plus the model libraries
a model stage imports lazily (diffusers, peft), ``load_s`` the time inside
``tpgrpo.policy.loading.load_policy`` (transformer + VAE from disk to the device, LoRA attached and loaded),
``text_load_s`` the first load of the text encoders, ``peak_rss_gib`` this process's peak resident memory
(VmHWM). The command's wall time minus these is its compute (and artifact writing). Once the first
``load_policy`` returns, ``<timings>.loaded`` is created (``bench/gpu_check.py`` kills a stage there, mid-run).
Nothing in the command's behaviour changes: the two functions are wrapped, not replaced.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path



def _peak_rss_gib() -> float:
    status = Path("/proc/self/status").read_text()
    return int(status.split("VmHWM:")[1].split()[0]) / 2**20  # kB


def run_timed(cli_args: list[str], out: Path) -> None:
    """Run ``tpgrpo CLI_ARGS`` (the typer app, in this process) and write the timings to ``out``."""
    start = time.perf_counter()
    from tpgrpo.cli import app

    if cli_args[:1] == ["stage"] and cli_args[1:2] != ["credit"]:  # what a model stage imports lazily
        from diffusers import AutoencoderKL, SD3Transformer2DModel, StableDiffusion3Pipeline  # noqa: F401
        import peft  # noqa: F401
    import tpgrpo.models.latent as latent
    import tpgrpo.policy.loading as common

    times = {"import_s": time.perf_counter() - start, "load_s": 0.0, "text_load_s": 0.0}
    load_policy, text_pipeline = common.load_policy, latent.LatentBackend._text_pipeline

    def timed_load(*args, **kwargs):
        t = time.perf_counter()
        try:
            return load_policy(*args, **kwargs)
        finally:
            times["load_s"] += time.perf_counter() - t
            Path(str(out) + ".loaded").touch()

    def timed_text(self):
        t, loading = time.perf_counter(), self._encoder is None
        try:
            return text_pipeline(self)
        finally:
            times["text_load_s"] += (time.perf_counter() - t) if loading else 0.0

    common.load_policy, latent.LatentBackend._text_pipeline = timed_load, timed_text
    if cli_args[:1] == ["stage"]:  # the stage's modules hold their own reference to load_policy: wrap each
        from tpgrpo.pipeline.execution.stage_runner import stage_module

        stage_module(cli_args[1])  # imports the stage and the library modules it runs
        for module in list(sys.modules.values()):
            if getattr(module, "load_policy", None) is load_policy and module is not common:
                module.load_policy = timed_load
    rank = os.environ.get("RANK", "0")
    try:
        app(cli_args, prog_name="tpgrpo")
    except SystemExit as exc:  # typer's exit: keep its code, after the timings are written
        code = exc.code
    else:
        code = 0
    finally:
        times["peak_rss_gib"] = _peak_rss_gib()
        Path(str(out) + ("" if rank == "0" else f".rank{rank}")).write_text(json.dumps(times))
    sys.exit(code)


if __name__ == "__main__":
    if len(sys.argv) < 4 or sys.argv[1] != "--timings":
        sys.exit("usage: stage_timer.py --timings OUT.json <tpgrpo arguments>")
    run_timed(sys.argv[3:], Path(sys.argv[2]))
