"""Session-wide test environment: telemetry off, Prefect home and MLflow stores in tmp dirs.

The Prefect test harness (a real Prefect API server on a free port, ~20 s to start on two
cores), a real MLflow server (`mlflow_server`, tests/mlflow_server.py) and a private OpenSSH
server (`sshd`, tests/sshd.py) are session-scoped and started only by tests that ask for them.
"""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import tempfile
from pathlib import Path

import pytest

_SESSION_HOME = Path(tempfile.mkdtemp(prefix="eagleops-tests-"))
os.environ.update(
    {
        "PREFECT_HOME": str(_SESSION_HOME / "prefect"),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "true",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        # Task cache records and results must not leak between sessions (they live in PREFECT_HOME).
        "PREFECT_TASKS_REFRESH_CACHE": "true",
        # A stage that reads a config field its StageSpec does not declare fails (tasks/runner/specs.py): every
        # flow test then checks the fingerprints of the stages and branches it runs.
        "EAGLEOPS_STRICT_STAGE_READS": "1",
    }
)
os.environ.pop("PREFECT_API_URL", None)
# pytest-xdist's workers start with COLUMNS=80 and LINES=24 (execnet sets them). rich reads them once, when the
# CLI's consoles are made at import, which would pin every CLI test to 80 columns whatever its CliRunner env says.
os.environ.pop("COLUMNS", None)
os.environ.pop("LINES", None)
os.environ.pop("MLFLOW_TRACKING_URI", None)

REPO = Path(__file__).resolve().parents[1]

# Collecting imports torch, transformers, Prefect and MLflow: a million long-lived objects that every full
# collection would walk again, here and for the rest of the session. No collection while they load, and
# once loaded they are frozen (gc.freeze: kept out of every later collection).
gc.disable()


def pytest_collection_finish(session):
    gc.freeze()
    gc.enable()
    if any("sglang_python" in getattr(item, "fixturenames", ()) for item in session.items):
        _start_sglang_install()


# The CPU SGLang venv (infra/install-sglang-cpu.sh) takes minutes to install on a new machine, mostly
# downloads. Its install starts in the background once the session knows a test needs it, so it overlaps
# the tests before that one; the `sglang_python` fixture then runs the installer itself, which waits for
# the background one (the script holds a lock per venv) and returns at once when it finished.
SGLANG_VENV = Path(os.environ.get("EAGLEOPS_SGLANG_VENV") or Path.home() / ".cache" / "eagleops" / "sglang-cpu-venv")
SGLANG_INSTALLER = REPO / "infra" / "install-sglang-cpu.sh"
_background_install: subprocess.Popen | None = None


def _start_sglang_install() -> None:
    global _background_install
    if not (SGLANG_VENV / ".eagleops-sglang-cpu-installed").is_file():
        _background_install = subprocess.Popen(["bash", str(SGLANG_INSTALLER), str(SGLANG_VENV)],
                                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                               start_new_session=True)


def pytest_sessionfinish(session):
    """A background install still running when the session ends (a subset of tests, Ctrl-C) is stopped."""
    if _background_install is not None and _background_install.poll() is None:
        os.killpg(_background_install.pid, signal.SIGTERM)
        _background_install.wait(timeout=30)


# `make test` runs the suite in parallel workers (pytest-xdist, `--dist loadscope`, scheduled by
# `pytest_xdist_make_scheduler` below). A module's tests stay on one worker, so its module-scoped fixtures (a
# trained run, a nightly series, a recorded pipeline) are built once; the team setup's modules share a worker (the
# team servers are a session fixture: one set per worker). Modules whose tests are each long and whose fixtures
# are cheap are spread test by test instead. (xdist's `loadgroup` marks do nothing under pytest 9.2: xdist 3.8
# renames `item._nodeid`, which pytest 9.2's `nodeid` no longer reads.)
SPREAD_MODULES = {"tests/flows/test_train_nodes.py", "tests/flows/test_gpu_config_rehearsal.py",
                  "tests/flows/test_interrupts.py", "tests/flows/test_disk_full.py", "tests/flows/test_stream_flow.py",
                  "tests/eagle3/training/test_train.py", "tests/eagle3/training/test_streaming.py",
                  "tests/eagle3/data/test_generate.py", "tests/eagle3/serving/test_decoding.py",
                  "tests/eagle3/data/test_sglang_engine.py", "tests/eagle3/data/test_sglang_engine_tp.py"}
# The modules on the team setup (tests/team_servers.py: PostgreSQL, Prefect + MLflow servers, deploy-flows, a cpu
# worker; ~25 s to start) in two units, each on one worker: one start each, and neither unit much longer than the
# longest other work.
TEAM_UNITS = {
    "tests/infra/test_team_setup.py": "team-a", "tests/browser/test_ui.py": "team-a",
    "tests/infra/test_automations.py": "team-a", "tests/infra/test_secret_blocks.py": "team-a",
    "tests/flows/test_served_story.py": "team-b", "tests/infra/test_worker_killed.py": "team-b",
    "tests/infra/test_gpu_host_slots.py": "team-b", "tests/infra/test_sweep_flow.py": "team-b",
    "tests/infra/test_retry_mid_training.py": "team-b",
}
# Longest first, so no worker starts a long module when the others are nearly done (measured, --durations;
# `make test` keeps this order with --no-loadscope-reorder).
LONG_FIRST = ["tests/infra/test_team_setup.py", "tests/browser/test_ui.py", "tests/infra/test_automations.py",
              "tests/infra/test_secret_blocks.py", "tests/flows/test_served_story.py", "tests/infra/test_worker_killed.py",
              "tests/infra/test_gpu_host_slots.py", "tests/infra/test_sweep_flow.py",
              "tests/infra/test_retry_mid_training.py",
              "tests/flows/test_train_nodes.py", "tests/flows/test_gpu_config_rehearsal.py",
              "tests/flows/test_interrupts.py", "tests/flows/test_regen_over_ssh.py", "tests/flows/test_nightly.py",
              "tests/flows/test_served_nights_flow.py", "tests/flows/test_watch.py",
              "tests/tasks/tracking/test_registry_outage.py", "tests/flows/test_run_folder_lock.py",
              "tests/flows/test_gpu_hours_flow.py", "tests/flows/test_disk_full.py",
              "tests/flows/test_stream_flow.py", "tests/flows/test_deploy_bench.py",
              "tests/tasks/tracking/test_tracking_outage.py", "tests/eagle3/training/test_train.py",
              "tests/eagle3/training/test_streaming.py", "tests/eagle3/data/test_generate.py"]


def work_unit(nodeid: str) -> str:
    """The unit a worker takes whole: the test itself in a spread module, a team unit, else its module."""
    module = nodeid.split("::")[0]
    if module in SPREAD_MODULES:
        return nodeid
    return TEAM_UNITS.get(module, module)


# The team servers (two Prefect servers' worth of loop services, an MLflow server, a worker) are a session fixture
# that only the team units use. A worker's session goes on for many minutes after its unit; from the moment its
# next test is outside the units they are stopped (finishing the fixture clears its cache: a later team test on
# that worker would start them again), so they stop taking the 2 cores' CPU from the rest of the suite.
TEAM_FIXTURE = "team_servers"


@pytest.hookimpl(trylast=True)  # after pytest's own teardown: the unit's module fixtures are gone first
def pytest_runtest_teardown(item, nextitem):
    if nextitem is not None and work_unit(nextitem.nodeid) in TEAM_UNITS.values():
        return
    for fixturedef in item.session._fixturemanager.getfixturedefs(TEAM_FIXTURE, item) or ():
        if fixturedef.cached_result is not None:  # started on this worker and still running
            fixturedef.finish(item._request)


def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


def pytest_collection_modifyitems(config, items):
    rank = {module: index for index, module in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))  # stable: module order kept
    _skip_gpu_tests(items)


def _skip_gpu_tests(items: list) -> None:
    import torch

    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


# `make test` (CI's command) installs everything the suite needs but a GPU: sshd, chromium, the CPU
# SGLang venv; PostgreSQL runs on CI's machine. There (EAGLEOPS_ONLY_GPU_SKIPS=1) a skip for any
# other reason would leave CI green over a test that never ran, so it is reported as a failure.
GPU_SKIP_REASONS = ("needs a CUDA GPU",)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (os.environ.get("EAGLEOPS_ONLY_GPU_SKIPS") and report.skipped) or "gpu" in item.keywords:
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    if not any(gpu in reason for gpu in GPU_SKIP_REASONS):
        report.outcome = "failed"
        report.longrepr = f"skipped, but on this machine only GPU-only tests may skip (EAGLEOPS_ONLY_GPU_SKIPS): {reason}"


@pytest.fixture(autouse=True)
def events_to_the_current_api():
    """Prefect keeps one EventsWorker per process for a running server, its client bound to the PREFECT_API_URL of
    the moment it started: after a test that pointed the URL at a team server (temporary_settings), every later test
    in that worker would send its events there (CI: the registry-outage nightly's champion event never reached the
    harness). Drained after each test (flushing what it emitted), the next emit starts one for the URL of its time."""
    yield
    from prefect.events.worker import EventsWorker

    EventsWorker.drain_all(timeout=10)


@pytest.fixture(scope="session")
def prefect_harness():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def cli_prefect_api(prefect_harness) -> str:
    """The worker's Prefect server (the harness's) for `eagleops` CLI processes whose subject is not the temporary
    server a run without PREFECT_API_URL starts (~10 CPU-s each); the Ctrl-C and kill -9 tests of
    tests/flows/test_interrupts.py keep that temporary server."""
    from prefect.settings import PREFECT_API_URL

    return PREFECT_API_URL.value()


@pytest.fixture(scope="session")
def mlflow_server(tmp_path_factory):
    """A real `mlflow server` on 127.0.0.1 (sqlite in tmp), started once; tests may stop/start it."""
    from tests.mlflow_server import MlflowServer

    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"))
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sglang_python() -> Path:
    """Python of the CPU SGLang 0.5.23 venv (infra/install-sglang-cpu.sh), installed once per machine
    (the installer is idempotent) under ~/.cache/eagleops/sglang-cpu-venv or $EAGLEOPS_SGLANG_VENV."""
    venv = SGLANG_VENV
    proc = subprocess.run(["bash", str(SGLANG_INSTALLER), str(venv)], capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        pytest.skip(f"SGLang 0.5.23 CPU venv could not be installed at {venv} (needs PyPI; set "
                    f"EAGLEOPS_SGLANG_VENV to an installed one): {proc.stderr.strip()[-1500:]}")
    return venv / "bin" / "python"


@pytest.fixture(scope="session")
def repo_root() -> Path:
    return REPO


@pytest.fixture(scope="session")
def sshd():
    """A real sshd on 127.0.0.1 (tests/sshd.py), started once; tests skip if it cannot run."""
    from tests.sshd import SshdUnavailable, start_sshd

    try:
        server = start_sshd(_SESSION_HOME / "sshd")
    except SshdUnavailable as err:
        pytest.skip(f"no sshd for SSH tests: {err}")
    yield server
    server.stop()


# The team setup (Prefect + MLflow servers on PostgreSQL, deployments, a worker) is shared by
# tests/infra and tests/browser: defined here once so one session starts it once.
from tests.team_servers import cpu_worker, deployed, team_servers  # noqa: E402,F401  (fixtures)
