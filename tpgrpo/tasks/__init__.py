"""The two tasks the embedded tiny model is trained and rewarded on: compositional scenes and short text.

- `prompts`: prompt vocabularies, train/eval prompt sets, JSONL files.
- `render`: clean procedural images of a prompt (pretraining data) and images that violate it.
- `detect`: the palette-shape detector; `geneval`: its GenEval-style scoring.
- `rewards`: the reward registry: `get_reward(name)`, `build_reward(spec, cfg)` for a name or a weighted
  mapping (model and remote rewards live in `tpgrpo.rewards`).

Import from the modules: this package imports none of them (re-exports here made `tpgrpo.tasks` and
`tpgrpo.tasks.rewards` import each other).
"""
