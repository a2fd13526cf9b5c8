"""Naming the rank that failed first (eagle3.training.torchrun.describe_rank_failures).

The failure report is the one torch's elastic agent prints (its own `ChildFailedError.format_msg`),
over per-rank log folders laid out as torchrun lays them out; the fault-injection run over SSH is
tests/flows/test_train_nodes.py's killed-rank test.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from eagle3.training.torchrun import describe_rank_failures, first_failure

PEER_LOST = "RuntimeError: [gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:7580: Connection reset by peer"


def _rank_dir(attempt: Path, rank: int, stderr: str) -> Path:
    folder = attempt / str(rank)
    folder.mkdir(parents=True)
    (folder / "stderr.log").write_text(stderr)
    return folder


def _raised(folder: Path, message: str, timestamp: int) -> Path:
    """The error file torchrun's @record writes for a rank that raised."""
    error_file = folder / "error.json"
    error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {
        "py_callstack": f"Traceback (most recent call last):\n  File \"train.py\", line 1\n{message}",
        "timestamp": str(timestamp)}}}))
    return error_file


def _report(failures: dict[int, ProcessFailure]) -> list[str]:
    return ChildFailedError("eagle3.training.train", failures).format_msg().splitlines()


@pytest.mark.parametrize("peer_exitcode", [1, -signal.SIGTERM], ids=["peer-exited", "peer-terminated-by-torchrun"])
@pytest.mark.parametrize("peer_dated", [-1, 1], ids=["torchrun-blames-the-peer", "torchrun-blames-the-killed"])
def test_the_killed_rank_is_named_first_whichever_rank_torchrun_blames(tmp_path, peer_exitcode, peer_dated):
    attempt = tmp_path / "logs" / "none_abc" / "attempt_0"
    rank0 = _rank_dir(attempt, 0, f"step 5\n{PEER_LOST}\n")
    rank1 = _rank_dir(attempt, 1, "step 5\n")
    # rank 0 raised within the second rank 1 was killed; torchrun dates rank 1 when it notices it,
    # so rank 0's whole-second time can be before it (torchrun then names rank 0) or after it
    error_file = _raised(rank0, PEER_LOST, int(time.time()) + peer_dated)
    failures = {0: ProcessFailure(local_rank=0, pid=100, exitcode=peer_exitcode, error_file=str(error_file)),
                1: ProcessFailure(local_rank=1, pid=101, exitcode=-signal.SIGKILL, error_file=str(rank1 / "none"))}
    report = _report(failures)
    root = report[report.index("Root Cause (first observed failure):") + 1:]
    assert any(f"rank      : {0 if peer_dated < 0 else 1}" in line for line in root)  # torch's own pick

    assert first_failure(report) == {"rank": "1", "how": "exit code -9 (Signal 9 (SIGKILL) received by PID 101)"}
    described = describe_rank_failures(tmp_path / "logs", report)
    assert described.startswith("rank 1 died first: exit code -9 (Signal 9 (SIGKILL)"), described
    assert f"rank 0 failed after it: {PEER_LOST}" in described
    assert f"--- last lines of {rank1 / 'stderr.log'} ---" in described


def test_a_rank_that_raised_on_its_own_is_the_root_cause(tmp_path):
    attempt = tmp_path / "logs" / "none_abc" / "attempt_0"
    rank0 = _rank_dir(attempt, 0, "")
    _rank_dir(attempt, 1, "")
    error_file = _raised(rank0, "ValueError: batch of 0 tokens", int(time.time()))
    report = _report({0: ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(error_file))})

    assert first_failure(report) == {"rank": "0", "how": "exit code 1"}
    assert describe_rank_failures(tmp_path / "logs", report).startswith(
        "rank 0 failed: ValueError: batch of 0 tokens"), report


def test_a_rank_torchrun_terminated_is_not_named_over_the_one_that_raised(tmp_path):
    """torchrun lists the ranks it SIGTERMs while stopping the group; a stuck one has no error file."""
    attempt = tmp_path / "logs" / "none_abc" / "attempt_0"
    rank0 = _rank_dir(attempt, 0, "")
    rank1 = _rank_dir(attempt, 1, "")
    error_file = _raised(rank1, "ValueError: batch of 0 tokens", int(time.time()))
    stuck = ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM, error_file=str(rank0 / "none"))
    report = _report({0: stuck, 1: ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file=str(error_file))})

    assert first_failure(report)["rank"] == "1", report
    assert describe_rank_failures(tmp_path / "logs", report).startswith(
        "rank 1 failed: ValueError: batch of 0 tokens"), report


def test_without_a_failure_report_every_rank_is_shown(tmp_path):
    attempt = tmp_path / "logs" / "none_abc" / "attempt_0"
    for rank in (0, 1):
        _rank_dir(attempt, rank, f"rank {rank} was here\n")

    assert first_failure(["some output", "rank: not a number"]) is None
    described = describe_rank_failures(tmp_path / "logs", [])
    assert described.count("failed: no error file (killed by a signal?)") == 2
    assert "rank 1 was here" in described
