# Two commands do everything on a fresh machine: `make demo` and `make test` (`make test-fast`: no child processes).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: setup demo test test-fast lint bench clean

setup: $(STAMP)

# one line per step with the elapsed time (scripts/setup.sh says what needs root)
$(STAMP): pyproject.toml scripts/setup.sh scripts/install-system-deps.sh lightning_dist/install_horovod.py
	VENV=$(VENV) TORCH_SPEC="$(TORCH_SPEC)" scripts/setup.sh
	touch $(STAMP)

demo: setup
	PATH="$(abspath $(VENV))/bin:$$PATH" $(PY) -m lightning_dist.cli demo

TEST_ENV := PATH="$(abspath $(VENV))/bin:$$PATH" OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

# everything (what CI runs): trainings in child processes, mpirun/horovodrun, torchrun, SLURM, notebooks
test: setup
	$(TEST_ENV) $(PY) -m pytest -q --durations=30

# pure and threaded tests only (no child processes; tests/conftest.py fails one that starts any)
test-fast: setup
	$(TEST_ENV) $(PY) -m pytest -q -m "not slow"

lint: setup
	$(VENV)/bin/ruff check lightning_dist tests examples benchmarks
	$(VENV)/bin/ruff format --check lightning_dist tests examples benchmarks
	$(VENV)/bin/mypy

bench: setup
	$(PY) benchmarks/bench_ddp_overhead.py

clean:
	rm -rf $(VENV) .pytest_cache lightning_logs
