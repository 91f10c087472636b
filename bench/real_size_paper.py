"""The on-paper half of ``bench/real_size.py``: a paper-sized iteration's stages on one H200.

Nothing here runs on a GPU. The FLOPs of one transformer forward row (one latent, one prompt) at 512 px are
counted by ``torch.utils.flop_counter.FlopCounterMode`` on this CPU from 1- and 2-block slices of the
SD3.5-M config (a full forward is ``B + 23 (C - B) + 13 (A - B)``: B one (last, context-pre-only) block, C
two plain blocks, A one block with the dual attention of blocks 0-12), and those of one VAE decode likewise.
Seconds = FLOPs / (H200 bf16 dense peak x an assumed utilisation); load seconds = bytes / an assumed rate.
"""

from __future__ import annotations

H200_BF16_FLOPS = 989e12  # dense bf16 peak of an H200 SXM (NVIDIA's datasheet, without sparsity)
ASSUMED_MFU = 0.4  # model-FLOPs utilisation assumed for a 2.5B DiT at 1,357 tokens (not measured)
ASSUMED_LOAD_GBPS = 2.0  # safetensors from local NVMe / page cache to GPU memory, GB/s (not measured)
# Paper recipe (SD3.5-M, 512 px): 48 prompts x 24 samples = 1,152 trajectories an iteration over 32 GPUs,
# T = 10 with a window of 9, exact probe, eval 108 prompts x 2 seeds at 40 steps, CFG (2 rows a step).
GPUS, TRAJECTORIES, T, WINDOW, EVAL_IMAGES, EVAL_STEPS = 32, 1152, 10, 9, 216, 40
TEXT_TOKENS = 77 + 256  # CLIP (77) + T5 (256) tokens of SD3's conditioning


def _count(module, *args, **kwargs) -> float:
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        module(*args, **kwargs)
    return float(counter.get_total_flops())


def transformer_row_flops(resolution: int = 512) -> float:
    """FLOPs of one SD3.5-M transformer forward row (one latent) at ``resolution`` px, from block slices."""
    import torch
    from diffusers import SD3Transformer2DModel

    from bench.bench_sd3 import SD35_MEDIUM_TRANSFORMER

    side = resolution // 8
    inputs = dict(hidden_states=torch.zeros(1, 16, side, side, dtype=torch.bfloat16),
                  encoder_hidden_states=torch.zeros(1, TEXT_TOKENS, 4096, dtype=torch.bfloat16),
                  pooled_projections=torch.zeros(1, 2048, dtype=torch.bfloat16), timestep=torch.ones(1))
    counts = []
    for layers, dual in ((1, []), (2, []), (1, [0])):
        model = SD3Transformer2DModel(**dict(SD35_MEDIUM_TRANSFORMER, num_layers=layers, dual_attention_layers=dual))
        counts.append(_count(model.to(torch.bfloat16).eval(), **inputs, return_dict=False))
    b, c, a = counts
    return b + 23 * (c - b) + 13 * (a - b)


def vae_decode_flops(resolution: int = 512) -> float:
    import torch
    from diffusers import AutoencoderKL

    from bench.bench_sd3 import SD3_VAE

    vae = AutoencoderKL(**SD3_VAE).eval()
    return _count(vae.decode, torch.zeros(1, 16, resolution // 8, resolution // 8))


def stage_flops(row: float, decode: float) -> dict[str, float]:
    """FLOPs of each model stage for one GPU's share of a paper iteration.

    rollout: T steps x 2 CFG rows + a decode per trajectory; probe (exact): the window's states 1..9 each
    completed over its remaining T - k steps (45 steps) + 9 decodes; update: the 9 window transitions x 2
    rows x 3 (forward + backward ~ 3 forwards); eval: 40 steps x 2 rows + a decode per image.
    """
    per_gpu = TRAJECTORIES / GPUS
    completion_steps = sum(T - k for k in range(1, WINDOW + 1))
    return {"rollout": per_gpu * (2 * T * row + decode),
            "probe": per_gpu * (2 * completion_steps * row + WINDOW * decode),
            "update": per_gpu * WINDOW * 2 * 3 * row,
            "eval": EVAL_IMAGES / GPUS * (2 * EVAL_STEPS * row + decode)}


def paper_rows(weights_gib: dict[str, float], layers: int) -> list[dict]:
    """Per stage on one H200, on paper: compute and load seconds, load's share of the stage.

    ``weights_gib``: the bf16 folder's transformer / vae / text encoder sizes (of a 24-block model).
    Every model stage loads transformer + VAE; the rollout also the text encoders (it encodes the iteration's
    prompts). Probe and update read the rollout's cached embeddings, and eval those the ``eval_prompts`` stage
    wrote once per run (before that cache each eval loaded the text encoders), so none of them loads the
    text encoders. ``eval_prompts`` itself (model + text encoders, once per run) is not an iteration's row.
    """
    if layers != 24:
        return []
    row, decode = transformer_row_flops(), vae_decode_flops()
    print(f"on paper: {row / 1e12:.2f} TFLOP per transformer forward row at 512 px, "
          f"{decode / 1e12:.2f} TFLOP per VAE decode", flush=True)
    model = weights_gib["transformer"] + weights_gib["vae"]
    loads = {"rollout": model + weights_gib["text"], "probe": model, "update": model, "eval": model}
    rows = []
    for stage, flops in stage_flops(row, decode).items():
        compute = flops / (H200_BF16_FLOPS * ASSUMED_MFU)
        load = loads[stage] * 2**30 / (ASSUMED_LOAD_GBPS * 1e9)
        rows.append({"stage": stage, "tflop": flops / 1e12, "compute_s": compute, "load_s": load,
                     "load_share": load / (load + compute)})
    return rows


def print_tables(measured: list[dict], paper: list[dict], loadavg) -> None:
    """The measured table (this CPU) and the on-paper table (one H200), side by side per stage."""
    print(f"\nmeasured on this CPU (load average {loadavg[0]:.1f} / {loadavg[1]:.1f} / {loadavg[2]:.1f}):")
    print(f"{'stage':8} {'import s':>9} {'load s':>8} {'text s':>7} {'compute s':>10} {'peak GiB':>9} {'out MiB':>8}")
    for r in measured:
        print(f"{r['stage']:8} {r['import_s']:9.1f} {r['load_s']:8.1f} {r['text_load_s']:7.1f} "
              f"{r['compute_s']:10.1f} {r['peak_rss_gib']:9.2f} {r['artifacts_mib']:8.2f}")
    if not paper:
        return
    print(f"\nON PAPER, one H200 at the paper's per-GPU batch ({TRAJECTORIES // GPUS} trajectories, "
          f"{EVAL_IMAGES / GPUS:.2f} eval images; {ASSUMED_MFU:.0%} of {H200_BF16_FLOPS / 1e12:.0f} TFLOP/s, "
          f"loads at {ASSUMED_LOAD_GBPS:g} GB/s):")
    print(f"{'stage':8} {'TFLOP':>9} {'compute s':>10} {'load s':>8} {'load share':>11}")
    for r in paper:
        print(f"{r['stage']:8} {r['tflop']:9.0f} {r['compute_s']:10.1f} {r['load_s']:8.1f} {r['load_share']:11.1%}")
    load, total = sum(r["load_s"] for r in paper), sum(r["load_s"] + r["compute_s"] for r in paper)
    print(f"loading: {load:.0f} s of a {total:.0f} s iteration ({load / total:.1%}) on paper")
