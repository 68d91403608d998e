# Two jobs for a fresh machine: `make demo` and `make test` (see README.md).
# Both create .venv on first use and install pipetrain into it once.

VENV := .venv
PYTHON := $(VENV)/bin/python
INSTALLED := $(VENV)/.installed
# The demo GPT has 6 layers: one worker (and stage) per core, at least 2 and at most 6.
CORES := $(shell nproc 2>/dev/null || echo 2)
RANKS := $(shell n=$(CORES); [ $$n -lt 2 ] && n=2; [ $$n -gt 6 ] && n=6; echo $$n)
THREADS := $(shell n=$$(( $(CORES) / $(RANKS) )); [ $$n -lt 1 ] && n=1; echo $$n)

.PHONY: demo test test-slow timelines

# torch first and pinned (a CPU build here); an unpinned torch would pull the multi-GB CUDA
# build. A torch already in .venv is kept, so a chosen build can be installed beforehand.
$(INSTALLED): pyproject.toml
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -c 'import torch' 2>/dev/null || $(VENV)/bin/pip install torch==2.13.0
	$(VENV)/bin/pip install -e '.[test]'
	touch $@

demo: $(INSTALLED)
	$(VENV)/bin/pipetrain train --model gpt --ranks $(RANKS) --threads $(THREADS) \
		--schedule 1f1b --microbatches 4 --steps 200 --batch-size 128

# lint, format and type checks first: they take seconds, the suite minutes
test: $(INSTALLED)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy
	$(PYTHON) -m pytest -m "not slow"

# the heavier cases (restarts under torchrun, emulated clusters, 3-rank and Hugging Face
# model cases, CLI runs) that would take the default suite past 10 minutes; CI runs them too
test-slow: $(INSTALLED)
	$(PYTHON) -m pytest -m slow

timelines: $(INSTALLED)
	$(PYTHON) docs/make_timelines.py
