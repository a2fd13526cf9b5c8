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

.PHONY: install demo test test-fast clean

install: $(STAMP)

# torch is pinned to the local CPU build (requirements-ci.txt) so a CPU machine never pulls
# a multi-GB CUDA wheel; GPU hosts install eagleops[serve] with their own torch.
$(STAMP): pyproject.toml requirements-ci.txt
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -r requirements-ci.txt -e '.[dev]'
	touch $(STAMP)

demo: install
	$(BIN)/eagleops run configs/tiny.yaml

# The SSH tests run against a private OpenSSH sshd on 127.0.0.1 (tests/sshd.py); the browser
# tests (tests/browser) drive Debian's headless chromium through chromedriver. Everything but a GPU
# is installed here, so only GPU-only tests may skip (EAGLEOPS_ONLY_GPU_SKIPS: any other skip fails).
test: install
	command -v sshd || test -x /usr/sbin/sshd || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq openssh-server openssl)
	test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver)
	EAGLEOPS_ONLY_GPU_SKIPS=1 $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder --durations=25

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf runs .prefect-home .pytest_cache
