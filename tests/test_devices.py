"""Every model stage keeps its tensors on the backend's device: checked on a CPU-only machine.

``fake_cuda()`` is a torch function mode that emulates ``cuda`` on the CPU. A tensor moved to or created on
``cuda`` becomes a ``FakeCuda`` (a CPU tensor that reports ``device cuda:0``); as on a real GPU, an op that
mixes it with a CPU tensor of one or more dimensions raises, and so does ``.numpy()``. ``FakeCudaBackend``
wraps a tiny CPU backend: it reports ``device cuda``, asserts that every tensor it is given is on that
device and returns its outputs there, while the model itself computes on the CPU. So a stage that forgets
a move fails here exactly where it would fail on a GPU, and values stay comparable to a plain CPU run.
"""

from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from tpgrpo.config import Config, SamplingConfig, UpdateConfig, load_config
from tpgrpo.models.base import FlowBackend, PromptEmbeddings
from tpgrpo.models.tiny import TinyConfig, build_tiny
from tpgrpo.algo.schedule import flow_sigmas
from tpgrpo.algo.trajectory import SamplerSpec, complete_window_states, ode_complete, rollout

CUDA = torch.device("cuda", 0)
CPU = torch.device("cpu")
WORDS = "a an the one two three red green blue circle circles square squares left right of and sign that says".split()
CONFIG = TinyConfig(image_size=16, patch_size=4, num_layers=1, num_heads=2, head_dim=8, text_layers=1,
                    text_hidden=16, text_heads=2, text_intermediate=32, max_length=16)
PROMPTS = ["a red circle", "two blue squares", "a green square", ""]
SEEDS = [11, 12, 13, 14]


class FakeCuda(torch.Tensor):
    """A CPU tensor that ``fake_cuda`` treats as living on ``cuda:0`` (plain maths, no subclass dispatch)."""

    __torch_function__ = torch._C._disabled_torch_function_impl


def _tag(t):
    return t.as_subclass(FakeCuda) if isinstance(t, torch.Tensor) and not isinstance(t, FakeCuda) else t


def _untag(t):
    return t.as_subclass(torch.Tensor) if isinstance(t, FakeCuda) else t


def _kind(device) -> str | None:
    """"cuda" / "cpu" / "meta" ... for a device argument (str, torch.device, int index, or a tensor)."""
    if device is None:
        return None
    if isinstance(device, torch.Tensor):
        return "cuda" if isinstance(device, FakeCuda) else "cpu"
    return "cuda" if isinstance(device, int) else torch.device(device).type


def _target(name: str, args, kwargs) -> str | None:
    """Where an op explicitly puts its result ("cuda" / "cpu"), or None (where its inputs are)."""
    if name in ("cuda", "cpu"):
        return name
    if kwargs.get("device") is not None:
        return _kind(kwargs["device"])
    if name == "to":
        for a in args[1:]:
            if isinstance(a, (str, torch.device, torch.Tensor, int)) and not isinstance(a, bool):
                return _kind(a)
    return None


MOVES = {"to", "cpu", "cuda", "copy_", "as_subclass"}  # ops that may take tensors from another device


class _FakeCudaMode(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func == torch.Tensor.device.__get__ and isinstance(args[0], FakeCuda):
            return CUDA
        if func == torch.Tensor.is_cuda.__get__ and isinstance(args[0], FakeCuda):
            return True
        name = getattr(func, "__name__", "")
        if name == "as_subclass":
            return func(*args, **kwargs)
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        on_cuda = any(isinstance(t, FakeCuda) for t in tensors)
        if name in ("numpy", "__array__") and on_cuda:
            raise TypeError("can't convert cuda:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                            "tensor to host memory first.")
        target = _target(name, args, kwargs)
        if name not in MOVES and on_cuda:
            checked = tensors
            if name in ("__getitem__", "__setitem__"):  # CPU index tensors are fine on a GPU too
                checked = [args[0]] + [t for t in tree_flatten(args[2:])[0] if isinstance(t, torch.Tensor)]
            cpu = [t for t in checked if not isinstance(t, FakeCuda) and t.dim() > 0]
            if cpu:
                raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two "
                                   f"devices, cuda:0 and cpu! ({name}: a cpu tensor of shape {tuple(cpu[0].shape)})")
        if _kind(kwargs.get("device")) == "cuda":
            kwargs["device"] = CPU
        if name == "to":
            args = tuple(CPU if isinstance(a, (str, torch.device)) and _kind(a) == "cuda" else a for a in args)
        out = args[0] if name == "cuda" else func(*args, **kwargs)
        if target == "cuda" or (target is None and on_cuda):
            return tree_map(_tag, out)
        return tree_map(_untag, out) if target == "cpu" else out


@contextlib.contextmanager
def fake_cuda():
    """Emulate ``cuda`` on the CPU for the block (see the module docstring)."""
    with _FakeCudaMode():
        yield


def _on_cuda(what: str, t):
    """``t`` with its device tag removed; AssertionError if a tensor is not on the (fake) GPU."""
    if isinstance(t, torch.Tensor) and not isinstance(t, FakeCuda):
        raise AssertionError(f"{what} got a cpu tensor of shape {tuple(t.shape)}; the backend is on cuda")
    return _untag(t)


def _embeds_on_cuda(what: str, e: PromptEmbeddings) -> PromptEmbeddings:
    return PromptEmbeddings(*(None if f is None else _on_cuda(f"{what} ({name})", f) for name, f in
                              zip(("embeds", "pooled", "uncond_embeds", "uncond_pooled"),
                                  (e.embeds, e.pooled, e.uncond_embeds, e.uncond_pooled))))


def _embeds_to_cuda(e: PromptEmbeddings) -> PromptEmbeddings:
    return PromptEmbeddings(*(tree_map(_tag, f) for f in (e.embeds, e.pooled, e.uncond_embeds, e.uncond_pooled)))


class FakeCudaBackend(FlowBackend):
    """A tiny CPU backend seen as a ``cuda`` backend: inputs must be on cuda, outputs come back on cuda."""

    def __init__(self, inner):
        self.inner, self.device = inner, torch.device("cuda")
        self.dtype, self.kind, self.latent_shape = inner.dtype, inner.kind, inner.latent_shape
        self.transformer, self.lora_target_modules = inner.transformer, inner.lora_target_modules
        self.cfg_doubles_batch = inner.cfg_doubles_batch

    def __getattr__(self, name):  # config, tokenizer, modules(), save_pretrained(), ...
        return getattr(self.inner, name)

    def encode_prompts(self, prompts):
        return _embeds_to_cuda(self.inner.encode_prompts(prompts))

    def velocity(self, x, sigma, embeds, guidance_scale):
        v = self.inner.velocity(_on_cuda("velocity x", x), _on_cuda("velocity sigma", sigma),
                                _embeds_on_cuda("velocity embeds", embeds), guidance_scale)
        return _tag(v)

    def decode(self, x):
        return self.inner.decode(_on_cuda("decode", x))

    # -- what pretraining calls on a TinyBackend --
    def encode_text(self, prompts):
        return tree_map(_tag, self.inner.encode_text(prompts))

    def encode_images(self, images):
        return _tag(self.inner.encode_images(images))

    def predict(self, x, sigma, hidden, pooled):
        names = ("x", "sigma", "hidden", "pooled")
        args = [_on_cuda(f"predict {n}", t) for n, t in zip(names, (x, sigma, hidden, pooled))]
        return _tag(self.inner.predict(*args))


def _tiny(seed: int = 0):
    return build_tiny(CONFIG, seed=seed, words=WORDS, charset="0123456789")


@pytest.fixture(scope="module")
def inner():
    return _tiny()


def _spec(step_kind: str = "sde") -> SamplerSpec:
    return SamplerSpec(sigmas=flow_sigmas(4, 1.0), window_start=0, window_size=3, step_kind=step_kind,
                       noise_level=0.7, guidance_scale=4.5)


def _assert_cuda(**tensors):
    for name, t in tensors.items():
        assert t.device == CUDA, f"{name} is on {t.device}"


# ---------------------------------------------------------------------------------------------
# The harness itself: it must catch what a GPU catches.
# ---------------------------------------------------------------------------------------------

def test_fake_cuda_raises_where_a_gpu_raises(inner):
    with fake_cuda():
        x = torch.randn(2, 3).to("cuda")
        assert x.device == CUDA and x.is_cuda and torch.zeros(2, device=x.device).device == CUDA
        with pytest.raises(RuntimeError, match="same device"):
            x + torch.randn(2, 3)
        with pytest.raises(RuntimeError, match="same device"):
            torch.stack([x, torch.randn(2, 3)])
        with pytest.raises(TypeError, match="numpy"):
            x.numpy()
        assert (x * torch.tensor(2.0)).device == CUDA  # a 0-d cpu tensor mixes, as on a GPU
        assert x[torch.tensor([1, 0])].device == CUDA  # cpu index tensors too
        assert x.cpu().device == CPU and isinstance(x.cpu().numpy(), np.ndarray)
        gpu = FakeCudaBackend(inner)
        embeds = gpu.encode_prompts(PROMPTS[:1])
        with pytest.raises(AssertionError, match="velocity x got a cpu tensor"):
            gpu.velocity(torch.zeros(1, *gpu.latent_shape), torch.ones(1, device="cuda"), embeds, 4.5)


def test_fake_cuda_keeps_gradients(inner):
    w = torch.ones(3, requires_grad=True)
    with fake_cuda():
        y = (w.to("cuda") * torch.randn(3).to("cuda")).sum()
        y.backward()
    assert w.grad is not None and w.grad.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# The stages' maths on a (fake) GPU: one device throughout, the same numbers as on the CPU.
# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("step_kind", ["sde", "cps"])
def test_rollout_runs_on_the_backend_device_with_cpu_results(inner, step_kind):
    spec = _spec(step_kind)
    ref = rollout(inner, inner.encode_prompts(PROMPTS), SEEDS, spec)
    with fake_cuda():
        gpu = FakeCudaBackend(inner)
        out = rollout(gpu, gpu.encode_prompts(PROMPTS), SEEDS, spec)
        _assert_cuda(states=out.states, log_probs=out.log_probs, final=out.final)
        got = {k: getattr(out, k).cpu() for k in ("states", "log_probs", "final")}
    for key, value in got.items():  # per-sample CPU noise generators: seed-identical to a CPU run
        torch.testing.assert_close(value, getattr(ref, key), rtol=0, atol=0, msg=key)


def test_probe_completion_takes_cpu_states_and_runs_on_the_device(inner):
    spec = _spec()
    traj = rollout(inner, inner.encode_prompts(PROMPTS), SEEDS, spec)
    ref, ref_passes = complete_window_states(inner, traj.states, inner.encode_prompts(PROMPTS), spec.sigmas, 0,
                                             4.5, batch_size=5)
    with fake_cuda():
        gpu = FakeCudaBackend(inner)
        embeds = gpu.encode_prompts(PROMPTS)
        # The probe stage reads the states from trajectories.zarr: they arrive on the CPU.
        final, passes = complete_window_states(gpu, traj.states, embeds, spec.sigmas, 0, 4.5, batch_size=5)
        _assert_cuda(final=final)
        direct, _ = ode_complete(gpu, traj.states[:, 1].to("cuda"), torch.ones(len(SEEDS), dtype=torch.long),
                                 spec.sigmas, embeds, 4.5, batch_size=3)
        _assert_cuda(direct=direct)
        final = final.cpu()
    assert passes == ref_passes
    torch.testing.assert_close(final, ref, rtol=0, atol=0)


def test_sample_ode_runs_on_the_backend_device(inner):
    from tpgrpo.policy.generate import sample_ode

    ref = sample_ode(inner, PROMPTS, SEEDS, num_steps=3, batch_size=3)
    with fake_cuda():
        images = sample_ode(FakeCudaBackend(inner), PROMPTS, SEEDS, num_steps=3, batch_size=3)
    np.testing.assert_array_equal(images, ref)


class _DeviceToHost(TorchFunctionMode):
    """Counts device-to-host copies of (fake) cuda tensors: each one waits for the GPU."""

    NAMES = {"cpu", "item", "tolist", "numpy", "__bool__", "__float__", "__int__"}

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if args and isinstance(args[0], FakeCuda) and (
                name in self.NAMES or (name == "to" and _target(name, args, kwargs) == "cpu")):
            self.count += 1
        return func(*args, **kwargs)


def test_update_copies_to_the_host_once_per_micro_batch():
    """Per extra micro-batch: one copy of the update's own figures in the training pass (loss, diagnostics,
    ratios together; it was six) and one in the after-step pass (its log-probs), plus the sampler's three
    argument checks (``bool`` of a device tensor) per step call in each pass: 1 + 3 + 1 + 3 (it was 13)."""
    counts = []
    for micro_batch in (1, 6):  # 12 transitions in 2 chunks of 6: 12 + 12 vs 2 + 2 micro-batches
        with fake_cuda(), _DeviceToHost() as syncs:
            _update_once(FakeCudaBackend(_tiny()), 0.0, micro_batch=micro_batch)
        counts.append(syncs.count)
    assert counts[0] - counts[1] == 10 * (1 + 3 + 1 + 3), counts


def _update_once(backend, kl_beta: float, micro_batch: int = 5, store=None) -> dict:
    """Attach a LoRA, roll out, and run one update on the transitions (stored on the CPU, as the stage reads them;
    with ``store``, the states written there as the rollout lays them out and read per micro-batch)."""
    from tpgrpo.policy.lora import attach_lora
    from tpgrpo.policy.update import TransitionBatch, make_optimizer, update_policy

    spec = _spec()
    torch.manual_seed(0)
    attach_lora(backend, 4, 8)
    embeds = backend.encode_prompts(PROMPTS)
    traj = rollout(backend, embeds, SEEDS, spec)
    states = traj.states.cpu() if store is None else _lazy(traj.states.cpu(), store)
    batch = TransitionBatch(latents=states, old_log_probs=traj.log_probs.cpu(),
                            sigmas=spec.window_sigmas().expand(len(SEEDS), -1).clone(),
                            prompt_index=torch.arange(len(SEEDS)), sigma_at_one=float(spec.sigmas[1]))
    sampling = SamplingConfig(num_steps=4, shift=1.0, guidance_scale=4.5, step_kind="sde", noise_level=0.7,
                              window_start=0, window_size=3)
    update_cfg = dataclasses.replace(Config().update, lora_rank=4, lora_alpha=8, lr=1e-2, micro_batch=micro_batch,
                                     optimizer_steps_per_iter=2, kl_beta=kl_beta,
                                     min_transitions_per_step=1)
    advantages = torch.randn(len(SEEDS), 3, generator=torch.Generator().manual_seed(1))
    optimizer = make_optimizer(backend, update_cfg)
    return update_policy(backend, embeds, batch, advantages, sampling, update_cfg, optimizer, seed=0)


@pytest.mark.parametrize("kl_beta", [0.0, 0.1])
def test_update_recomputes_log_probs_on_the_backend_device(kl_beta):
    ref = _update_once(_tiny(), kl_beta)
    with fake_cuda():
        got = _update_once(FakeCudaBackend(_tiny()), kl_beta)
    assert got["first_pass_ratio_max_dev"] < 1e-5  # the device run re-scores its own rollout exactly
    for key in ("policy_loss", "kl", "approx_kl", "grad_norm", "approx_kl_after"):
        assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), key


def _lazy(states: torch.Tensor, store):
    import zarr

    from tpgrpo.io.trajectories import CheckedArray, _chunk_codecs
    from tpgrpo.policy.states import LazyStates

    arr = zarr.open_group(str(store), mode="w").create_array(
        "states", data=states.numpy(), shards=tuple(states.shape), chunks=(1, 1, *states.shape[2:]),
        compressors=_chunk_codecs())
    return LazyStates(CheckedArray(arr, str(store), "states"))


def test_lazily_read_states_reach_the_backend_device(tmp_path):
    """The update stage's states are read from the store per micro-batch on the CPU, then moved."""
    ref = _update_once(_tiny(), 0.0)
    with fake_cuda():
        got = _update_once(FakeCudaBackend(_tiny()), 0.0, store=tmp_path / "t.zarr")
    assert got["first_pass_ratio_max_dev"] < 1e-5
    for key in ("policy_loss", "approx_kl", "grad_norm", "approx_kl_after"):
        assert got[key] == pytest.approx(ref[key], rel=1e-6, abs=1e-9), key


def test_ema_resumed_from_disk_updates_beside_gpu_weights(tmp_path, monkeypatch):
    """A resumed EMA (its state read to the CPU) must update beside LoRA weights that live on cuda:
    ``update.ema`` iteration 2 on a GPU. The fake backend's weights stay on the CPU, so the LoRA state
    dict is tagged as cuda here, as a real GPU model's would be."""
    from tpgrpo.policy import lora
    from tpgrpo.policy.checkpoint import load_training_state, save_training_state
    from tpgrpo.policy.update import make_optimizer

    backend = _tiny()
    lora.attach_lora(backend, 4, 8)
    update_cfg = dataclasses.replace(Config().update, lora_rank=4, lora_alpha=8)
    save_training_state(tmp_path, make_optimizer(backend, update_cfg), lora.LoraEMA(backend, every=1), step=1)
    on_cpu = lora.lora_state_dict
    monkeypatch.setattr(lora, "lora_state_dict", lambda b: {k: v.to("cuda") for k, v in on_cpu(b).items()})
    with fake_cuda():
        ema = lora.LoraEMA(backend, every=1)
        load_training_state(tmp_path, make_optimizer(backend, update_cfg), ema)
        assert ema.step(backend)  # the first EMA update after the resume
        _assert_cuda(**{k.replace(".", "_"): v for k, v in ema.shadow.items()})


def test_pretraining_step_runs_on_the_backend_device(tmp_path):
    from tpgrpo.models.pretrain import _Run

    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, size=(4, 16, 16, 3), dtype=np.uint8)
    hparams = {"lr": 1e-3, "warmup": 0.0, "weight_decay": 0.0, "ema_decay": 0.9, "dropout": 0.5, "grad_clip": 1.0,
               "noise_mean": 0.0}
    ref = _Run(_tiny(), tmp_path / "a", 0, hparams, 2, None)
    with fake_cuda():
        run = _Run(FakeCudaBackend(_tiny()), tmp_path / "b", 0, hparams, 2, None)
        losses = [run.step(PROMPTS, images) for _ in range(2)]
    assert losses == [ref.step(PROMPTS, images) for _ in range(2)]
    for p, q in zip(run.params, ref.params):
        torch.testing.assert_close(p, q, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------
# Whole stages, with the policy loaded as a (fake) GPU backend.
# ---------------------------------------------------------------------------------------------

def test_one_iteration_of_every_stage_on_a_gpu_backend(tiny_project, monkeypatch):
    import json

    import stages.baseline
    import stages.credit
    import stages.eval
    import stages.probe
    import stages.rollout
    import stages.update
    from tpgrpo.policy import evaluation, probe_scoring
    from tpgrpo.policy import loading as pipeline
    from tpgrpo.rollout_shape import chain_rollout

    original = pipeline.load_policy

    def load_on_gpu(cfg, root, iteration, trainable=False):
        return FakeCudaBackend(original(cfg, root, iteration, trainable=trainable))

    # where each stage's code calls load_policy (the rollout's, probe's and eval's live in the library)
    for module in (chain_rollout, probe_scoring, stages.update, evaluation):
        monkeypatch.setattr(module, "load_policy", load_on_gpu)
    root = tiny_project
    cfg = load_config(root / "params.yaml")
    with fake_cuda():
        for module in (stages.rollout, stages.probe, stages.credit, stages.update, stages.eval):
            module.run(cfg, 1, root)
        stages.baseline.run(cfg, None, root)
    update = json.loads((root / "data" / "iters" / "0001" / "update.json").read_text())
    assert update["first_pass_ratio_max_dev"] < 1e-5
    assert json.loads((root / "data" / "iters" / "0001" / "eval.json").read_text())["evaluated"]


def test_base_report_sampling_runs_on_the_backend_device(tiny_project):
    from tpgrpo.reports.base_report import increment_table
    from tpgrpo.models import load_backend

    cfg = load_config(tiny_project / "params.yaml")
    inner = load_backend("tiny", tiny_project / "data" / "base")
    ref = increment_table(inner, cfg, tiny_project / "data" / "prompts", prompts=1)
    with fake_cuda():
        rows = increment_table(FakeCudaBackend(inner), cfg, tiny_project / "data" / "prompts", prompts=1)
    assert rows == ref
