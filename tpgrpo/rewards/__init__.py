"""Rewards that need more than the task code: model rewards loaded from local folders, and a remote one.

- `folders`: resolving and checking the local folders params name (one-line errors).
- `pickscore`: PickScore (a CLIP checkpoint): ``100 * cos(text, image) / divisor``.
- `detector`: the GenEval rules (`tpgrpo.tasks.geneval`) over a transformers object detector.
- `aesthetic`: the LAION aesthetic MLP over CLIP image embeddings.
- `remote`: a client reward that posts batches to a reward server; `server`: that server.
The registry (names, weighted sums, `build_reward`) stays in `tpgrpo.tasks.rewards`.
"""
