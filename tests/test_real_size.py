"""bench/real_size.py's path at SD3.5-M's real widths with a few blocks: the pipeline folder it builds, one
iteration through the stage commands in their own processes, and what it measures per stage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def test_stage_flops_follow_the_paper_recipe():
    from bench.real_size_paper import GPUS, TRAJECTORIES, stage_flops

    flops = stage_flops(row=1.0, decode=0.0)
    per_gpu = TRAJECTORIES / GPUS  # 36 trajectories
    assert flops["rollout"] == per_gpu * 20  # T = 10 steps x 2 CFG rows
    assert flops["probe"] == per_gpu * 2 * 45  # states 1..9 completed over 9 + 8 + ... + 1 steps
    assert flops["update"] == per_gpu * 9 * 2 * 3  # 9 transitions, forward + backward


@pytest.mark.slow
def test_real_widths_one_iteration_through_the_stage_commands(tmp_path):
    import zarr

    from bench import real_size

    model = real_size.build_folder(tmp_path / "model", layers=2, text_layers=1)
    transformer = json.loads((model / "transformer" / "config.json").read_text())
    assert (transformer["num_attention_heads"], transformer["attention_head_dim"],
            transformer["joint_attention_dim"], transformer["num_layers"]) == (24, 64, 4096, 2)
    clip_g = json.loads((model / "text_encoder_2" / "config.json").read_text())
    assert (clip_g["hidden_size"], clip_g["vocab_size"], clip_g["torch_dtype" if "torch_dtype" in clip_g
                                                                  else "dtype"]) == (1280, 49408, "bfloat16")
    assert not (model / "text_encoder_3").exists()  # T5 left out, as diffusers allows

    params = real_size.make_project(tmp_path / "project", model)
    rows = {stage: real_size.run_stage(stage, params, threads=2) for stage in real_size.STAGES}
    d = params.parent / "data" / "iters" / "0001"
    states = zarr.open_group(str(d / "trajectories.zarr"), mode="r")["states"]
    assert states.shape == (4, 3, 16, 8, 8)  # 2 prompts x 2 samples, window 2 (+1 state), 64 px
    update = json.loads((d / "update.json").read_text())
    assert update["first_pass_ratio_max_dev"] <= 1e-3  # bf16 re-scores its own rollout
    for stage in ("rollout", "probe", "update", "eval"):  # every model stage loads the model
        assert rows[stage]["load_s"] > 0 and rows[stage]["peak_rss_gib"] > 0.5, rows[stage]
    # The text encoders load where prompts are encoded (rollout; eval_prompts once per run for every eval), not
    # where embeddings are cached (probe, update, eval).
    assert rows["rollout"]["text_load_s"] > 0 and rows["eval_prompts"]["text_load_s"] > 0
    assert rows["probe"]["text_load_s"] == rows["update"]["text_load_s"] == rows["eval"]["text_load_s"] == 0
    assert rows["credit"]["load_s"] == 0
    assert rows["rollout"]["artifacts_mib"] > 0 and rows["update"]["artifacts_mib"] > 0
