# Two commands set up a fresh machine: `make demo` runs the pipeline end to end on the
# embedded tiny default (CPU), `make test` runs the test suite. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# Parallel test workers (pytest-xdist): the suite waits on servers and subprocesses much of the time, so 4 on
# 2 cores finish sooner than 2; `make test TEST_WORKERS=0` runs it in one process.
TEST_WORKERS ?= 4
export PREFECT_HOME ?= $(CURDIR)/.prefect-home
export PREFECT_SERVER_ANALYTICS_ENABLED ?= false
export DO_NOT_TRACK ?= true
export MLFLOW_DISABLE_TELEMETRY ?= true

.PHONY: install demo ui test test-fast clean

install: $(STAMP)

# torch is pinned to the local CPU build (requirements-ci.txt) so a CPU machine never pulls
# a multi-GB CUDA wheel; GPU hosts install eagleops[serve] with their own torch.
# uv installs the same pins from where this machine's pip would take them (infra/uv_pip_args.py): a fresh
# clone's install is ~30 s instead of pip's ~81 s, a third of the demo's first five minutes (issue 38).
# --compile-bytecode as pip does: without .pyc files (and with PYTHONDONTWRITEBYTECODE set) every process
# would compile prefect, mlflow, torch... again, 9.7 s to import them instead of 4.5.
$(STAMP): pyproject.toml requirements-ci.txt infra/uv_pip_args.py
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q uv==0.13.9
	$(BIN)/uv pip install -q --compile-bytecode --python $(BIN)/python $$($(BIN)/python infra/uv_pip_args.py) \
		-r requirements-ci.txt -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/eagleops run configs/tiny.yaml

# The demo's runs in the MLflow UI and its flow runs in the Prefect UI (the demo's PREFECT_HOME); Ctrl-C stops both.
ui: install
	$(BIN)/eagleops ui runs

# The SSH tests run against a private OpenSSH sshd on 127.0.0.1 (tests/sshd.py); the browser
# tests (tests/browser) drive Debian's headless chromium through chromedriver. Everything but a GPU
# is installed here, so only GPU-only tests may skip (EAGLEOPS_ONLY_GPU_SKIPS: any other skip fails).
test: install
	bash infra/install-test-tools.sh
	EAGLEOPS_ONLY_GPU_SKIPS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf runs .prefect-home .pytest_cache
