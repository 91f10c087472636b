"""Every artifact is byte-identical for identical inputs across processes (DVC hashes the bytes).

The test runs this file as a script in two separate Python processes with different ``PYTHONHASHSEED``
(which changes the order of Python sets) and compares every file they write: the LoRA adapter folder
(weights, adapter_config.json, EMA adapter, optimizer state), prompt embeddings (an iteration's and the eval
prompts' chunk files), the probe and credit tables, the trajectory store and a metrics JSON. Torch runs on 1
thread in both (float results are byte-identical only at equal thread counts).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def write_all(out: Path) -> None:
    """Write one of each artifact into ``out`` from fixed inputs."""
    prompts = ["a red circle", "a blue circle"]
    write_model_artifacts(out, prompts)
    write_tables(out, prompts)


def write_model_artifacts(out: Path, prompts: list[str]) -> None:
    """A LoRA policy (adapter, optimizer state, EMA) and prompt embeddings of a tiny model."""
    import json

    import torch

    from tpgrpo.policy import lora as policy
    from tpgrpo.io.artifacts import write_embeddings
    from tpgrpo.models.tiny import TinyConfig, build_tiny
    from tpgrpo.policy.checkpoint import save_policy

    torch.set_num_threads(1)
    tiny = TinyConfig(image_size=16, patch_size=4, num_layers=2, num_heads=2, head_dim=8, text_layers=1,
                      text_hidden=16, text_heads=2, text_intermediate=32, max_length=8)
    backend = build_tiny(tiny, seed=0, words=["red", "blue", "circle", "a"], charset="ab")
    torch.manual_seed(0)
    policy.attach_lora(backend, rank=4, alpha=8)
    params = [p for _, p in policy.lora_parameters(backend)]
    gen = torch.Generator().manual_seed(1)
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    ema = policy.LoraEMA(backend, every=1)
    for _ in range(2):  # a real optimizer state (moments, step counts) and a moved EMA
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer.step()
        ema.step(backend)
    save_policy(out / "policy", backend, optimizer, ema)
    embeds = backend.encode_prompts(prompts)
    write_embeddings(out / "prompt_embeds.safetensors",
                     {"embeds": embeds.embeds, "pooled": embeds.pooled, "uncond_embeds": embeds.uncond_embeds,
                      "uncond_pooled": embeds.uncond_pooled},
                     {"prompts": json.dumps(prompts), "model": "0123abcd"})
    write_eval_prompt_embeds(out, backend)


def write_eval_prompt_embeds(out: Path, backend) -> None:
    """The eval_prompts stage's folder: 3 held-out prompts x 2 seeds in chunks of 4 images (2 files)."""
    from types import SimpleNamespace as NS

    from tpgrpo.policy.eval_embeds import write_eval_embeddings

    cfg = NS(task=NS(eval_prompts=str(REPO / "data/prompts/compositional_eval.jsonl")),
             eval=NS(num_prompts=3, samples_per_prompt=2), rollout=NS(batch_size=4),
             params_hash=lambda keys: "0123abcd")
    write_eval_embeddings(cfg, out, backend)


def write_tables(out: Path, prompts: list[str]) -> None:
    """Probe and credit tables, a trajectories Zarr store and a metrics JSON from seeded random data."""
    import numpy as np
    import pandas as pd

    from tpgrpo.algo.credit_table import credit_table
    from tpgrpo.io.artifacts import write_json, write_table
    from tpgrpo.io.trajectories import write_zarr
    from tpgrpo.config import Config
    from tpgrpo.io.schemas import CREDIT, PROBE

    n, k = 4, 2
    rng = np.random.default_rng(0)
    traj = np.repeat(np.arange(n), k + 1)
    probe = pd.DataFrame({
        "trajectory": traj, "prompt_id": [f"p{t // 2}" for t in traj], "prompt": [prompts[t // 2] for t in traj],
        "sample": traj % 2, "seed": traj + 100, "step": np.tile(np.arange(k + 1), n),
        "sigma": np.tile(np.linspace(1.0, 0.0, k + 1), n), "reward": rng.random(n * (k + 1)),
        "strict": traj % 3 == 0})
    meta = {"stage": "probe", "iteration": "0"}
    write_table(out / "probe.parquet", probe, PROBE, meta, trajectories=n, steps=k + 1)
    write_table(out / "credit.parquet", credit_table(probe, Config()), CREDIT, meta, trajectories=n, steps=k)

    arrays = {"states": rng.standard_normal((n, k + 1, 3, 4, 4)).astype(np.float32),
              "log_probs": rng.standard_normal((n, k)).astype(np.float32),
              "sigmas": np.tile(np.linspace(1.0, 0.0, k + 1, dtype=np.float32), (n, 1)), "seeds": np.arange(n) + 100,
              "prompt_index": np.arange(n) // 2, "sample": np.arange(n) % 2, "final_reward": rng.random(n),
              "final_strict": np.arange(n) % 2 == 0}
    attrs = {"prompts": [{"id": "p0", "tags": sorted({"x", "y", "z"})}, {"id": "p1"}], "group_size": 2,
             "schedule_sigmas": [1.0, 0.5, 0.0], "num_steps": k, "shift": 1.0, "window_start": 0,
             "window_size": k, "step_kind": "sde", "noise_level": 0.7, "guidance_scale": 1.0, "reward": "r"}
    write_zarr(out / "trajectories.zarr", arrays, attrs)
    write_json(out / "metrics.json", {"b": 1, "a": [0.5, 0.25], "nested": {"y": 2, "x": 1}})


def written(out: Path) -> dict[str, bytes]:
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("seeds", [("1", "2")])
def test_every_artifact_is_byte_identical_across_processes(tmp_path, seeds):
    outs = []
    for i, seed in enumerate(seeds):
        out = tmp_path / f"run{i}"
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        run = subprocess.run([sys.executable, __file__, str(out)], cwd=REPO, env=env, capture_output=True,
                             text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        outs.append(written(out))
    a, b = outs
    assert a.keys() == b.keys()
    expected = {"policy/pytorch_lora_weights.safetensors", "policy/adapter_config.json",
                "policy/ema/pytorch_lora_weights.safetensors", "policy/training_state.pt",
                "prompt_embeds.safetensors", "data/iters/eval_prompt_embeds/chunk_0001.safetensors",
                "probe.parquet", "credit.parquet", "metrics.json",
                "trajectories.zarr/zarr.json", "trajectories.zarr/log_probs/zarr.json"}
    assert expected <= a.keys()
    differing = sorted(name for name in a if a[name] != b[name])
    assert differing == [], f"differ between the two processes: {differing}"


def test_rerunning_the_update_stage_in_a_new_process_gives_the_same_policy_bytes(tiny_project, tmp_path):
    """The reported case: `tpgrpo stage update --iter 1` run again by hand with unchanged inputs."""
    from typer.testing import CliRunner

    from tpgrpo.cli import app

    root = tiny_project
    for name in ("rollout", "probe", "credit"):
        result = CliRunner().invoke(app, ["stage", name, "--iter", "1", "--params", str(root / "params.yaml")])
        assert result.exit_code == 0, result.output
    policy = root / "data" / "iters" / "0001" / "policy"
    runs = []
    for seed in ("3", "4"):
        env = dict(os.environ, PYTHONHASHSEED=seed, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", DVC_NO_ANALYTICS="1",
                   DVC_STUDIO_OFFLINE="true")
        run = subprocess.run([sys.executable, "-m", "tpgrpo", "stage", "update", "--iter", "1"], cwd=root, env=env,
                             capture_output=True, text=True)
        assert run.returncode == 0, run.stderr[-3000:]
        runs.append(written(policy))
    assert runs[0].keys() == runs[1].keys() and "pytorch_lora_weights.safetensors" in runs[0]
    assert sorted(name for name in runs[0] if runs[0][name] != runs[1][name]) == []


def test_save_safetensors_reads_back_with_safetensors(tmp_path):
    """The hand-written format loads with safetensors itself: every dtype, 0-dim and empty tensors, metadata."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import load_file

    from tpgrpo.io.artifacts import save_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {"w.f32": torch.randn(3, 5, generator=gen), "b.bf16": torch.randn(7, generator=gen).bfloat16(),
               "h.f16": torch.randn(2, 3, generator=gen).half(), "d.f64": torch.randn(1, generator=gen).double(),
               "mask": torch.tensor([True, False, True]), "ids": torch.arange(5), "i32": torch.arange(3).int(),
               "u8": torch.arange(4).to(torch.uint8), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 4),
               "strided": torch.randn(4, 6, generator=gen)[:, ::2]}
    path = tmp_path / "x.safetensors"
    save_safetensors(tensors, path, {"z": "last", "a": "first"})
    with safe_open(str(path), framework="pt") as f:
        assert f.metadata() == {"z": "last", "a": "first"}
    back = load_file(path)
    assert back.keys() == tensors.keys()
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and torch.equal(back[name], t), name
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    assert header_len % 8 == 0  # padded as the format asks


if __name__ == "__main__":
    sys.path[:0] = [str(REPO)]
    write_all(Path(sys.argv[1]))
