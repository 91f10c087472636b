# Two commands on a fresh machine:  `make run` (the main job) and `make test` (the fast tests, minutes).
# `make test-all` is every test, the slow end-to-end runs included (CI, .ci/run, runs it).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	# torch first, pinned to the CPU wheel: a bare requirement would pull a multi-GB CUDA build
	$(VENV)/bin/pip install --quiet torch==2.13.0
	$(VENV)/bin/pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/tpgrpo run

# Two pytest workers (pytest-xdist), one per core, one torch thread each (tests/conftest.py); a test file
# stays on one worker so its module fixtures are built once.
PYTEST := $(VENV)/bin/python -m pytest -n 2 --dist loadfile

test: $(STAMP)
	$(PYTEST) -m "not slow"

test-all: $(STAMP)
	$(PYTEST)

.PHONY: install run test test-all
