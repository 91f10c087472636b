"""Orchestration: what runs and records stages, never what they compute. dvc.yaml rendering, sealed blocks,
code manifests, dvc.lock reads, run status, the stage runner, the stage server and its client, the launcher.

Stage code (``stages/``, and what it imports) never imports this package, so no stage's code manifest lists
a file of it and an edit here re-runs no stage (``tests/test_code_manifest.py`` checks every closure). Code
the stages need at run time lives outside it (the multi-process chunking is :mod:`tpgrpo.distributed`).
"""
