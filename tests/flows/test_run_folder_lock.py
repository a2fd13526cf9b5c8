"""One run per run folder (tasks/run_lock.py), as a user meets it: two `eagleops run` on one --run-dir, and a
holder killed with kill -9.

Real CLI processes (tests/flows/test_interrupts.py's `start_cli`) on the tiny test target: the holder with its own
temporary Prefect server (killed with it), the runs after it on the worker's Prefect server (`cli_prefect_api`). The first run deploys the reference server on this machine and benchmarks it for minutes; a second
`eagleops run --run-dir` on its folder (the issue's `--stages deploy_server,run_benchmark`) exits 2 at once with one
line naming the first's pid, host, Prefect flow run and since when, and writes nothing. The first is then killed
with SIGKILL (its hooks and teardown cannot run; its model server lives on in its own session): the next run on
the folder says in one line that it takes the folder over, stops the dead run's server before it deploys its own
(one line per server), resumes (the dead attempt closed as interrupted) and keeps every attempt the first recorded.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import time
from pathlib import Path

import psutil
import pytest

from tests.flows.test_interrupts import (
    assert_no_new_server,
    prefect_servers,
    start_cli,
    wait_for_stage,
)
from tests.helpers import TEST_TARGET_YAML, free_port, reference_servers_alive

CONFIG = """\
experiment: run-lock
runs_root: {runs}
{target}data:
  num_samples: 24
  max_length: 128
  regenerate: {{max_new_tokens: 16}}
  draft_vocab_size: 64
train:
  ttt_steps: 2
  max_steps: 20
  batch_size: 4
  checkpoint_every: 10
  log_every: 10
export:
  formats: [sglang]
  dtype: float32
deploy: {{host: local, server: reference, port: {port}, speculative: {{num_steps: 2, eagle_topk: 1,
         num_draft_tokens: 3}}, startup_timeout_s: 240}}
bench: {{prompts: {prompts}, num_prompts: 1, max_new_tokens: 16, warmup_runs: {warmup}, timed_runs: {timed}}}
"""
FIRST_STAGES = "check_environment,generate_data,train_draft,export_checkpoint,deploy_server,run_benchmark"
SECOND_STAGES = "deploy_server,run_benchmark"


def write_config(tmp_path: Path, name: str, port: int, warmup: int, timed: int) -> Path:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "Say hello."}\n')
    path = tmp_path / f"{name}.yaml"
    path.write_text(CONFIG.format(runs=tmp_path / "runs", target=TEST_TARGET_YAML, port=port, prompts=prompts,
                                  warmup=warmup, timed=timed))
    return path


def attempts(manifest: dict) -> dict[str, list[tuple]]:
    """Each stage's attempts as (number, folder, fingerprint): what "kept" compares."""
    return {name: [(a["attempt"], a["dir"], a["fingerprint"]) for a in entry.get("attempts", [])]
            for name, entry in manifest["stages"].items()}


def kill_leftovers(procs: list, run_dir: Path | None) -> None:
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    for pid in reference_servers_alive(str(run_dir)) if run_dir else []:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # a server is its own group's leader (start_detached)


@pytest.mark.slow
def test_a_second_run_on_a_held_folder_refuses_at_once_and_a_killed_holder_is_taken_over(tmp_path, cli_prefect_api):
    port = free_port()
    long_bench = write_config(tmp_path, "long", port, warmup=100, timed=1000)
    before = prefect_servers()
    first = second = third = run_dir = None
    try:
        log = tmp_path / "first.log"
        first = start_cli(["run", str(long_bench), "--stages", FIRST_STAGES], log)
        run_dir = wait_for_run_dir(tmp_path, first, log)
        wait_for_stage(run_dir, "run_benchmark", "running", first, log, timeout=300)
        held = json.loads((run_dir / "manifest.json").read_text())
        [flow_run_id] = held["prefect_flow_run_ids"]

        # a second run on the same folder: refused at once, one line naming the holder, nothing written
        log2 = tmp_path / "second.log"
        started = time.monotonic()
        second = start_cli(["run", str(long_bench), "--run-dir", str(run_dir), "--stages", SECOND_STAGES], log2,
                           prefect_api=cli_prefect_api)
        code, refused_after = second.wait(timeout=120), time.monotonic() - started
        output = log2.read_text()
        print(f"second run refused in {refused_after:.2f} s (exit {code}): {output.strip()}")
        assert code == 2, output[-3000:]
        assert output.strip().splitlines() == [
            f"error --run-dir: run folder {run_dir} is held by another run: pid {first.pid} on host "
            f"{socket.gethostname()}, Prefect flow run {flow_run_id}, since {holder_since(run_dir)}; wait for it to "
            f"end or stop it (kill {first.pid})"], output
        assert refused_after < 10  # no Prefect server started, no flow imported (a hang guard: ~1 s measured)
        assert attempts(json.loads((run_dir / "manifest.json").read_text())) == attempts(held)

        # the holder killed with SIGKILL: no hook, no teardown; its model server lives on in its own session
        [server] = [s for s in json.loads((run_dir / "servers.json").read_text()).values() if s["status"] == "live"]
        os.kill(first.pid, signal.SIGKILL)
        first.wait(timeout=30)
        assert psutil.pid_exists(server["pid"]) and reference_servers_alive(str(run_dir))

        # the next run on the folder takes it over, stops the dead run's server, deploys its own on the same port
        short_bench = write_config(tmp_path, "short", port, warmup=1, timed=2)
        log3 = tmp_path / "third.log"
        third = start_cli(["run", str(short_bench), "--run-dir", str(run_dir), "--stages", SECOND_STAGES], log3,
                          prefect_api=cli_prefect_api)
        code, output = third.wait(timeout=600), log3.read_text()
        assert code == 0, output[-3000:]
        assert output.count("taking it over from") == 1
        assert f"run folder {run_dir}: taking it over from pid {first.pid} on host {socket.gethostname()}, " \
               f"Prefect flow run {flow_run_id}, since " in output and ": its process is gone" in output
        assert output.count("left running by an earlier run on") == 1
        assert f"stopped {server['label']} (pid {server['pid']} on local), left running by an earlier run on " \
               f"{run_dir}" in output
        assert "run_benchmark: attempt 1 was interrupted (its process died)" in output
        final = json.loads((run_dir / "manifest.json").read_text())
        kept = attempts(final)
        for stage, recorded in attempts(held).items():  # every attempt of the first run is still there
            assert kept[stage][:len(recorded)] == recorded, (stage, kept[stage], recorded)
        assert [a["status"] for a in final["stages"]["run_benchmark"]["attempts"]] == ["interrupted", "completed"]
        assert len(final["stages"]["deploy_server"]["attempts"]) == 2
        assert final["prefect_flow_run_ids"][0] == flow_run_id and len(final["prefect_flow_run_ids"]) == 2
        servers = json.loads((run_dir / "servers.json").read_text())
        assert all(s["status"] == "stopped" for s in servers.values()), servers
        assert reference_servers_alive(str(run_dir)) == []
        assert not (run_dir / "holder.json").exists()
        assert_no_new_server(before)
    finally:
        kill_leftovers([first, second, third], run_dir)


def wait_for_run_dir(tmp_path: Path, proc, log: Path) -> Path:
    from tests.flows.test_interrupts import wait_until

    folder = tmp_path / "runs" / "run-lock"
    wait_until(lambda: folder.is_dir() and any((p / "manifest.json").is_file() for p in folder.iterdir()),
               "run folder created", proc, log, timeout=240)
    return next(p for p in folder.iterdir() if (p / "manifest.json").is_file())


def holder_since(run_dir: Path) -> str:
    return json.loads((run_dir / "holder.json").read_text())["since"]


def test_every_command_that_writes_a_run_folder_refuses_a_held_one_in_one_line(tmp_path):
    """`eagleops run --run-dir`, `nightly --run-dir`, `teardown` and `sync` on a folder another process holds:
    exit 2, one line naming the holder's pid, no traceback, nothing written; all four again once it is killed."""
    from typer.testing import CliRunner

    from flows.cli import app
    from tests.tasks.test_run_lock import hold_in_process

    run_dir = tmp_path / "runs" / "run-lock" / "held"
    run_dir.mkdir(parents=True)
    (run_dir / "manifest.json").write_text(json.dumps({"experiment": "run-lock", "run_id": "held", "stages": {},
                                                       "mlflow": {"tracking_uri": "sqlite:///nowhere.db"}}))
    config = write_config(tmp_path, "held", free_port(), warmup=1, timed=1)
    commands = {"run": ["run", str(config), "--run-dir", str(run_dir)],
                "nightly": ["nightly", str(config), "--run-dir", str(run_dir)],
                "teardown": ["teardown", str(run_dir)], "sync": ["sync", str(run_dir)]}
    holder = hold_in_process(run_dir)
    try:
        before = sorted(p.name for p in run_dir.iterdir())
        for name, args in commands.items():
            started = time.monotonic()
            result = CliRunner().invoke(app, args, env={"COLUMNS": "400"})
            lines = [line for line in result.output.splitlines() if line.strip()]
            print(f"{name}: exit {result.exit_code} in {time.monotonic() - started:.2f} s")
            assert result.exit_code == 2 and len(lines) == 1 and "Traceback" not in result.output, result.output
            assert f"is held by another run: pid {holder.pid} on host " in lines[0], result.output
        assert sorted(p.name for p in run_dir.iterdir()) == before
    finally:
        holder.kill()
        holder.wait()
    result = CliRunner().invoke(app, commands["teardown"], env={"COLUMNS": "400"})
    assert result.exit_code == 0 and f"taking it over from pid {holder.pid}" in result.output, result.output
    assert not (run_dir / "holder.json").exists()
