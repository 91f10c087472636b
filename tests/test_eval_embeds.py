"""The held-out prompts' embeddings, encoded once (stage eval_prompts) and read by eval and baseline:
the same tables as encoding in the stage, no text encoders loaded, and a stale or damaged cache never used."""

from __future__ import annotations

import json

import pytest
import yaml
from tiny_pipelines import cli, make_pipeline_project, run_stages

from conftest import tiny_params
from tpgrpo.policy.eval_embeds import EVAL_EMBEDS, chunk_file
from tpgrpo.stage_params import MODEL_PARAMS

# 3 prompts x 2 seeds in chunks of 4 images: two chunks, the second smaller (6 rows).
EVAL = {"num_prompts": 3, "samples_per_prompt": 2}


def stage(root, name, iteration=None):
    args = ["stage", name, "--params", str(root / "params.yaml")] + ([] if iteration is None else
                                                                     ["--iter", str(iteration)])
    return cli(*args)


def ok(root, name, iteration=None):
    result = stage(root, name, iteration)
    assert result.exit_code == 0, result.output
    return result


def set_params(root, **sections):
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(**sections), sort_keys=False))


def no_encoding(monkeypatch, backend_class):
    def refuse(self, prompts):
        raise AssertionError(f"encode_prompts called for {len(prompts)} prompts")
    monkeypatch.setattr(backend_class, "encode_prompts", refuse)


@pytest.fixture
def project(tiny_project):
    set_params(tiny_project, eval=EVAL, rollout={"batch_size": 4})
    return tiny_project


def test_eval_stages_read_the_cache_and_write_the_same_tables(project, monkeypatch):
    from tpgrpo.models.tiny import TinyBackend

    root, iters = project, project / "data" / "iters"
    run_stages(root, 1)
    ok(root, "baseline")
    ok(root, "eval", 1)
    encoded = {p: (iters / p).read_bytes() for p in ("baseline_eval.parquet", "0001/eval.parquet")}
    ok(root, "eval_prompts")
    assert sorted(p.name for p in (root / EVAL_EMBEDS).iterdir()) == ["chunk_0000.safetensors",
                                                                     "chunk_0001.safetensors"]
    for p in encoded:
        (iters / p).unlink()
    no_encoding(monkeypatch, TinyBackend)  # with the cache, neither stage encodes a prompt
    ok(root, "baseline")
    ok(root, "eval", 1)
    assert {p: (iters / p).read_bytes() for p in encoded} == encoded  # byte for byte


@pytest.mark.parametrize("stale", ["prompts", "model"])
def test_a_cache_of_other_prompts_or_model_params_is_encoded_again(project, stale):
    import pandas as pd
    import torch

    from tpgrpo.config import load_config
    from tpgrpo.io.artifacts import read_embeddings, write_embeddings
    from tpgrpo.policy.eval_embeds import chunk_key

    root, table = project, project / "data" / "iters" / "baseline_eval.parquet"
    ok(root, "baseline")
    reference = pd.read_parquet(table)
    ok(root, "eval_prompts")
    cfg = load_config(root / "params.yaml")
    path = chunk_file(root / EVAL_EMBEDS, 0)
    key = read_embeddings_key(path)
    tensors = read_embeddings(path, key)
    garbage = {name: torch.full_like(t, 3.0) for name, t in tensors.items()}  # a different, valid file
    if stale == "prompts":  # e.g. written before task.eval_prompts changed
        key["prompts"] = json.dumps(list(reversed(json.loads(key["prompts"]))))
    else:  # written under other model params; then model.resolution spelled out (the same images)
        set_params(root, eval=EVAL, rollout={"batch_size": 4}, model={"resolution": 32})
        assert chunk_key(load_config(root / "params.yaml"), json.loads(key["prompts"]))["model"] != key["model"]
        assert cfg.params_hash(MODEL_PARAMS) == key["model"]
    write_embeddings(path, garbage, key)
    result = ok(root, "baseline")
    assert "holds other prompts or model params: encoding chunk 0 again" in result.output
    # (not the bytes: the table's metadata carries the hash of the model params)
    pd.testing.assert_frame_equal(pd.read_parquet(table), reference, check_exact=True)  # trusting: garbage


def read_embeddings_key(path):
    from safetensors import safe_open

    from tpgrpo.io.schemas import EMBEDDING_CHECKSUM

    with safe_open(str(path), framework="pt") as f:
        meta = dict(f.metadata())
    meta.pop(EMBEDDING_CHECKSUM)
    return meta


def test_a_damaged_cache_is_a_one_line_error(project):
    ok(project, "eval_prompts")
    path = chunk_file(project / EVAL_EMBEDS, 1)
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # a flipped bit in the last tensor's bytes: same size, a valid file
    path.write_bytes(bytes(data))
    result = stage(project, "baseline")
    assert result.exit_code == 2, result.output
    errors = [line for line in result.output.splitlines() if line.startswith("error:")]  # (progress bars aside)
    assert len(errors) == 1 and "chunk_0001.safetensors: damaged" in errors[0], result.output
    assert "Traceback" not in result.output
    assert not (project / "data" / "iters" / "baseline_eval.parquet").exists()


def test_a_missing_cache_is_encoded_with_one_line(project):
    result = ok(project, "baseline")
    assert f"{EVAL_EMBEDS}/chunk_0000.safetensors is missing: encoding chunk 0 again" in result.output


def test_sd3_eval_never_loads_the_text_encoders_with_the_cache(sd3_model_dir, tmp_path, monkeypatch):
    from tpgrpo.models.sd3 import SD3Backend

    root = make_pipeline_project(tmp_path / "p", sd3_model_dir, "sd3", eval={**EVAL, "num_steps": 2})
    table = root / "data" / "iters" / "baseline_eval.parquet"
    ok(root, "baseline")
    encoded = table.read_bytes()
    ok(root, "eval_prompts")
    table.unlink()

    def refuse(self):
        raise AssertionError("the text encoders were loaded")
    monkeypatch.setattr(SD3Backend, "_text_pipeline", refuse)
    ok(root, "baseline")
    assert table.read_bytes() == encoded


def _held_out_project(root, num_prompts):
    import shutil

    from conftest import REPO

    shutil.copytree(REPO / "data" / "prompts", root / "data" / "prompts")
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(eval={"num_prompts": num_prompts}),
                                                     sort_keys=False))
    return root


def test_more_eval_prompts_than_the_file_holds_is_one_line(tmp_path):
    """The compositional eval file holds 108 prompts: 108 are evaluated, 109 is an error naming the key, the
    file and both counts (was: cut to 108 in silence), raised by eval_prompts before any model loads (there is
    none in this project)."""
    from tpgrpo.config import load_config
    from tpgrpo.errors import PipelineError
    from tpgrpo.policy.eval_embeds import held_out

    root = _held_out_project(tmp_path, 108)
    metas, _ = held_out(load_config(root / "params.yaml"), root)
    assert len(metas) == 108 * 2 and len({m["id"] for m in metas}) == 108
    _held_out_project(tmp_path / "over", 109)
    expected = ("eval.num_prompts = 109 but task.eval_prompts data/prompts/compositional_eval.jsonl has 108 "
                "prompts: expected at most 108")
    with pytest.raises(PipelineError, match="^" + expected.replace(".", r"\.") + "$"):
        held_out(load_config(tmp_path / "over" / "params.yaml"), tmp_path / "over")
    result = stage(tmp_path / "over", "eval_prompts")
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1] == "error: " + expected
