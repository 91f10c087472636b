"""Did one update move each trained transition's log-prob the way its advantage says? (asked when a tree's
held-out geneval_soft reward fell as it trained)

    python -m bench.studies.update_direction RUN_FOLDER [ITERATION]    # a trained run folder (chain or tree), default 1

Re-scores iteration i's stored transitions that have a non-zero advantage under the policy that sampled them
(policy i - 1) and under the one its update wrote (policy i), with the update's own scoring
(``tpgrpo.policy.update.rescore``), and prints: how many transitions, max |log-prob under policy i - 1 -
stored log-prob| (0 on the run's own machine: the store is that policy's), the correlation of the change in
log-prob with the advantage, the mean change for A > 0 and A < 0, and sum A x change (the first-order gain of
the surrogate; > 0 when the step went the advantages' way). Runs in the folder with its own code copy
(``stages/``, ``tpgrpo/`` that ``tpgrpo compare run`` linked there), on the CPU.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import numpy as np


def rescore(cfg, root: Path, policy_iteration: int, iteration: int, batch, attrs, n_idx, k_idx):
    """``(M,)`` log-probs of transitions ``(n_idx, k_idx)`` of ``iteration``'s store under the policy that
    iteration ``policy_iteration`` samples from (``load_policy``: policy ``policy_iteration - 1``)."""
    import torch

    from tpgrpo.policy.loading import load_policy, prompt_embeddings, sampling_from_attrs
    from tpgrpo.policy.update import rescore

    backend = load_policy(cfg, root, policy_iteration)
    embeds = prompt_embeddings(cfg, root, iteration, backend, [m["prompt"] for m in attrs["prompts"]])
    sampling, out = sampling_from_attrs(attrs), []
    with torch.no_grad():
        for start in range(0, n_idx.numel(), 64):
            step, _ = rescore(backend, embeds, batch, n_idx[start:start + 64], k_idx[start:start + 64],
                               sampling, reference=False)
            out.append(step.log_prob.cpu().double())
    return torch.cat(out)


def main(folder: Path, iteration: int) -> None:
    found = importlib.util.find_spec("tpgrpo")  # which tpgrpo would import here (nothing is imported)
    if found is None or Path(found.origin).parent.parent != folder:  # not the run's own code: run again with it
        repo = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(repo)])}
        sys.exit(subprocess.run([sys.executable, "-m", "bench.studies.update_direction", str(folder), str(iteration)],
                                cwd=folder, env=env).returncode)
    os.chdir(folder)
    import pandas as pd
    import torch

    from tpgrpo.config import load_config
    from tpgrpo.io.artifacts import IterationPaths
    from tpgrpo.io.trajectories import read_trajectories
    from tpgrpo.rollout_shape.stored_states import store_states
    from tpgrpo.rollout_shape import of_store_attrs
    from tpgrpo.policy.update import TransitionBatch

    spec = importlib.util.spec_from_file_location("update_stage", folder / "stages" / "update.py")
    update_stage = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(update_stage)
    cfg, root, paths = load_config("params.yaml"), Path("."), IterationPaths(Path("."), iteration)
    arrays, attrs = read_trajectories(paths.trajectories, lazy=("x0_estimates", "velocities", "states", "node_states"))
    states = store_states(arrays, len(attrs["prompts"]), of_store_attrs(attrs, str(paths.trajectories)))
    n, k1 = states.shape[:2]
    adv = update_stage.advantage_matrix(pd.read_parquet(paths.credit), n, k1 - 1)
    batch = TransitionBatch(latents=states, old_log_probs=torch.from_numpy(arrays["log_probs"]),
                            sigmas=torch.from_numpy(arrays["sigmas"]),
                            prompt_index=torch.from_numpy(arrays["prompt_index"]).long(),
                            sigma_at_one=float(attrs["schedule_sigmas"][1]))
    n_idx, k_idx = (adv != 0).nonzero(as_tuple=True)
    before = rescore(cfg, root, iteration, iteration, batch, attrs, n_idx, k_idx)
    after = rescore(cfg, root, iteration + 1, iteration, batch, attrs, n_idx, k_idx)
    a, change = adv[n_idx, k_idx].double(), after - before
    stored_gap = float((before - batch.old_log_probs[n_idx, k_idx].double()).abs().max())
    corr = float(np.corrcoef(change.numpy(), a.numpy())[0, 1])
    print(f"{folder} iteration {iteration}: {a.numel()} transitions with A != 0; max |before - stored| "
          f"{stored_gap:.1e}; corr(change, A) {corr:+.3f}; mean change A > 0 {float(change[a > 0].mean()):+.2e}, "
          f"A < 0 {float(change[a < 0].mean()):+.2e}; sum A x change {float((a * change).sum()):+.3e}")


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3):
        sys.exit("usage: python -m bench.studies.update_direction RUN_FOLDER [ITERATION]")
    main(Path(sys.argv[1]).resolve(), int(sys.argv[2]) if len(sys.argv) == 3 else 1)
