"""Each figure from small hand-made tables: a PNG of the expected size with the expected series."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
from PIL import Image

from tpgrpo.reports import plots

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def png_size(path):
    assert path.read_bytes()[:8] == PNG_MAGIC
    with Image.open(path) as image:
        image.load()
        return image.format, image.size


def history():
    return pd.DataFrame({
        "iteration": [-1, 0, 1, 2, 3],
        "eval_eval_reward": [0.40, np.nan, 0.45, np.nan, 0.50],  # iterations 0 and 2 not evaluated
        "eval_eval_strict_accuracy": [0.10, np.nan, 0.15, np.nan, 0.25]})


def test_reward_curves_draw_the_policy_and_the_base_line(tmp_path):
    fig = plots.reward_curves(history(), tmp_path / "curves.png", figsize=(8, 3), dpi=50)
    assert png_size(tmp_path / "curves.png") == ("PNG", (400, 150))
    reward_ax, strict_ax = fig.axes
    assert len(reward_ax.lines) == 2 and len(strict_ax.lines) == 2  # the curve and the base line
    curve, base = reward_ax.lines
    assert list(curve.get_xdata()) == [1, 3] and list(curve.get_ydata()) == [0.45, 0.50]
    assert list(base.get_ydata()) == [0.40, 0.40]
    assert list(strict_ax.lines[1].get_ydata()) == [0.10, 0.10]


def test_reward_curves_take_the_base_row_by_its_iteration(tmp_path):
    renumbered = history().assign(iteration=[0, 1, 2, 3, 4])  # base = policy 0
    fig = plots.reward_curves(renumbered, tmp_path / "c.png", base_iteration=0)
    assert list(fig.axes[0].lines[0].get_xdata()) == [2, 4]
    with pytest.raises(ValueError, match="iteration -1"):
        plots.reward_curves(renumbered, tmp_path / "c.png")


def probe_and_credit():
    """Two groups; group 'a' has three trajectories (K = 3): D > 0, D < 0, D > 0; two turning points."""
    q = {0: [0.2, 0.1, 0.5, 0.6], 1: [0.6, 0.7, 0.3, 0.2], 2: [0.3, 0.4, 0.4, 0.5], 3: [0.1, 0.1, 0.1, 0.1]}
    prompt = {0: "a", 1: "a", 2: "a", 3: "b"}
    probe = pd.DataFrame([{"trajectory": t, "prompt_id": prompt[t], "prompt": f"prompt {prompt[t]}", "step": k,
                           "reward": r} for t, rs in q.items() for k, r in enumerate(rs)])
    tps = {(0, 1), (2, 0)}
    credit = pd.DataFrame([{"trajectory": t, "step": k, "turning_point": (t, k) in tps,
                            "trend": float(np.sign(rs[-1] - rs[0]))} for t, rs in q.items() for k in range(3)])
    return probe, credit


def test_turning_point_view_draws_a_curve_per_trajectory_and_marks_turning_points(tmp_path):
    probe, credit = probe_and_credit()
    fig = plots.turning_point_view(probe, credit, tmp_path / "fig1.png", figsize=(6, 4), dpi=60)
    assert png_size(tmp_path / "fig1.png") == ("PNG", (360, 240))
    ax = fig.axes[0]
    assert len(ax.lines) == 3 + 2  # three trajectories of group 'a' (picked: most turning points), two thick steps
    assert [line.get_color() for line in ax.lines[:3]] == ["tab:blue", "tab:red", "tab:blue"]  # sign of D
    assert [line.get_linewidth() for line in ax.lines[3:]] == [3.2, 3.2]
    assert [list(line.get_xdata()) for line in ax.lines[3:]] == [[1, 2], [0, 1]]  # steps 1 and 0
    assert len(ax.collections) == 1
    stars = ax.collections[0].get_offsets()
    assert sorted(map(tuple, np.asarray(stars))) == [(1.0, 0.4), (2.0, 0.5)]  # Q_{k+1} of each turning step
    assert "prompt a" in ax.get_title()


def test_turning_point_view_takes_a_credit_table_with_prompt_ids_as_credit_parquet_has(tmp_path):
    probe, credit = probe_and_credit()
    credit = credit.merge(probe[["trajectory", "prompt_id"]].drop_duplicates(), on="trajectory")
    fig = plots.turning_point_view(probe, credit, tmp_path / "fig1.png", figsize=(6, 4), dpi=60)
    assert len(fig.axes[0].lines) == 3 + 2 and "prompt a" in fig.axes[0].get_title()


def test_turning_point_view_of_a_group_without_turning_points(tmp_path):
    probe, credit = probe_and_credit()
    fig = plots.turning_point_view(probe, credit, tmp_path / "b.png", prompt_id="b")
    assert len(fig.axes[0].lines) == 1 and len(fig.axes[0].collections) == 0
    assert fig.axes[0].lines[0].get_color() == "tab:gray"


def test_turning_point_rates_and_heatmap(tmp_path):
    _, credit = probe_and_credit()
    tables = {1: credit, 2: credit.assign(turning_point=False), 3: credit.assign(turning_point=True)}
    rates = plots.turning_point_rates(tables)
    assert rates.shape == (3, 3) and list(rates.columns) == [1, 2, 3] and list(rates.index) == [0, 1, 2]
    np.testing.assert_allclose(rates[1].to_numpy(), [0.25, 0.25, 0.0])
    assert (rates[2] == 0).all() and (rates[3] == 1).all()
    long = pd.concat([t.assign(iteration=i) for i, t in tables.items()])
    pd.testing.assert_frame_equal(plots.turning_point_rates(long), rates)
    fig = plots.turning_point_heatmap(tables, tmp_path / "heat.png", figsize=(5, 3), dpi=80)
    assert png_size(tmp_path / "heat.png") == ("PNG", (400, 240))
    ax = fig.axes[0]
    assert len(ax.images) == 1 and ax.images[0].get_array().shape == (3, 3)
    assert len(fig.axes) == 2  # the heat map and its colour bar


def test_before_after_grid_shows_each_pair(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    final = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    labels = ["a red circle", "two blue squares next to a very long prompt text", "a sign that says 55"]
    fig = plots.before_after_grid(base, final, labels, tmp_path / "grid.png", cell_inches=1.0, dpi=50)
    assert png_size(tmp_path / "grid.png") == ("PNG", (180, 145))  # (3 + 0.6) x (2 + 0.9) inches at 50 dpi
    assert len(fig.axes) == 6 and all(len(ax.images) == 1 for ax in fig.axes)
    np.testing.assert_array_equal(fig.axes[3].images[0].get_array(), final[0])  # row 2, column 1
    with pytest.raises(ValueError, match="labels"):
        plots.before_after_grid(base, final, labels[:2], tmp_path / "bad.png")
    with pytest.raises(ValueError, match="uint8"):
        plots.before_after_grid(base, final[:2], labels, tmp_path / "bad.png")
    assert not (tmp_path / "bad.png").exists()


def test_before_after_grid_frames_each_image_by_its_verdict(tmp_path):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    final = rng.integers(0, 256, (3, 16, 16, 3), dtype=np.uint8)
    verdicts = (np.array([False, False, True]), np.array([True, False, True]))
    fig = plots.before_after_grid(base, final, ["a", "b", "c"], tmp_path / "grid.png", cell_inches=1.0, dpi=50,
                                  verdicts=verdicts, row_names=("base model", "policy 9"))
    colours = [ax.spines["top"].get_edgecolor() for ax in fig.axes]
    green, red = (0x1a / 255, 0x96 / 255, 0x41 / 255, 1.0), (0xd7 / 255, 0x19 / 255, 0x1c / 255, 1.0)
    assert colours == [red, red, green, green, red, green]
    assert fig.axes[0].get_ylabel() == "base model\n1 of 3 right"
    assert fig.axes[3].get_ylabel() == "policy 9\n2 of 3 right"


def test_same_inputs_same_bytes_and_no_temp_files(tmp_path):
    probe, credit = probe_and_credit()
    for name in ("one.png", "two.png"):
        plots.turning_point_view(probe, credit, tmp_path / name)
        plots.reward_curves(history(), tmp_path / f"curves-{name}")
    assert (tmp_path / "one.png").read_bytes() == (tmp_path / "two.png").read_bytes()
    assert (tmp_path / "curves-one.png").read_bytes() == (tmp_path / "curves-two.png").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curves-one.png", "curves-two.png", "one.png", "two.png"]


def test_missing_columns_are_named(tmp_path):
    probe, credit = probe_and_credit()
    with pytest.raises(ValueError, match=r"credit table: missing columns \['trend'\]"):
        plots.turning_point_view(probe, credit.drop(columns="trend"), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
