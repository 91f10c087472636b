"""One TP-GRPO iteration of SD3.5-M at full width through the CLI, per stage: load against compute.

    nice -n 10 python -m bench.real_size > real_size.log 2>&1 &     # ~30 min on 2 cores, < 14 GiB
    python -m bench.real_size --layers 1 --t5 no                     # 1 block: the plumbing, minutes

1. Model: an SD3.5-M folder in the diffusers layout built from the published configs (transformer 2.5B:
   24 MMDiT blocks, 24 heads of 64; SD3 VAE; CLIP-L and CLIP-G text encoders at their real widths, vocab
   49,408; tokenizers built offline: byte-level CLIP BPE without merges, 77 tokens), random weights made
   in bf16 (no fp32 copy of the transformer) and saved with safetensors under ``.cache/real_size/``
   (git-ignored; built once). T5-XXL (4.7B, 9.5 GB in bf16) is left out: it does not fit beside the
   transformer in this machine's share of memory; ``StableDiffusion3Pipeline`` accepts
   ``text_encoder_3=None`` and its part of the conditioning is then zeros of the real shape (256 x 4096),
   so the transformer's sequence (77 + 256 text tokens) and cost are those of the full model.
2. Iteration: a fresh project (params.yaml with ``model.kind: sd3``, ``dtype: bf16``, chains: 2 prompts x 2
   samples, T = 3, window 2, 64 px, eval on 2 prompts, the ``jpeg_compressibility`` reward: no reward
   model) and the stage commands dvc.yaml runs, ``tpgrpo stage NAME --iter 1``, each in its own process.
   A wrapper process around the CLI times the import of the CLI, the model loads (``load_policy``: the
   transformer + VAE from disk, LoRA attached) and the text encoders' load; compute = the rest of the
   process's wall time (``bench/stage_timer.py``). Peak resident memory: each process's own (VmHWM).
3. On paper (labelled so): each stage at the paper's per-GPU batch on one H200 from the FLOPs of one
   transformer forward row at 512 px (counted by ``torch.utils.flop_counter`` on the meta device), the
   stage's forward rows, an assumed model-FLOPs utilisation and the bytes to load at an assumed rate.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.common import REPO

CACHE = REPO / ".cache" / "real_size"
# eval_prompts (once per run, no --iter) encodes the held-out prompts for eval, as under dvc repro.
STAGES = ("eval_prompts", "rollout", "probe", "credit", "update", "eval")
ONCE = ("eval_prompts",)  # stages without --iter
ARTIFACTS = {"eval_prompts": ("../eval_prompt_embeds",),  # (under data/iters, beside the iteration folders)
             "rollout": ("trajectories.zarr", "prompt_embeds.safetensors"), "probe": ("probe.parquet",),
             "credit": ("credit.parquet",), "update": ("policy",), "eval": ("eval.parquet",)}
CLIP_L = dict(vocab_size=49408, hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
              num_attention_heads=12, max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu")
CLIP_G = dict(vocab_size=49408, hidden_size=1280, intermediate_size=5120, num_hidden_layers=32,
              num_attention_heads=20, max_position_embeddings=77, projection_dim=1280, hidden_act="gelu")
# The iteration here: the smallest sizes that keep every code path (CFG, window, probe, EMA-free update, eval).
PARAMS = {"model": {"kind": "sd3", "dtype": "bf16", "resolution": 64, "device": "cpu"},
          "task": {"reward": "jpeg_compressibility", "eval_reward": "jpeg_compressibility"},
          "sampling": {"num_steps": 3, "window_size": 2, "shift": 3.0, "guidance_scale": 4.5},
          "credit": {"mode": "tp"},  # TP-GRPO's path (the probe, log-probs), whatever the default run trains
          "rollout": {"prompts_per_iter": 2, "group_size": 2, "batch_size": 4},
          "probe": {"batch_size": 4}, "update": {"lora_rank": 32, "lora_alpha": 64, "micro_batch": 2,
                                                  "optimizer_steps_per_iter": 1, "epochs": 1,
                                                  "objective": "grpo"},
          "eval": {"every": 1, "num_steps": 3, "num_prompts": 2, "samples_per_prompt": 1},
          "train": {"iterations": 1},
          "tree": {"enabled": False}}  # a chain: the window and probe pass (pinned, whatever the default run trains)


def clip_tokenizer():
    """A real ``CLIPTokenizer`` (byte-level characters, no merges, 77 tokens): built offline."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0}
    for c in chars + [c + "</w>" for c in chars]:
        vocab.setdefault(c, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def build_folder(folder: Path, layers: int, text_layers: int | None = None) -> Path:
    """Write the SD3.5-M pipeline folder (random bf16 weights) to ``folder`` unless it is there already.

    ``layers`` transformer blocks (24: SD3.5-M); ``text_layers`` per CLIP encoder (None: theirs, 12 / 32);
    every width, head count and vocabulary is the published one whatever the depth.
    """
    if (folder / "model_index.json").is_file():
        return folder
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    from bench.bench_sd3 import SD35_MEDIUM_TRANSFORMER, SD3_VAE

    tok = clip_tokenizer()
    eos = tok.convert_tokens_to_ids("<|endoftext|>")
    torch.manual_seed(0)
    torch.set_default_dtype(torch.bfloat16)  # every weight is made in bf16: no fp32 copy of 2.5B parameters
    try:
        config = dict(SD35_MEDIUM_TRANSFORMER, num_layers=layers, dual_attention_layers=list(range(min(13, layers))))
        depth = {} if text_layers is None else {"num_hidden_layers": text_layers}
        encoders = [CLIPTextModelWithProjection(CLIPTextConfig(**{**c, **depth}, bos_token_id=0, eos_token_id=eos,
                                                               pad_token_id=eos)).eval() for c in (CLIP_L, CLIP_G)]
        pipe = StableDiffusion3Pipeline(
            transformer=SD3Transformer2DModel(**config).eval(), vae=AutoencoderKL(**SD3_VAE).eval(),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), text_encoder=encoders[0], tokenizer=tok,
            text_encoder_2=encoders[1], tokenizer_2=tok, text_encoder_3=None, tokenizer_3=None)
    finally:
        torch.set_default_dtype(torch.float32)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    pipe.save_pretrained(tmp, safe_serialization=True)
    tmp.rename(folder)
    return folder


def make_project(root: Path, model: Path) -> Path:
    """A fresh project at ``root``: the repo's params with ``PARAMS`` over them, its prompts and code."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "data").mkdir(parents=True)
    shutil.copytree(REPO / "data" / "prompts", root / "data" / "prompts")
    for code in ("stages", "tpgrpo"):
        shutil.copytree(REPO / code, root / code, ignore=shutil.ignore_patterns("__pycache__"))
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in PARAMS.items():
        params[section].update(values)
    params["model"]["path"] = str(model)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root / "params.yaml"


def child(stage: str, params: str, out: str) -> None:
    """Run ``tpgrpo stage STAGE --iter 1`` (no ``--iter`` for a stage of :data:`ONCE`) in this process, timed by
    ``bench/stage_timer.py``."""
    from bench.stage_timer import run_timed

    run_timed(["stage", stage, *([] if stage in ONCE else ["--iter", "1"]), "--params", params], Path(out))


def run_stage(stage: str, params: Path, threads: int) -> dict:
    """One stage in its own process; wall / import / load / compute seconds and its own peak RSS (GiB, VmHWM)."""
    timings = params.parent / f".{stage}.times.json"
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS=str(threads), DVC_NO_ANALYTICS="1")
    start = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "bench.real_size", "--child", stage, "--params", str(params),
                             "--timings", str(timings)], cwd=params.parent, env=env)
    if proc.wait() != 0:
        raise SystemExit(f"real_size: stage {stage} failed (exit {proc.returncode})")
    wall = time.perf_counter() - start
    t = json.loads(timings.read_text())
    load = t["load_s"] + t["text_load_s"]
    return {"stage": stage, "wall_s": wall, "import_s": t["import_s"], "load_s": t["load_s"],
            "text_load_s": t["text_load_s"], "compute_s": wall - t["import_s"] - load,
            "peak_rss_gib": t["peak_rss_gib"], "artifacts_mib": artifact_mib(params.parent, stage)}


def artifact_mib(root: Path, stage: str) -> float:
    """Bytes the stage wrote into ``data/iters/0001`` (its outputs), in MiB."""
    folder, total = root / "data" / "iters" / "0001", 0
    for name in ARTIFACTS[stage]:
        path = folder / name
        files = [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
        total += sum(p.stat().st_size for p in files)
    return total / 2**20


def folder_gib(folder: Path, *subfolders: str) -> float:
    return sum(p.stat().st_size for s in subfolders for p in (folder / s).rglob("*") if p.is_file()) / 2**30


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=24, help="transformer blocks (24 = SD3.5-M)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--build", action="store_true", help="only build the model folder")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--params", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--timings", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.params, args.timings)
    from bench.real_size_paper import paper_rows, print_tables

    t = time.perf_counter()
    CACHE.mkdir(parents=True, exist_ok=True)
    model = CACHE / f"sd35m-{args.layers}blocks"
    if args.build:
        return build_folder(model, args.layers)
    # Built in its own process: this one stays small while the stages run (and their peaks are their own).
    subprocess.run([sys.executable, "-m", "bench.real_size", "--build", "--layers", str(args.layers)], check=True,
                   env=dict(os.environ, PYTHONPATH=str(REPO)))
    print(f"model folder {model} ({folder_gib(model, '.'):.2f} GiB; built or found in "
          f"{time.perf_counter() - t:.0f} s)", flush=True)
    params = make_project(CACHE / "project", model)
    rows = []
    for stage in STAGES:
        rows.append(run_stage(stage, params, args.threads))
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in rows[-1].items()}), flush=True)
    weights = {"transformer": folder_gib(model, "transformer"), "vae": folder_gib(model, "vae"),
               "text": folder_gib(model, "text_encoder", "text_encoder_2")}
    paper = paper_rows(weights, args.layers)
    print_tables(rows, paper, os.getloadavg())
    if args.json:
        args.json.write_text(json.dumps({"measured": rows, "paper": paper, "weights_gib": weights}, indent=1))


if __name__ == "__main__":
    main()
