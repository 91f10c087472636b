# Two commands on a fresh machine:  `make run` (the main job) and `make test` (the fast tests, minutes).
# `make test-all` is every test, the slow end-to-end runs included (CI, .ci/run, runs it).
PY ?= python3
VENV := .venv
STAMP := $(VENV)/.installed

# Where torch comes from (docs/install.md). Empty: pip's configured indexes (here a CPU wheel on disk; on an
# ordinary Linux machine PyPI's torch 2.13.0 is the CUDA build, several GB with its libraries). For the CPU
# build elsewhere: `make TORCH_INDEX=https://download.pytorch.org/whl/cpu`.
TORCH_INDEX ?=

$(STAMP): pyproject.toml constraints.txt
	$(PY) -m venv $(VENV)
	# torch first, from TORCH_INDEX when given; then everything else at the versions constraints.txt pins
	$(VENV)/bin/pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX),--index-url $(TORCH_INDEX))
	$(VENV)/bin/pip install --quiet -c constraints.txt -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# Re-resolve every dependency in a fresh venv and pin what it got (after a change of pyproject.toml's
# dependencies; commit the result). tests/test_constraints.py checks the installed venv against it.
constraints:
	PY=$(PY) TORCH_INDEX=$(TORCH_INDEX) tools/freeze-constraints

run: $(STAMP)
	$(VENV)/bin/tpgrpo run

# Two pytest workers (pytest-xdist), one per core, one torch thread each (tests/conftest.py); a test file
# stays on one worker so its module fixtures are built once.
PYTEST := $(VENV)/bin/python -m pytest -n 2 --dist loadfile

test: $(STAMP)
	$(PYTEST) -m "not slow"

test-all: $(STAMP)
	$(PYTEST)

.PHONY: install constraints run test test-all
