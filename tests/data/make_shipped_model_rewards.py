"""Record the drift-check values of tests/test_shipped_model.py (run from the repo root after retraining data/base)."""
import json
from pathlib import Path
import numpy as np
from tpgrpo.models import load_backend
from tpgrpo.sample import sample_ode
from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.rewards import get_reward
sets = build_prompt_sets()
metas = sets["compositional_eval"][::27][:4]
prompts = [m["prompt"] for m in metas]; seeds = [0, 1, 2, 3]
images = sample_ode(load_backend("tiny", Path("data/base")), prompts, seeds, num_steps=10, guidance_scale=4.5)
out = {"prompts": prompts, "seeds": seeds, "num_steps": 10, "guidance_scale": 4.5,
       "geneval_soft": get_reward("geneval_soft")(images, metas).reward.tolist(),
       "pixel_sum": int(images.astype(np.int64).sum()),
       "note": "written by tests/data/make_shipped_model_rewards.py from the shipped data/base; re-run it only when the base model is retrained on purpose"}
Path("tests/data/shipped_model_rewards.json").write_text(json.dumps(out, indent=1) + "\n")
print(out)
