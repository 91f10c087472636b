"""Benchmarks and studies of tpgrpo: run each from the repository root as ``python -m bench.NAME``
(``python -m bench.studies.NAME`` for the studies); shared pieces are in :mod:`bench.common`."""
