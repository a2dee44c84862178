# The two commands of the README: `make demo` (the main job) and `make test`.
# Each does the whole set-up first, once: torch's CPU build, then zerokit itself.
PY ?= python3
STAMP := .setup-done

.PHONY: setup demo test bench
setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e ".[test,plot]"
	touch $(STAMP)

demo: setup
	$(PY) -m zerokit demo --stage 2 --nproc 2

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) benchmarks/bench_stages.py
