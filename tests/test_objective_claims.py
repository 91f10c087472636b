"""The comparison's claims about the forward-process objectives (DiffusionNFT, AWM) and TP's tree credit inside
them: made when a root has one of their arms, decided from the same paired intervals as every claim."""

from __future__ import annotations

from test_comparison import fake_run, make_comparison, noisy

from tpgrpo.comparison.claims import OBJECTIVE_CLAIMS, collect


def test_objective_arms_get_their_claims_decided(tmp_path):
    base = noisy(0.3, 0)
    arms = {  # variant: (credit mode, overrides, held-out mean at iteration 4)
        "flow_grpo": ("flow_grpo", {"update.objective": "grpo"}, 0.35),
        "nft": ("flow_grpo", {"update.objective": "nft"}, 0.6),
        "tree-tp-nft": ("tp", {"update.objective": "nft", "update.split_levels": True, "tree.enabled": True}, 0.6),
    }
    for variant, (mode, overrides, final) in arms.items():
        for seed in (0, 1, 2):
            fake_run(tmp_path, variant, mode, seed, {0: base, 4: noisy(final, 10 * seed + len(variant))}, 4,
                     overrides=overrides)
    claims = collect(tmp_path, n_boot=200)["claims"].set_index("claim")["verdict"]
    assert claims["DiffusionNFT beats Flow-GRPO at the same iteration"] == "confirmed"
    # the same mean gain with and without TP's credit: no verdict either way
    assert claims["TP's tree step credit inside DiffusionNFT beats plain DiffusionNFT at the same iteration"] == \
        "not detectable"
    for arm_missing in ("AWM beats Flow-GRPO at the same iteration", "DiffusionNFT beats AWM at the same iteration",
                        "TP's tree step credit inside AWM beats plain AWM at the same iteration",
                        "DiffusionNFT beats TP-GRPO on trees at the same iteration"):
        assert claims[arm_missing] == "not run"


def test_a_root_without_objective_arms_makes_no_objective_claims(tmp_path):
    make_comparison(tmp_path)
    claims = set(collect(tmp_path, n_boot=100)["claims"]["claim"])
    assert claims and not claims & {c.text for c in OBJECTIVE_CLAIMS}


def test_best_learning_rate_is_chosen_within_an_arm_not_across_arms_sharing_a_credit_mode(tmp_path):
    """NFT and AWM train on Flow-GRPO's credit mode: the best-lr pick for Flow-GRPO must choose between its own
    runs (the main arm and its sweep), however high NFT's training reward."""
    import json

    from tpgrpo.comparison.claims import best_variants
    from tpgrpo.comparison.results import collect_curves
    from tpgrpo.comparison.runs import discover

    base = noisy(0.3, 0)
    arms = {"flow_grpo": ({"update.objective": "grpo"}, "main", "", 1.0),
            "flow_grpo-lr0.0003": ({"update.objective": "grpo", "update.lr": 3e-4}, "lr_sweep", "flow_grpo", 2.0),
            "nft": ({"update.objective": "nft"}, "main", "", 5.0)}
    for variant, (overrides, family, reference, train_scale) in arms.items():
        for seed in (0, 1):
            folder = fake_run(tmp_path, variant, "flow_grpo", seed, {0: base, 2: noisy(0.4, seed)}, 2,
                              family=family, reference=reference, overrides=overrides)
            for log in folder.glob("data/iters/*/rollout.json"):
                record = json.loads(log.read_text())
                log.write_text(json.dumps({**record, "mean_reward": train_scale * record["mean_reward"]}))
    runs = discover(tmp_path)
    best = best_variants(runs, collect_curves(runs)[0])
    assert best == {"flow_grpo": "flow_grpo-lr0.0003", "nft": "nft"}
    claims = collect(tmp_path, n_boot=100)["claims"].set_index("claim")
    nft_best = claims.loc["DiffusionNFT beats Flow-GRPO at the same iteration, each at its best learning rate"]
    assert (nft_best["a"], nft_best["b"]) == ("nft", "flow_grpo-lr0.0003")
