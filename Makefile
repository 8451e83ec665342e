# Two commands a user needs: `make run` and `make test`. Both set up .venv first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
EXTRAS := bundled-mpi,dev,text,tensorboard,sweep,transformers

.PHONY: setup run test test-backends lint bench reproduce dist clean

setup: $(STAMP)

# torch is pinned to the CPU wheel: an unpinned `torch` pulls gigabytes of CUDA packages.
# The project is installed editable in compat mode (a path entry to the checkout): the console
# scripts `gridrun` and `gridrun-plan` land in .venv/bin and read the checkout's conf/.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet --config-settings editable_mode=compat -e ".[$(EXTRAS)]"
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m runner $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Every strategy's equivalence checks under both communication backends (make test runs
# check_model_grid and check_domain under mpi only, for its time).
test-backends: $(STAMP)
	GRIDRUN_TEST_ALL_BACKENDS=1 $(PY) -m pytest -q tests/test_mpi_checks.py

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m mypy

bench: $(STAMP)
	$(PY) bench/data_parallel.py

# The seed papers' headline comparisons at this machine's scale (7-10 minutes on 2 cores), as
# markdown and PNGs in docs/reproductions/; ARGS="--only sc17 --quick" and the like pass options.
reproduce: $(STAMP)
	$(PY) -m runner.reproduce $(ARGS)

# The wheel a user installs as a tool (conf/ inside it as runner/conf/): dist/gridrun-*.whl
dist: $(STAMP)
	$(PY) -m pip wheel --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info build dist
