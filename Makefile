# Two commands on a fresh machine:  `make run` (the main job) and `make test` (the tests).
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

test: $(STAMP)
	$(VENV)/bin/python -m pytest

.PHONY: install run test
