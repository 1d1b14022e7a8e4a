# `make demo` and `make test` set up .venv on a fresh machine; `make test-gpu` runs on a machine that
# already has CUDA torch and triton (the device machine), using its python3 with the checkout on PYTHONPATH.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
# torch 2.13.0 first: where a local CPU wheel exists (CI) pip takes it instead of a multi-GB CUDA build.
TORCH_PIN ?= torch==2.13.0
TRITON_PIN ?= triton==3.6.0

.PHONY: demo test test-gpu lint bench-decode bench-prefill

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install -q $(TORCH_PIN)
	$(VPY) -m pip install -q $(TRITON_PIN) -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VPY) -m pagedmla.selfcheck
	$(VENV)/bin/pagedmla generate --model tiny --prompt-ids "1 2 3 4 5 6 7 8" --max-new-tokens 16

test: $(STAMP)
	$(VPY) -m ruff check pagedmla tests benchmarks
	$(VPY) -m pytest -q -n 2 --durations=10

# Tests run in GPU_WORKERS processes where pytest-xdist is installed, handed out one by one (`--dist load`:
# the conformance file alone holds two thirds of the GPU cases, so whole files per worker left one worker
# running long after the others); the kernels' compiles dominate a fresh machine and the Triton cache on disk
# is shared between workers. In one process otherwise. GPU_TESTS names the files or node ids to run (default
# all): a run that a time limit cut short resumes with the files it did not reach. A PYTHONPATH the caller
# set (the baselines' wheels, for the FlashMLA interchange tests) stays behind the checkout.
GPU_WORKERS ?= 8
GPU_TESTS ?= tests
test-gpu:
	PYTHONPATH=$(CURDIR)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON) -m pytest -q -m gpu -p no:cacheprovider --durations=20 \
		$$($(PYTHON) -c 'import xdist' 2>/dev/null && echo '-n $(GPU_WORKERS) --dist load') $(GPU_TESTS)

# `pagedmla bench decode|prefill` (the grids against the baselines installed, a table and bench-KIND.png): with
# the .venv's python where it exists (CPU: tiny shapes under the Triton interpreter), else $(PYTHON) with the
# checkout on PYTHONPATH (the device machine). BENCH_ARGS passes options, e.g. BENCH_ARGS=--quick.
BENCH_PY = $(if $(wildcard $(VPY)),$(VPY),$(PYTHON))
BENCH_ARGS ?=
bench-decode bench-prefill:
	PYTHONPATH=$(CURDIR) $(BENCH_PY) -m pagedmla bench $(@:bench-%=%) $(BENCH_ARGS)

lint: $(STAMP)
	$(VPY) -m ruff check pagedmla tests benchmarks
