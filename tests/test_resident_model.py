"""Base weights held by the stage server (tpgrpo.models.resident): a forked process takes the held backend
once, and only when it asks for exactly what was loaded from a folder unchanged since; otherwise it loads."""

from __future__ import annotations

import os
import shutil
import sys
import traceback

import pytest

from tpgrpo.models import load_backend, resident

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fork-based, as the stage server")


def in_child(check) -> int:
    """Run ``check()`` (returns an int) in a forked child, as the server runs a stage; its exit code."""
    pid = os.fork()
    if pid == 0:
        code = 99
        try:
            code = check()
        except BaseException:
            traceback.print_exc()  # the child's error, in the test's captured stderr
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.fixture
def held(tmp_path, tiny_model_dir):
    folder = tmp_path / "base"
    shutil.copytree(tiny_model_dir, folder)
    resident.hold(load_backend, "tiny", folder, "cpu", "fp32", 0)
    yield folder, resident._held["backend"]
    resident.release()


def test_a_forked_stage_takes_the_held_backend_once(held):
    folder, backend = held

    def check():
        first = load_backend("tiny", folder, "cpu", "fp32", resolution=0)
        second = load_backend("tiny", folder, "cpu", "fp32", resolution=0)
        return 0 if first is backend and second is not backend else 1

    assert in_child(check) == 0
    assert resident.held_key() is not None  # the child's take does not empty the holder's


def test_a_stage_forked_for_another_device_moves_its_own_copy_there(held):
    """A backend held on the CPU serves a GPU stage: the forked stage moves its copy (here to the ``meta``
    device, which a CPU machine has: every parameter moves, the object is the held one), and the holder's
    copy stays on the CPU."""
    folder, backend = held

    def check():
        import torch

        moved = load_backend("tiny", folder, "meta", "fp32", resolution=0)
        params = [*moved.transformer.parameters(), *moved.text_encoder.parameters()]
        ok = moved is backend and moved.device == torch.device("meta") and all(p.is_meta for p in params)
        return 0 if ok else 1

    assert in_child(check) == 0
    assert all(p.device.type == "cpu" for p in backend.transformer.parameters())


def test_only_a_cpu_held_backend_moves_and_only_when_all_else_is_the_same():
    held = resident.model_key("sd3", "/m", "cpu", "bf16", 512)
    assert resident.movable(held, resident.model_key("sd3", "/m", "cuda", "bf16", 512))
    assert not resident.movable(held, resident.model_key("sd3", "/m", "cuda", "fp32", 512))  # another dtype
    assert not resident.movable(held, resident.model_key("sd3", "/m", "cuda", "bf16", 1024))
    assert not resident.movable(held, resident.model_key("sd3", "/m", "cpu", "bf16", 512))  # the same: no move
    assert not resident.movable(resident.model_key("sd3", "/m", "cuda", "bf16", 512), held)


def test_the_holder_itself_never_takes_it(held):
    folder, backend = held
    assert load_backend("tiny", folder, "cpu", "fp32", resolution=0) is not backend
    assert resident.held_key() is not None


@pytest.mark.parametrize("change", ["dtype", "resolution", "other folder", "rewritten file", "new file"])
def test_another_request_or_a_changed_folder_loads_from_disk(held, tmp_path, change):
    folder, backend = held
    args = {"kind": "tiny", "path": folder, "device": "cpu", "dtype": "fp32", "resolution": 0}
    if change == "dtype":
        args["dtype"] = "bf16"
    elif change == "resolution":
        args["resolution"] = 32  # the tiny model's own size: a valid request, but not what was loaded
    elif change == "other folder":
        args["path"] = shutil.copytree(folder, tmp_path / "copy")
    elif change == "rewritten file":
        weights = next(folder.rglob("*.safetensors"))
        data = weights.read_bytes()
        weights.unlink()  # a new inode, as a replacement of the file would have
        weights.write_bytes(data)
    else:
        (folder / "transformer" / "notes.txt").write_text("added after the server loaded the model")

    def check():
        if change == "dtype":  # the held one is not handed out; the bf16 load itself is not run here: in a child
            # forked from this test process (which ran torch ops on its own pool) torch refuses the conversion
            # in transformers' loader threads ("Invalid thread pool"; CI, 2026-12-05); not examined further
            return 0 if resident.take(**args) is None else 1
        got = load_backend(**{k: v for k, v in args.items() if k != "kind"}, kind=args["kind"])
        return 0 if got is not backend else 1

    assert in_child(check) == 0


def test_a_held_backend_samples_what_a_fresh_load_samples(held):
    """What the stages see is the same model: equal weights, equal outputs from one input."""
    import torch

    folder, backend = held
    fresh = load_backend("tiny", folder, "cpu", "fp32", resolution=0)
    a, b = backend.transformer.state_dict(), fresh.transformer.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# A fresh interpreter at 2 torch threads: the server's hold_for_stages, then a forked stage that runs 2-thread ops
# and takes the held model. Exit 0 when the child finished, 1 when it hung (killed after the deadline).
FORKED_AT_TWO_THREADS = """
import os, sys, time
import torch
torch.set_num_threads(2)
from tpgrpo.models import load_backend
from tpgrpo.models.resident import hold_for_stages
path = sys.argv[1]
model = {"kind": "tiny", "path": path, "device": "cpu", "dtype": "fp32", "resolution": 0}
assert hold_for_stages(load_backend, model).startswith("tiny")
pid = os.fork()
if pid == 0:
    x = torch.randn(512, 512)
    for _ in range(20):
        x = torch.tanh(x @ x / 512)
    os._exit(0 if torch.get_num_threads() == 2 and load_backend("tiny", path, "cpu", "fp32", resolution=0) else 3)
deadline = time.time() + 120
while time.time() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
        sys.exit(os.waitstatus_to_exitcode(status))
    time.sleep(0.1)
os.kill(pid, 9)
sys.exit(1)
"""


def test_a_stage_forked_at_two_threads_runs_with_the_held_model(tiny_model_dir):
    """Measured when this was written: the same child hung (killed after 60 s) when the parent had run one
    2-thread op while loading, and finished in 1.0 s after a load on one thread (docs/performance.md)."""
    import subprocess

    done = subprocess.run([sys.executable, "-c", FORKED_AT_TWO_THREADS, str(tiny_model_dir)], capture_output=True,
                          text=True, env=dict(os.environ, OMP_NUM_THREADS="2"), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("kind", ["sd3", "flux"])
def test_a_pipeline_backend_moves_every_module_and_tensor_it_keeps(kind, request):
    """What a GPU stage forked from the holder does to its copy (``to_device``), on the ``meta`` device a CPU
    machine has: the transformer, the VAE, the text encoders once loaded, and FLUX's position ids."""
    import torch
    from tiny_pipelines import RESOLUTION

    from tpgrpo.models.latent import TEXT_MODULES

    backend = load_backend(kind, request.getfixturevalue(f"{kind}_model_dir"), resolution=RESOLUTION)
    backend.encode_prompts(["a red circle"])  # loads the text encoders: they must move too
    assert backend.to_device("meta") is backend and backend.device == torch.device("meta")
    encoders = [getattr(backend._encoder, name) for name in TEXT_MODULES if getattr(backend._encoder, name, None)]
    assert encoders
    modules = [backend.transformer, backend.vae, *encoders]
    assert all(p.is_meta for m in modules for p in m.parameters())
    if kind == "flux":
        assert backend._img_ids.is_meta
