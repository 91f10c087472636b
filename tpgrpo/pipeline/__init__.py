"""Orchestration: what runs and records stages, never what they compute. Four wings, and the faces on top:

- ``rendering/``: what dvc.yaml and the code manifests are made from (the rendered stages, each stage kind's code
  from the import graph, its hash, the library versions, the checks of a project's files);
- ``execution/``: how stages start and run (the stage runner, the stage server, its children and client, the
  launchers of multi-process stages, the watch on a long-lived process's code);
- ``dvc_integration/``: DVC's own files and tpgrpo's patches of DVC (atomic writes, a stage's lock block, the
  locks, the params a stage read against what DVC records);
- ``long_runs/``: sealed blocks of iterations, their seal cache and retention.

The faces: ``repro`` (``tpgrpo run``'s repro), ``status`` (``tpgrpo status`` and the stage records),
``long_run`` (what a run calls of the long-run machinery; a short run imports none of ``long_runs/``), and
``migrate`` (``tpgrpo migrate``, once, for a project an older version made).

Stage code (``stages/``, and what it imports) never imports this package, so no stage's code manifest lists
a file of it and an edit here re-runs no stage (``tests/test_code_manifest.py`` checks every closure). Code
the stages need at run time lives outside it (the multi-process chunking is :mod:`tpgrpo.distributed`).
"""
