"""A pytest plugin for bench_suite_cpu.py: each worker writes when each of its tests starts and ends.

Loaded with `-p tests.benchmarks.suite_cpu_plugin` (bench_suite_cpu.py sets PYTEST_ADDOPTS); writes one
`tests.<worker>.<pid>.log` per process into $EAGLEOPS_SUITE_CPU_DIR, lines `S|F <unix time> <pid> <nodeid>`.
Setup and teardown fall inside a test's span (logstart .. logfinish), so a module fixture counts for the test
that built it.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

_log = None


def _out():
    global _log
    if _log is None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        folder = Path(os.environ["EAGLEOPS_SUITE_CPU_DIR"])
        _log = (folder / f"tests.{worker}.{os.getpid()}.log").open("a", buffering=1)
    return _log


def pytest_runtest_logstart(nodeid, location):
    _out().write(f"S {time.time():.2f} {os.getpid()} {nodeid}\n")


def pytest_runtest_logfinish(nodeid, location):
    _out().write(f"F {time.time():.2f} {os.getpid()} {nodeid}\n")
