# The two commands of the README: `make demo` (the main job) and `make test`.
# Each does the whole set-up first, once, in a virtual environment of its own (.venv, or VENV=...):
# torch's CPU build, then zerokit with the extras its tests and plots use. .ci/run removes .venv before
# `make test`, so that a dependency declared nowhere fails CI instead of a user's fresh machine.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.setup-done

.PHONY: setup demo test test-serial test-fast bench gpu-check
setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $(STAMP)

demo: setup
	$(PY) -m zerokit demo --stage 2 --nproc 2

# Two xdist workers, one per core (See [Note: the suite on two workers] in tests/conftest.py): about 14 minutes from a
# fresh clone, set-up included (docs/testing.md, "The suite's time"). `make test-serial` is the one-worker form.
test: setup
	$(PY) -m pytest -q -n 2

test-serial: setup
	$(PY) -m pytest -q

# One case of each capability, for the loop of development (under 3 minutes here); CI runs everything.
test-fast: setup
	$(PY) -m pytest -q -n 2 -m fast

bench: setup
	$(PY) -m pip install -q -e ".[bench]"
	$(PY) benchmarks/bench_stages.py

# On a machine with one GPU (issue 34): the GPU check, one results file under benchmarks/results/ (see its docstring).
gpu-check: setup
	$(PY) benchmarks/gpu_check.py
