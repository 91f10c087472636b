"""Digest of the chain's artifact data after iteration 1 of the tiny test project, and the params hash its
artifacts carry, to show that a change leaves the chain's numbers and recorded params alone (the tree rollout's
work was checked this way: the tree keys live in the params' own `tree` section, which no chain stage lists).

    git archive 11d501c | tar -x -C /tmp/old
    (cd /tmp/old && OMP_NUM_THREADS=1 PYTHONPATH=/tmp/old python $OLDPWD/bench/studies/chain_identity.py /tmp/old /tmp/old.json)
    OMP_NUM_THREADS=1 PYTHONPATH=. python -m bench.studies.chain_identity . /tmp/new.json && diff /tmp/old.json /tmp/new.json

argv[1]: the checkout whose params.yaml and prompts to use (its code first on PYTHONPATH); argv[2]: the output JSON;
argv[3] (optional): more ``update`` overrides as JSON, e.g. '{"epochs": 2, "optimizer_steps_per_iter": 4}'. A
checkout that has ``update.min_transitions_per_step`` gets 1, so its step count is the fixed one
older checkouts take: the comparison is of the code, not of the step rule.
Digests (md5): every ``trajectories.zarr`` array, the probe and credit tables' contents, the LoRA weights; and
the ``config_hash`` of the store and of the probe and credit tables (each stage's params, hashed).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# tests/conftest.py's tiny project: its model and overrides, written here so an old checkout runs it too
TINY_MODEL = dict(image_size=32, patch_size=8, num_layers=1, num_heads=2, head_dim=16, text_layers=1,
                  text_hidden=32, text_heads=2, text_intermediate=64)
OVERRIDES = {"task": {"reward": "jpeg_compressibility"}, "sampling": {"num_steps": 4, "window_size": 3},
             "rollout": {"prompts_per_iter": 3, "group_size": 4, "batch_size": 8}, "probe": {"batch_size": 8},
             "update": {"lora_rank": 4, "lora_alpha": 8, "micro_batch": 8, "optimizer_steps_per_iter": 2, "epochs": 1,
                        "lr": 1.0e-2, "clip_range": 0.2}}


def make_project(code: Path, root: Path, update: dict | None = None) -> Path:
    """The tiny project: a fresh tiny model, ``code``'s prompts and params.yaml with ``OVERRIDES``."""
    import yaml

    from tpgrpo.models.tiny import TinyConfig, build_tiny

    build_tiny(TinyConfig(**TINY_MODEL), seed=0).save_pretrained(root / "data" / "base")
    shutil.copytree(code / "data" / "prompts", root / "data" / "prompts")
    raw = yaml.safe_load((code / "params.yaml").read_text())
    for section, values in OVERRIDES.items():
        raw[section].update(values)
    raw["update"].update(update or {})
    if "min_transitions_per_step" in raw["update"]:
        raw["update"]["min_transitions_per_step"] = 1
    if "tree" in raw:  # a chain, pinned (a checkout older than the tree rollout has no tree)
        raw["tree"]["enabled"] = False
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


def digests(d: Path) -> dict:
    """md5 of each store array, each table's contents (and its columns), the adapter's weights."""
    import numpy as np
    import pandas as pd
    import pyarrow.parquet as pq
    import zarr
    from safetensors.torch import load_file

    md5 = lambda b: hashlib.md5(b).hexdigest()  # noqa: E731
    store = zarr.open_group(str(d / "trajectories.zarr"), mode="r")
    out = {f"zarr/{k}": md5(np.ascontiguousarray(store[k][:]).tobytes()) for k in sorted(store.array_keys())}
    for name in ("probe", "credit"):
        frame = pd.read_parquet(d / f"{name}.parquet")
        out[name] = md5(pd.util.hash_pandas_object(frame, index=True).values.tobytes())
        out[f"{name}_columns"] = list(frame.columns)
        out[f"{name}_config_hash"] = pq.read_schema(d / f"{name}.parquet").metadata[b"tpgrpo.config_hash"].decode()
    out["rollout_config_hash"] = store.attrs["config_hash"]
    weights = load_file(str(d / "policy" / "pytorch_lora_weights.safetensors"))
    out["lora"] = md5(b"".join(weights[k].numpy().tobytes() for k in sorted(weights)))
    return out


def main() -> None:
    from tpgrpo.config import load_config

    code, output = Path(sys.argv[1]).resolve(), Path(sys.argv[2])
    with tempfile.TemporaryDirectory() as tmp:
        root = make_project(code, Path(tmp) / "project", json.loads(sys.argv[3]) if len(sys.argv) > 3 else None)
        load_config(root / "params.yaml")  # a bad params.yaml: its one line here
        for name in ("rollout", "probe", "credit", "update"):  # each as `tpgrpo stage` runs it, with this code
            subprocess.run([sys.executable, "-m", "tpgrpo", "stage", name, "--iter", "1", "--params",
                            str(root / "params.yaml")], cwd=root, check=True)
        output.write_text(json.dumps(digests(root / "data" / "iters" / "0001"), indent=1, sort_keys=True))


if __name__ == "__main__":
    main()
