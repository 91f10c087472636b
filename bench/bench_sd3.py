"""Per-trajectory cost of rollout, probe and update for the SD3.5-Medium transformer (random weights).

    python -m bench.bench_sd3                                    # full size, 512 px, on cuda if present
    python -m bench.bench_sd3 --full                             # the same, insisting on cuda and bf16
    python -m bench.bench_sd3 --layers 2 --resolution 256 --trajectories 2   # a CPU-sized slice
    python -m bench.bench_sd3 --device cpu --smoke               # 1 block, 64 px, T = 3: the plumbing only

The transformer is built from SD3.5-M's published config (24 MMDiT blocks, 24 heads of 64, dual attention
in blocks 0-12, 2.5B parameters) and the VAE from SD3's published AutoencoderKL config; the weights are
random (nothing is downloaded), which does not change the cost. Text conditioning is zeros of the real
widths (77 CLIP + 256 T5 tokens, 4096 wide): the text encoders run once per prompt set, not per step,
so they are not part of the per-trajectory cost. The three phases use the project's own code paths:

- rollout: ``trajectory.rollout`` (T steps, CFG in one doubled batch, SDE in the window) + VAE decode;
- probe: ``trajectory.complete_window_states`` (ODE completion of every window state) + VAE decode;
- update: ``update.update_policy`` (LoRA rank 32 / alpha 64 on the attention projections, one forward and
  backward per window transition, AdamW).

Peak memory: ``torch.cuda.max_memory_allocated`` per phase on a GPU (reset before each phase; it includes
the weights, which stay allocated); on CPU the process's peak resident set size after each phase
(cumulative: it never goes down). On a GPU the weights are initialised there (fast; they are random
anyway) and one untimed forward pass runs first, so the rollout's figure holds no CUDA start-up cost.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

import torch


SD35_MEDIUM_TRANSFORMER = {  # stabilityai/stable-diffusion-3.5-medium transformer/config.json
    "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 24, "attention_head_dim": 64,
    "num_attention_heads": 24, "joint_attention_dim": 4096, "caption_projection_dim": 1536,
    "pooled_projection_dim": 2048, "out_channels": 16, "pos_embed_max_size": 384,
    "dual_attention_layers": list(range(13)), "qk_norm": "rms_norm",
}
SD3_VAE = {  # vae/config.json of SD3 / SD3.5
    "in_channels": 3, "out_channels": 3, "latent_channels": 16,
    "down_block_types": ["DownEncoderBlock2D"] * 4, "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512], "layers_per_block": 2, "norm_num_groups": 32,
    "scaling_factor": 1.5305, "shift_factor": 0.0609, "use_quant_conv": False, "use_post_quant_conv": False,
}


def build_backend(args):
    """An :class:`SD3Backend` with random SD3.5-M weights (``--layers`` blocks) and no text encoders."""
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    from tpgrpo.models.sd3 import SD3Backend

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    config = dict(SD35_MEDIUM_TRANSFORMER, num_layers=args.layers,
                  dual_attention_layers=list(range(min(13, args.layers))))
    torch.manual_seed(0)
    with torch.device(args.device):  # random init where the weights will live: minutes faster on a GPU
        transformer = SD3Transformer2DModel(**config).eval()
        if dtype != torch.float32:  # stock SD3.5 keeps no module in fp32, so a plain cast is what loading does
            transformer = transformer.to(dtype=dtype)
        vae = AutoencoderKL(**SD3_VAE).eval()
    backend = SD3Backend(transformer, vae, None, resolution=args.resolution, device=args.device, dtype=dtype)
    return backend, sum(p.numel() for p in transformer.parameters())


def peak_memory_gib(device: str) -> float:
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def timed(device: str, fn):
    """``(result, seconds, peak GiB)`` of ``fn()``; the CUDA peak counter is reset first."""
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.perf_counter() - start, peak_memory_gib(device)


def run_phases(backend, args) -> dict:
    """Seconds per trajectory and peak memory of rollout, probe and update on ``args.trajectories``."""
    from tpgrpo.config import Config, SamplingConfig, UpdateConfig
    from tpgrpo.policy.lora import attach_lora
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import SamplerSpec, complete_window_states, rollout
    from tpgrpo.policy.update import TransitionBatch, make_optimizer, update_policy

    n, T, K = args.trajectories, args.steps, args.window
    sampling = SamplingConfig(num_steps=T, shift=3.0, guidance_scale=4.5, step_kind="sde", noise_level=0.7,
                              window_start=0, window_size=K)
    spec = SamplerSpec(sigmas=flow_sigmas(T, 3.0), window_start=0, window_size=K, step_kind="sde",
                       noise_level=0.7, guidance_scale=4.5)
    embeds = backend.blank_embeddings(n, seq_len=77 + 256)
    update_cfg = UpdateConfig(**{**Config().update.__dict__, "lora_rank": 32, "lora_alpha": 64, "lr": 3e-4,
                                 "optimizer_steps_per_iter": 1, "micro_batch": args.micro_batch})
    attach_lora(backend, update_cfg.lora_rank, update_cfg.lora_alpha)
    out = {}
    if args.device.startswith("cuda"):  # kernels load and autotune on the first pass: keep that out of the figures
        with torch.no_grad():
            backend.velocity(backend.initial_noise([0]), 1.0, embeds.select([0]), 4.5)
        torch.cuda.synchronize()

    def do_rollout():
        traj = rollout(backend, embeds, list(range(n)), spec)
        backend.decode(traj.final)
        return traj

    traj, out["rollout_s"], out["rollout_peak_gib"] = timed(args.device, do_rollout)

    def do_probe():
        final, _ = complete_window_states(backend, traj.states, embeds, spec.sigmas, 0, 4.5, args.micro_batch)
        backend.decode(final)

    _, out["probe_s"], out["probe_peak_gib"] = timed(args.device, do_probe)
    batch = TransitionBatch(latents=traj.states.cpu(), old_log_probs=traj.log_probs.cpu(),
                            sigmas=spec.window_sigmas().expand(n, -1).clone(),
                            prompt_index=torch.arange(n), sigma_at_one=float(spec.sigmas[1]))
    advantages = torch.randn(n, K, generator=torch.Generator().manual_seed(0))
    optimizer = make_optimizer(backend, update_cfg)
    _, out["update_s"], out["update_peak_gib"] = timed(
        args.device, lambda: update_policy(backend, embeds, batch, advantages, sampling, update_cfg, optimizer,
                                           seed=0, after_sample=0))
    for phase in ("rollout", "probe", "update"):
        out[f"{phase}_s_per_trajectory"] = out.pop(f"{phase}_s") / n
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default=None,
                        help="weights' dtype (default bf16 on cuda, fp32 on cpu)")
    parser.add_argument("--resolution", type=int, default=512, help="image side in pixels")
    parser.add_argument("--layers", type=int, default=24, help="MMDiT blocks (SD3.5-M has 24)")
    parser.add_argument("--trajectories", type=int, default=4)
    parser.add_argument("--steps", type=int, default=10, help="T denoising steps")
    parser.add_argument("--window", type=int, default=9, help="SDE window steps K")
    parser.add_argument("--micro-batch", type=int, default=4, help="states per forward pass (probe, update)")
    parser.add_argument("--out", type=Path, default=None, help="also write the figures as JSON here")
    parser.add_argument("--full", action="store_true",
                        help="the paper's size on cuda: SD3.5-M (24 blocks), 512 px, bf16, T = 10, window 9")
    parser.add_argument("--smoke", action="store_true",
                        help="plumbing only: 1 block, 64 px, 1 trajectory, T = 3, window 2 (any device)")
    args = parser.parse_args()
    if args.full and args.smoke:
        parser.error("--full and --smoke exclude each other")
    if args.full:
        args.device, args.dtype, args.resolution, args.layers, args.steps, args.window = "cuda", "bf16", 512, 24, 10, 9
    if args.smoke:
        args.resolution, args.layers, args.trajectories, args.steps, args.window, args.micro_batch = 64, 1, 1, 3, 2, 2
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        sys.exit(f"bench_sd3: --device {args.device} but torch {torch.__version__} sees no CUDA device")
    args.dtype = args.dtype or ("bf16" if args.device.startswith("cuda") else "fp32")
    start = time.perf_counter()
    backend, params = build_backend(args)
    device_name = (torch.cuda.get_device_name() if args.device.startswith("cuda")
                   else f"cpu ({torch.get_num_threads()} threads)")
    figures = {"device": device_name,
               "dtype": args.dtype, "resolution": args.resolution, "layers": args.layers,
               "transformer_parameters": params, "trajectories": args.trajectories, "steps": args.steps,
               "window": args.window, "build_s": round(time.perf_counter() - start, 1)}
    figures.update({k: round(v, 3) for k, v in run_phases(backend, args).items()})
    print("| phase | s / trajectory | peak memory GiB |\n|---|---|---|")
    for phase in ("rollout", "probe", "update"):
        print(f"| {phase} | {figures[f'{phase}_s_per_trajectory']:.2f} | {figures[f'{phase}_peak_gib']:.2f} |")
    print(json.dumps(figures))
    if args.out:
        args.out.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
