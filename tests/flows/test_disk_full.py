"""A disk that fills while the data stage runs, on a real filesystem that really fills: a tmpfs mounted
for the test (192 MiB), filled by a second writer the moment the stage's own free-space check has
passed, as another job on the same disk would (a sitecustomize on the CLI process's PYTHONPATH wraps
the check to fill the disk right after it). The CLI runs as a user runs it, in a subprocess. The CLI must end in one line (what filled, where, how
much is free, the resume command) with exit 1, the attempt marked failed in the manifest -- or, when
not even the manifest fits, the previous manifest kept intact and said so -- no temp file left, and
`eagleops run --run-dir` must resume once the space is freed.

Why a tmpfs: ENOSPC needs a filesystem that is full. RLIMIT_FSIZE gives EFBIG and a fault-injected
write() is not the kernel's answer; a loop-mounted image needs mount too. Mounting needs root or
CAP_SYS_ADMIN: without it the tests skip and say why (`make test` already assumes root: it runs
apt-get without sudo).
"""

from __future__ import annotations

import errno
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from eagle3.data.files import atomic_write_text
from tasks.rundir import write_json_atomic
from tasks.runner.diskspace import describe_disk_full
from tests.helpers import TEST_TARGET_YAML, mounted_tmpfs

REPO = Path(__file__).resolve().parents[2]
DISK_SIZE = "192m"  # the stage's own check wants 100 MiB of headroom free when it starts
# Imported by the CLI process at start (its PYTHONPATH): the dump's real check, then the disk fills.
SITECUSTOMIZE = """\
import os
from pathlib import Path

import eagle3.data.dump as dump
from tests.flows.test_disk_full import fill

_check = dump.check_disk_space
_disk, _leave = os.environ["EAGLEOPS_TEST_FILL"].rsplit(":", 1)


def check_then_fill(directory, need, log):
    _check(directory, need, log)
    fill(Path(_disk), int(_leave))


dump.check_disk_space = check_then_fill
"""
CONFIG = """\
experiment: diskfull
runs_root: {runs}
{target}data:
  num_samples: 12
  max_length: 160
  validation_fraction: 0.25
  draft_vocab_size: 64
  regenerate: {{max_new_tokens: 16}}
"""


@pytest.fixture
def small_disk(tmp_path):
    """A 192 MiB tmpfs mounted at tmp_path/disk for the test, unmounted after (lazily: this process's MLflow
    keeps its SQLite store on the disk open)."""
    with mounted_tmpfs(tmp_path / "disk", DISK_SIZE) as mount:
        yield mount


def fill(disk: Path, leave: int = 0) -> Path:
    """Write zeros until the kernel answers ENOSPC, then give back `leave` bytes; returns the filler file."""
    filler = disk / "filler.bin"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    block = bytes(1 << 20)
    try:
        while True:
            try:
                os.write(fd, block)
            except OSError as err:
                assert err.errno == errno.ENOSPC
                break
        if leave:
            os.ftruncate(fd, os.fstat(fd).st_size - leave)
    finally:
        os.close(fd)
    return filler


def free_bytes(path: Path) -> int:
    stats = os.statvfs(path)
    return stats.f_bavail * stats.f_frsize


def eagleops(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess against the test session's Prefect server."""
    from prefect.settings import PREFECT_API_URL

    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value(), "COLUMNS": "500", **(env or {})}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], env=env, cwd=REPO, capture_output=True,
                          text=True, timeout=600, check=False)


def temp_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.name.endswith(".tmp")]


def test_a_write_on_a_full_disk_keeps_the_previous_file_and_leaves_no_temp(small_disk):
    manifest, shards = small_disk / "manifest.json", small_disk / "shards.json"
    write_json_atomic(manifest, {"status": "running"})
    atomic_write_text(shards, '{"complete": false}')
    fill(small_disk)
    for write, path in ((lambda: write_json_atomic(manifest, {"status": "failed"}), manifest),
                        (lambda: atomic_write_text(shards, '{"complete": true}'), shards)):
        with pytest.raises(OSError) as raised:
            write()
        assert raised.value.errno == errno.ENOSPC and raised.value.filename == str(path)
    assert json.loads(manifest.read_text()) == {"status": "running"}
    assert json.loads(shards.read_text()) == {"complete": False}
    assert temp_files(small_disk) == []
    assert describe_disk_full(raised.value, small_disk) == (
        f"the filesystem at {small_disk} (192.0 MiB) is full: writing {shards} failed (No space left on device); "
        "0 B free now")


@pytest.mark.slow
@pytest.mark.parametrize("leave", [64 << 10, 0], ids=["manifest-recorded", "manifest-does-not-fit"])
def test_disk_filling_during_data_generation_ends_in_one_line_and_resumes(prefect_harness, small_disk, tmp_path,
                                                                          leave):
    config = tmp_path / "diskfull.yaml"
    config.write_text(CONFIG.format(runs=small_disk / "runs", target=TEST_TARGET_YAML))
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    failed = eagleops("run", str(config), "--stages", "generate_data",
                      env={"PYTHONPATH": f"{hook}:{REPO}", "EAGLEOPS_TEST_FILL": f"{small_disk}:{leave}"})
    assert (small_disk / "filler.bin").is_file(), failed.stderr[-3000:]
    assert failed.returncode == 1, failed.stderr[-3000:]
    run_dir = next((small_disk / "runs" / "diskfull").iterdir())
    # The CLI ends with its one line (above it: Prefect's own log of the failed task), said once.
    line = failed.stderr.strip().splitlines()[-1]
    assert failed.stderr.count("disk full during") == 1, failed.stderr[-3000:]
    shard_dir = run_dir / "generate_data" / "attempt-1" / "dataset" / "hidden_states"
    assert line.startswith(f"disk full during generate_data: the filesystem at {small_disk} (192.0 MiB) is full: "
                           f"writing {shard_dir}/"), line
    assert "failed (No space left on device)" in line
    assert line.endswith(f"free space, then resume with: eagleops run {config} --run-dir {run_dir}"), line
    shown_free = re.search(r"; (\d+(?:\.\d)?) (B|KiB|MiB) free now", line)
    assert shown_free, line
    assert float(shown_free.group(1)) * {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20}[shown_free.group(2)] < 1 << 20
    assert free_bytes(small_disk) < 1 << 20  # the disk is really that full
    assert temp_files(small_disk) == []
    attempt = json.loads((run_dir / "manifest.json").read_text())["stages"]["generate_data"]["attempts"][-1]
    if leave:
        assert "manifest.json could not be updated" not in line
        assert attempt["status"] == "failed" and "No space left on device" in attempt["error"]
    else:
        assert "manifest.json could not be updated either and keeps its previous content" in line
        assert attempt["status"] == "running"  # as it was when the stage started

    (small_disk / "filler.bin").unlink()
    resumed = eagleops("run", str(config), "--run-dir", str(run_dir), "--stages", "generate_data")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    stage = json.loads((run_dir / "manifest.json").read_text())["stages"]["generate_data"]
    assert [a["status"] for a in stage["attempts"]] == ["completed"]  # the same attempt, resumed in place
    assert json.loads((shard_dir / "manifest.json").read_text())["complete"] is True
