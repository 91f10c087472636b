"""The two tasks the embedded tiny model is trained and rewarded on: compositional scenes and short text.

- `prompts`: prompt vocabularies, train/eval prompt sets, JSONL files.
- `render`: clean procedural images of a prompt (pretraining data) and images that violate it.
- `detect`: the palette-shape detector; `geneval`: its GenEval-style scoring.
- `rewards`: the reward registry: `get_reward(name)`, `build_reward(spec, cfg)` for a name or a weighted
  mapping (model and remote rewards live in `tpgrpo.rewards`).
"""

from tpgrpo.tasks.prompts import (
    TEXT_CHARSET,
    VOCABULARY,
    build_prompt_sets,
    load_prompts,
    write_prompt_files,
)
from tpgrpo.tasks.render import render_prompt, render_violation
from tpgrpo.tasks.rewards import REWARD_NAMES, Reward, RewardResult, build_reward, get_reward

__all__ = [
    "REWARD_NAMES",
    "TEXT_CHARSET",
    "VOCABULARY",
    "Reward",
    "RewardResult",
    "build_prompt_sets",
    "build_reward",
    "get_reward",
    "load_prompts",
    "render_prompt",
    "render_violation",
    "write_prompt_files",
]
