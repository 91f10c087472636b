"""Record the drift-check values of tests/test_shipped_model.py (run from the repo root after retraining data/base)."""
import json
from pathlib import Path
import numpy as np
from tpgrpo.models import load_backend
from tpgrpo.policy.generate import sample_ode
from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.rewards import get_reward
sets = build_prompt_sets()
backend = load_backend("tiny", Path("data/base"))
# The first four held-out prompts whose seed-0 image scores > 0.05: a reward of 0 would hide drift.
candidates = sets["compositional_eval"]
images = sample_ode(backend, [m["prompt"] for m in candidates], [0] * len(candidates), num_steps=10,
                    guidance_scale=4.5)
scores = get_reward("geneval_soft")(images, candidates).reward
chosen = [i for i in range(len(candidates)) if scores[i] > 0.05][:4]
metas = [candidates[i] for i in chosen]
prompts, seeds = [m["prompt"] for m in metas], [0] * len(metas)
images = images[chosen]
out = {"prompts": prompts, "seeds": seeds, "num_steps": 10, "guidance_scale": 4.5,
       "geneval_soft": get_reward("geneval_soft")(images, metas).reward.tolist(),
       "pixel_sum": int(images.astype(np.int64).sum()),
       "note": "written by tests/data/make_shipped_model_rewards.py from the shipped data/base; re-run it only when the base model is retrained on purpose"}
Path("tests/data/shipped_model_rewards.json").write_text(json.dumps(out, indent=1) + "\n")
print(out)
