"""GenEval-style rewards: clean renders pass, violations cost, noise earns nothing, soft ranks ties."""

import numpy as np
import pytest

from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.render import degrade, render_objects, render_prompt, render_violation
from tpgrpo.tasks.rewards import REWARD_NAMES, RewardResult, get_reward

SETS = build_prompt_sets()
EVAL = SETS["compositional_eval"] * 2  # 216 held-out prompt renders
GENEVAL = get_reward("geneval")
SOFT = get_reward("geneval_soft")


@pytest.fixture(scope="module")
def clean():
    rng = np.random.default_rng(0)
    images = np.stack([render_prompt(m, rng) for m in EVAL])
    return images, GENEVAL(images, EVAL), SOFT(images, EVAL)


def _render(metas, violation, seed=1):
    rng = np.random.default_rng(seed)
    return np.stack([render_violation(m, violation, rng) for m in metas])


def test_registry():
    assert set(REWARD_NAMES) == {"geneval", "geneval_soft", "ocr", "jpeg_compressibility", "pickscore",
                                 "geneval_detector", "geneval_detector_soft", "aesthetic", "remote"}
    with pytest.raises(ValueError, match="geneval, geneval_soft, ocr, jpeg_compressibility, pickscore"):
        get_reward("pickscor")
    with pytest.raises(ValueError, match="reads params"):  # model rewards are built from a config
        get_reward("pickscore")


def test_clean_eval_renders_get_full_reward(clean):
    _, hard, soft = clean
    assert isinstance(hard, RewardResult)
    assert hard.reward.dtype == np.float64 and hard.reward.shape == (len(EVAL),)
    assert hard.strict.dtype == bool
    assert np.mean(hard.reward == 1.0) >= 0.99 and np.mean(hard.strict) >= 0.99
    assert np.mean(soft.reward >= 0.9) >= 0.99
    assert np.array_equal(soft.strict, hard.strict)


@pytest.mark.parametrize("violation", ["wrong_count", "wrong_color", "wrong_shape", "extra_object"])
def test_violations_cost_under_both_rewards(clean, violation):
    _, hard, soft = clean
    bad = _render(EVAL, violation)
    for reward, ref in ((GENEVAL, hard), (SOFT, soft)):
        result = reward(bad, EVAL)
        assert np.all(result.reward < ref.reward), reward.name
        assert not result.strict.any()


def test_wrong_side_costs(clean):
    _, hard, soft = clean
    idx = [i for i, m in enumerate(EVAL) if m["kind"] == "position"]
    metas = [EVAL[i] for i in idx]
    bad = _render(metas, "wrong_side")
    assert np.all(GENEVAL(bad, metas).reward < hard.reward[idx])
    assert np.all(SOFT(bad, metas).reward < soft.reward[idx])


@pytest.mark.parametrize("violation", ["speckle", "blank"])
def test_noise_and_blank_earn_nothing(violation):
    images = _render(EVAL, violation)
    for reward in (GENEVAL, SOFT):
        result = reward(images, EVAL)
        assert result.reward.max() < 0.2 and not result.strict.any()


def test_junk_everywhere_is_not_a_hack():
    """Drawing every colour-shape combination satisfies any prompt's objects, but extras cost."""
    rng = np.random.default_rng(3)
    combos = [(c, s) for c in ("red", "green", "blue", "yellow") for s in ("circle", "square", "triangle")]
    metas = [m for m in EVAL if m["kind"] == "single"]
    for meta in metas:  # the prompt's object plus five others (0.75 ** 5 = 0.24)
        target = (meta["objects"][0]["color"], meta["objects"][0]["shape"])
        objects = [target] + [c for c in combos if c != target][:5]
        image = render_objects(objects, rng)[None]
        for reward in (GENEVAL, SOFT):
            result = reward(image, [meta])
            assert result.reward[0] < 0.25 and not result.strict[0]


def test_perfect_image_of_another_prompt_scores_lower(clean):
    images, hard, soft = clean
    n = len(EVAL) // 2

    def objects(meta):
        return sorted((o["color"], o["shape"]) for o in meta["objects"] for _ in range(o["count"]))

    # Pair each prompt with the render of the next prompt that asks for other objects (the next
    # prompt is often a rephrasing: "A and B" / "B and A", "A left of B" / "B right of A").
    other = [next(j % n for j in range(i + 1, i + n) if objects(EVAL[j % n]) != objects(EVAL[i]))
             for i in range(n)]
    for reward, ref in ((GENEVAL, hard), (SOFT, soft)):
        result = reward(images[other], EVAL[:n])
        assert np.all(result.reward < ref.reward[:n]) and not result.strict.any()


@pytest.mark.parametrize("kind, amount", [("blur", 0.5), ("color_shift", 40.0), ("noise", 10.0)])
def test_soft_ranks_what_geneval_ties(clean, kind, amount):
    images, hard, soft = clean
    degraded = np.stack([degrade(im, kind, amount, np.random.default_rng(i)) for i, im in enumerate(images)])
    hard_d, soft_d = GENEVAL(degraded, EVAL), SOFT(degraded, EVAL)
    tied = hard_d.reward == hard.reward
    assert tied.mean() >= 0.9  # the discrete rules mostly cannot tell clean from degraded ...
    assert np.all(soft_d.reward[tied] < soft.reward[tied])  # ... the soft reward always can
    assert np.all(soft_d.reward >= 0.5)  # and a mild degradation is not punished like a violation


def test_soft_is_graded_in_degradation_strength(clean):
    images, _, _ = clean
    means = [SOFT(np.stack([degrade(im, "blur", s) for im in images]), EVAL).reward.mean()
             for s in (0.0, 0.4, 0.6, 0.8)]
    assert means[0] == pytest.approx(1.0) and np.all(np.diff(means) < 0)


def test_input_validation(clean):
    images, _, _ = clean
    with pytest.raises(ValueError, match="uint8"):
        GENEVAL(images.astype(np.float32), EVAL)
    with pytest.raises(ValueError, match=r"\(N, H, W, 3\)"):
        GENEVAL(images[..., :1], EVAL)
    with pytest.raises(ValueError, match="images but"):
        GENEVAL(images[:3], EVAL[:2])
    with pytest.raises(ValueError, match="'text'"):
        GENEVAL(images[:1], SETS["text_eval"][:1])
    with pytest.raises(ValueError, match="'compositional'"):
        get_reward("ocr")(images[:1], EVAL[:1])
    empty = SOFT(images[:0], [])
    assert empty.reward.shape == (0,) and empty.strict.shape == (0,)


def test_jpeg_compressibility_prefers_flat_images_and_scores_any_task():
    from tpgrpo.tasks.rewards import get_reward

    rng = np.random.default_rng(0)
    noise = rng.integers(0, 256, (2, 32, 32, 3), dtype=np.uint8)
    flat = np.full((2, 32, 32, 3), 200, dtype=np.uint8)
    metas = [{"task": "compositional"}, {"task": "text"}] * 2
    out = get_reward("jpeg_compressibility")(np.concatenate([noise, flat]), metas)
    assert out.reward[:2].max() < out.reward[2:].min()
    assert ((out.reward >= 0) & (out.reward <= 1)).all() and not out.strict.any()
