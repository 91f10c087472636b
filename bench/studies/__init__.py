"""Studies behind the docs' and journal's numbers: ``python -m bench.studies.NAME`` from the repository root."""
