"""Seconds to load an SD3 folder's transformer + VAE (``load_sd3``) with and without computing the sin-cos table.

    python -m bench.load_sd3 .cache/real_size/sd35m-24blocks --repeats 3   # after bench/real_size.py

diffusers' ``PatchEmbed`` computes SD3.5-M's 384 x 384 x 1536 positional table at construction and
``from_pretrained`` then overwrites it with the file's copy; ``load_sd3`` skips the computation when the file
holds it (``tpgrpo.models.sd3._no_pos_embed_table``). "before" forces the stock path by making
``_stores_pos_embed`` answer False. Runs alternate (before, after, before, ...) so machine load hits both;
prints each and the ratio of the medians. The files are in the page cache after the first run: this is the
load from memory, not from disk.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path



def load_seconds(folder: Path, skip: bool) -> float:
    import torch

    from tpgrpo.models import sd3

    stores = sd3._stores_pos_embed
    sd3._stores_pos_embed = stores if skip else (lambda _folder: False)
    try:
        start = time.perf_counter()
        backend = sd3.load_sd3(folder, dtype=torch.bfloat16, resolution=64)
        seconds = time.perf_counter() - start
    finally:
        sd3._stores_pos_embed = stores
    del backend
    return seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    import diffusers  # noqa: F401  (imported before timing: the import is not the load)

    times = {"before": [], "after": []}
    for _ in range(args.repeats):
        for name, skip in (("before", False), ("after", True)):
            times[name].append(load_seconds(args.folder, skip))
            print(f"{name}: {times[name][-1]:.2f} s", flush=True)
    before, after = (statistics.median(times[k]) for k in ("before", "after"))
    print(f"median load_sd3: before {before:.2f} s, after {after:.2f} s, ratio {before / after:.2f}x")


if __name__ == "__main__":
    main()
