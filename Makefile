# Two commands a user needs: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
EXTRAS := bundled-mpi,dev,text,data,tensorboard,sweep,transformers

.PHONY: setup compile run test test-backends lint bench reproduce dist clean gpu-checks

setup: $(STAMP)

# torch is pinned to the CPU wheel: an unpinned `torch` pulls gigabytes of CUDA packages.
# On a GPU machine, where the Python that makes .venv (PYTHON: a system or conda Python; a venv
# does not show its own packages to another) already has a CUDA build of torch that sees a GPU,
# the CPU pin would replace it and every run would train on the CPU: there .venv is made with
# --system-site-packages and keeps that torch, and the pin is installed only if .venv does not
# see it after all. Anywhere else the commands are a CPU machine's (the pin above).
# The project is installed editable in compat mode (a path entry to the checkout): the console
# scripts `gridrun` and `gridrun-plan` land in .venv/bin and read the checkout's conf/.
CUDA_TORCH = $(shell $(PYTHON) -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null)

$(STAMP): pyproject.toml Makefile
	$(eval GPU_SETUP := $(filter 1,$(CUDA_TORCH)))
	$(PYTHON) -m venv $(if $(GPU_SETUP),--system-site-packages )$(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(if $(GPU_SETUP),$(PY) -c "import torch; assert torch.cuda.is_available()" 2>/dev/null || )$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e ".[$(EXTRAS)]"
	touch $(STAMP)

# The checkout's bytecode, written where the environment says not to (PYTHONDONTWRITEBYTECODE):
# every rank and head would compile gridrun's modules again (0.14 s of each process's start on
# 2 cores). Only what changed is compiled again.
compile: $(STAMP)
	$(PY) -m compileall -q runner strategies hydra_plugins tests > /dev/null

run: compile
	$(PY) -m runner $(ARGS)

# The suite's files run on TEST_WORKERS workers at once (pytest-xdist, a file to a worker):
# most of its time is ranks that wait on each other or on a deadline, and one file's waits are
# another's CPU (2 workers on 2 cores: 12:12 -> 9:59). TEST_WORKERS=0 runs them one by one.
# Tests marked `alone` (a real Slurm's requeue and its signals) run after, with nothing beside
# them (exit 5: none selected by PYTEST_ARGS).
TEST_WORKERS ?= 2

test: compile
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder -m "not alone" $(PYTEST_ARGS)
	$(PY) -m pytest -q -m alone $(PYTEST_ARGS) || [ $$? -eq 5 ]

# Every strategy's equivalence checks under both communication backends (make test runs
# check_model_grid, with check_domain and check_layouts, under mpi only, for its time).
test-backends: compile
	GRIDRUN_TEST_ALL_BACKENDS=1 $(PY) -m pytest -q tests/test_mpi_checks.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) bench/data_parallel.py

# Every GPU check and benchmark, on a machine with a GPU: the GPU tests (tests/test_gpu.py, the
# device calibration among them), then bench/gpu.py (gridrun against a plain PyTorch loop,
# ResNet-18 and a GPT-2-sized model, fp32 and bf16; one rank per GPU with 2 or more), its JSON
# written to $(GPU_OUT). ARGS pass options to bench/gpu.py.
GPU_OUT ?= gpu-checks.json
gpu-checks: $(STAMP)
	$(PY) -m pytest -q -rs tests/test_gpu.py
	$(PY) bench/gpu.py --out $(GPU_OUT) $(ARGS)

# The seed papers' headline comparisons at this machine's scale (7-10 minutes on 2 cores), as
# markdown and PNGs in docs/reproductions/; ARGS="--only sc17 --quick" and the like pass options.
reproduce: $(STAMP)
	$(PY) -m runner.reproduce $(ARGS)

# The wheel a user installs as a tool (conf/ inside it as runner/conf/): dist/gridrun-*.whl
dist: $(STAMP)
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build dist
