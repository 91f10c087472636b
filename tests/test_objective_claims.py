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
