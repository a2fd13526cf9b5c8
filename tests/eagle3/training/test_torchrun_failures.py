"""Naming the rank that failed first (eagle3.training.torchrun.describe_rank_failures).

The failure report is the one torch's elastic agent prints (its own `ChildFailedError.format_msg`),
over per-rank log folders laid out as torchrun lays them out; the fault-injection run over SSH is
tests/flows/test_train_nodes.py's killed-rank test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from eagle3.training.torchrun import describe_rank_failures, first_failure

REPO = Path(__file__).resolve().parents[3]
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


# A rank that raises while torchrun stops the group: its error file's write stalls (json.dump
# writes the start of the JSON, then waits) and the test SIGTERMs it there, as torchrun does.
_STOPPED_WHILE_WRITING = """
import json, sys, time
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler, record
from eagle3.training.error_file import WholeErrorFile

def stalled_dump(obj, fp, **kwargs):
    fp.write('{"message": ')
    fp.flush()
    print("writing", flush=True)
    time.sleep(120)

json.dump = stalled_dump
handler = WholeErrorFile() if sys.argv[1] == "whole" else ErrorHandler()

def rank_main():
    raise RuntimeError("Connection reset by peer")

record(rank_main, error_handler=handler)()
"""


def _stop_a_rank_while_it_writes_its_error_file(tmp_path: Path, handler: str) -> Path:
    error_file = tmp_path / handler / "error.json"
    error_file.parent.mkdir()
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file), "PYTHONPATH": str(REPO)}
    rank = subprocess.Popen([sys.executable, "-c", _STOPPED_WHILE_WRITING, handler], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        assert rank.stdout.readline().strip() == "writing"
        rank.send_signal(signal.SIGTERM)
        assert rank.wait(timeout=60) == -signal.SIGTERM
    finally:
        rank.kill()
        rank.stdout.close()
    return error_file


def test_a_rank_stopped_while_writing_its_error_file_leaves_none_for_torchrun_to_choke_on(tmp_path):
    """torch's own handler leaves half a file there, and torchrun dies parsing it (no failure report)."""
    half_written = _stop_a_rank_while_it_writes_its_error_file(tmp_path, "torch")
    with pytest.raises(json.JSONDecodeError):  # what torchrun's ProcessFailure does with it
        ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM, error_file=str(half_written))

    error_file = _stop_a_rank_while_it_writes_its_error_file(tmp_path, "whole")
    assert not error_file.exists()
    failure = ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM, error_file=str(error_file))
    assert failure.exitcode == -signal.SIGTERM and "Signal 15" in failure.message


def test_a_rank_that_raises_leaves_a_whole_error_file_under_the_name_torchrun_reads(tmp_path):
    error_file = tmp_path / "error.json"
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file), "PYTHONPATH": str(REPO)}
    script = _STOPPED_WHILE_WRITING.replace("json.dump = stalled_dump", "")
    rank = subprocess.run([sys.executable, "-c", script, "whole"], env=env, capture_output=True, text=True, timeout=120)

    assert rank.returncode == 1 and "RuntimeError: Connection reset by peer" in rank.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["error.json"]
    failure = ProcessFailure(local_rank=0, pid=100, exitcode=1, error_file=str(error_file))
    assert failure.message["message"] == "RuntimeError: Connection reset by peer" and failure.timestamp > 0
