# Two commands do all the set-up on a fresh machine with Python 3.11:
#   make run    the main job: every op x backend checked against the reference, the demo model trained
#               (sparseops demo --quick), then a quick benchmark
#               (results in ./sparseops-results/, ignored by git: the run leaves `git status` clean)
#   make test   the test suite (what CI runs)
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
TRITON_VERSION ?= 3.6.0
# the newest Triton the kernels are tested on (the top of the `triton` extra's range in pyproject.toml): the
# interpreter tests run under it too, from a second venv with torch, Triton and pytest only (the project on
# PYTHONPATH)
TRITON_LATEST ?= 3.9.0
VENV_LATEST := .venv-triton-latest
# the Triton kernels on the CPU: the interpreter, exact fp32 dots; in their own pytest processes
INTERPRET := TRITON_INTERPRET=1 TRITON_F32_DEFAULT=ieee
TRITON_TESTS := tests/moe/test_triton_impl.py tests/nsa/test_triton_impl.py tests/nsa/test_triton_plan.py tests/nsa/test_triton_gather.py
# the Triton kernels compiled for real GPUs without one (minutes while Triton's cache is cold, one compile at a time),
# `sparseops fit` last: its shapes' kernels come from the cache the others filled
FIT_TESTS := tests/nsa/test_triton_fit.py tests/nsa/test_triton_gather_fit.py tests/test_triton.py tests/cli/test_fit.py

.PHONY: run test test-suite test-fit test-interpret test-interpret-latest lint check bench peers peers-cpu clean

# every pip call after the first torch install: no package may replace that torch (constraints.txt pins it)
PIP = $(BIN)/python -m pip install -q -c constraints.txt

$(BIN)/.installed: pyproject.toml constraints.txt benchmarks/peers-cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	# the CPU wheel first: an unpinned torch would pull a multi-GB CUDA build
	$(BIN)/python -m pip install -q torch==2.13.0
	# the Triton version the GPU machines run; on the CPU it powers the interpreter checks
	$(PIP) triton==$(TRITON_VERSION)
	$(PIP) -e '.[test,bench,transformers]'
	# the benchmarks' peers, without their dependencies (some would pull another torch)
	$(PIP) --no-deps -r benchmarks/peers-cpu.txt
	touch $@

$(VENV_LATEST)/.installed: pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV_LATEST)
	$(VENV_LATEST)/bin/python -m pip install -q --upgrade pip
	$(VENV_LATEST)/bin/python -m pip install -q torch==2.13.0
	$(VENV_LATEST)/bin/python -m pip install -q -c constraints.txt triton==$(TRITON_LATEST) numpy pytest
	touch $@

run: $(BIN)/.installed
	$(BIN)/sparseops info
	$(BIN)/sparseops check
	$(BIN)/sparseops demo --quick
	$(BIN)/sparseops bench --quick

# the two environments side by side, ruff, then four pytest processes two at a time, each one's output printed
# whole as it ends: the suite beside the single-threaded ones in turn (the offline compiles, then the interpreter
# under either Triton version), as the suite leaves a core idle for much of its run (it waits on spawned processes
# and small ops); any failure fails `test`
test:
	$(MAKE) -j2 --output-sync=target --no-print-directory $(BIN)/.installed $(VENV_LATEST)/.installed
	$(BIN)/ruff check src tests benchmarks
	$(MAKE) -j2 --output-sync=target --no-print-directory test-suite test-fit test-interpret test-interpret-latest

test-suite: $(BIN)/.installed
	$(BIN)/python -m pytest -q --durations=25 $(addprefix --ignore=,$(FIT_TESTS))

test-fit: $(BIN)/.installed
	$(BIN)/python -m pytest -q -p no:cacheprovider $(FIT_TESTS)

test-interpret: $(BIN)/.installed
	$(INTERPRET) $(BIN)/python -m pytest -q -p no:cacheprovider $(TRITON_TESTS)

# under the newest Triton all but the heavy_interpret cases (tests/nsa/triton_cases.py: a lighter case takes each
# one's code path)
test-interpret-latest: $(VENV_LATEST)/.installed
	$(INTERPRET) PYTHONPATH=src $(VENV_LATEST)/bin/python -m pytest -q -p no:cacheprovider -m "not heavy_interpret" $(TRITON_TESTS)

check: $(BIN)/.installed
	$(BIN)/sparseops check

# the linter alone (`make test` runs it first)
lint: $(BIN)/.installed
	$(BIN)/ruff check src tests benchmarks

# the full sweep, to ./sparseops-results/; `sparseops bench --record` appends to benchmarks/results/ on purpose
bench: $(BIN)/.installed
	$(BIN)/sparseops bench

# the CPU peers again into an existing .venv (the install step above runs the same command)
peers-cpu: $(BIN)/.installed
	$(PIP) --no-deps -r benchmarks/peers-cpu.txt

# the peer and pytest as plain files for the GPU machine, which cannot reach a package index
# (benchmarks/gpu_nsa_check.sh puts .peers on PYTHONPATH; the device run carries it)
peers: $(BIN)/.installed
	$(BIN)/python -m pip install -q --no-deps --target .peers fla-core==0.6.0 einops==0.8.2 pytest==9.2.0 pytest-xdist==3.8.0 execnet==2.1.2 pluggy iniconfig packaging

clean:
	rm -rf $(VENV) $(VENV_LATEST) build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
