"""torchrun launches for eagle3.training.train, importable without torch (a node launcher needs no CUDA).

`torchrun_command` builds one node's `python -m torch.distributed.run ... -m eagle3.training.train ...`:
`--standalone` on this machine, or a `NodePlace` in an orchestrated run. `run_node` (also
`python -m eagle3.torchrun --node-rank I ...`) is what an orchestrator starts on each node:
torchrun in the foreground of the launcher's process group, its output passed through, and
`node_status.json` left behind saying how it ended. `describe_rank_failures` turns torchrun's
per-rank files and its "Root Cause" block into the error a user reads.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from eagle3.config import TrainConfig


def torchrun_env(nproc: int, num_workers: int, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Environment for torchrun's ranks: eagle3 importable from any cwd, and OMP_NUM_THREADS set.

    torchrun gives every rank OMP_NUM_THREADS=1 unless the variable is already set; one thread
    made collating a 64 MiB micro-batch take ~40 ms instead of ~6 ms on the training thread. Each
    rank gets its share of this machine's cores left after the DataLoader workers (one thread
    each); an OMP_NUM_THREADS the caller set explicitly is kept.
    """
    env = dict(os.environ if environ is None else environ)
    package_root = str(Path(__file__).resolve().parents[2])  # the folder that holds eagle3/
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [package_root, env.get("PYTHONPATH")]))
    if not env.get("OMP_NUM_THREADS"):
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        env["OMP_NUM_THREADS"] = str(max(1, (cores - nproc * num_workers) // nproc))
    return env


@dataclass(frozen=True)
class NodePlace:
    """This machine's place in an orchestrated torchrun: static rendezvous, node 0 hosts the store.

    Static, not c10d: global rank 0 (checkpoints, history.jsonl, summary.json) must be on node 0,
    whose files the orchestrator reads; c10d hands out node ranks in joining order. A single node
    given no master address runs `--standalone`: its store binds a port the OS hands out, so two
    trainings starting at once on one host never race for one port.
    """

    nnodes: int
    node_rank: int
    master_addr: str | None = None
    master_port: int | None = None

    def torchrun_args(self) -> list[str]:
        if self.master_addr is None:
            return ["--standalone"]
        return [f"--nnodes={self.nnodes}", f"--node-rank={self.node_rank}", f"--master-addr={self.master_addr}",
                f"--master-port={self.master_port}"]


def torchrun_command(data_dir: Path, target_dir: Path, config_file: Path, out_dir: Path, devices: int,
                     aux_layer_ids: list[int], draft_vocab_size: int, node: NodePlace | None = None,
                     python: str = sys.executable) -> list[str]:
    """`python -m torch.distributed.run ... -m eagle3.training.train ...`, one node (`--standalone`) or `node`."""
    place = ["--standalone"] if node is None else node.torchrun_args()
    return [python, "-m", "torch.distributed.run", *place, f"--nproc_per_node={devices}",
            "--log-dir", str(out_dir / "torchrun_logs"), "--redirects", "3", "--tee", "3",
            "-m", "eagle3.training.train", "--data-dir", str(data_dir), "--target-dir", str(target_dir),
            "--out-dir", str(out_dir), "--config", str(config_file),
            "--aux-layer-ids", ",".join(map(str, aux_layer_ids)), "--draft-vocab-size", str(draft_vocab_size)]


NODE_STATUS = "node_status.json"
TORCHRUN_TAIL_LINES = 2000  # of torchrun's output kept for its failure report (tracebacks included)


def run_node(data_dir: Path, target_dir: Path, config_file: Path, out_dir: Path, aux_layer_ids: list[int],
             draft_vocab_size: int, node: NodePlace) -> int:
    """One node of an orchestrated run, started by an orchestrator (detached, as its process group's leader).

    Runs torchrun in the foreground of this process group, so the orchestrator's kill of the group reaches
    torchrun, which forwards the SIGTERM to the ranks (each in a session of its own) and waits for them.
    Leaves out_dir/node_status.json (exit code, which rank failed and its log tail) for the orchestrator; returns the exit code.
    """
    cfg = TrainConfig.model_validate_json(Path(config_file).read_text())
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / NODE_STATUS).unlink(missing_ok=True)
    shutil.rmtree(out_dir / "torchrun_logs", ignore_errors=True)
    cmd = torchrun_command(data_dir, target_dir, config_file, out_dir, cfg.devices, aux_layer_ids, draft_vocab_size,
                           node)
    env = torchrun_env(cfg.devices, cfg.num_workers)
    print(f"node {node.node_rank}/{node.nnodes} (OMP_NUM_THREADS={env['OMP_NUM_THREADS']} per rank): "
          + " ".join(cmd), flush=True)
    recent: collections.deque[str] = collections.deque(maxlen=TORCHRUN_TAIL_LINES)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in proc.stdout:
        print(line, end="", flush=True)
        recent.append(line.rstrip())
    returncode = proc.wait()
    status = {"node_rank": node.node_rank, "returncode": returncode, "finished_at": time.time(),
              "failures": describe_rank_failures(out_dir / "torchrun_logs", recent) if returncode else ""}
    tmp = out_dir / (NODE_STATUS + ".tmp")
    tmp.write_text(json.dumps(status))
    tmp.replace(out_dir / NODE_STATUS)
    return returncode


def _tail(path: Path, lines: int = 20) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.is_file() else ""


def describe_rank_failures(log_dir: Path, torchrun_output: Sequence[str] = ()) -> str:
    """Which ranks failed and how, from torchrun's per-rank files of the last attempt.

    A rank that raised leaves `<rank>/error.json` (eagle3.training.train.main is `@record`ed); a rank
    killed by a signal (SIGKILL, the OOM killer) leaves none, and the others then raise only
    because they lost their peer (gloo: "Connection reset by peer"). The rank `first_failure`
    finds in torchrun's failure report is reported first, with its exit code. Otherwise raising
    ranks are listed by when they failed. Without any error file, every rank's stderr tail is shown.
    """
    attempts = sorted(log_dir.glob("*/attempt_*"), key=lambda p: p.stat().st_mtime_ns)
    if not attempts:
        return f"no per-rank logs under {log_dir}; see the output above"
    ranks = sorted((p for p in attempts[-1].iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    raised = sorted((r for r in ranks if (r / "error.json").is_file()),
                    key=lambda r: (r / "error.json").stat().st_mtime_ns)
    cause = first_failure(torchrun_output)
    parts = [_rank_report(r, f"died first: {cause['how']}") for r in ranks
             if cause and r.name == cause["rank"] and r not in raised]
    for n, rank_dir in enumerate(raised):
        when = "" if len(raised) == 1 and not parts else " after it" if parts or n else " first"
        parts.append(_rank_report(rank_dir, f"failed{when}: {_error_message(rank_dir / 'error.json')}"))
    if not parts:
        parts = [_rank_report(r, "failed: no error file (killed by a signal?)") for r in ranks]
    return "\n".join(parts)


@dataclass(frozen=True)
class RankFailure:
    """One entry of torchrun's failure report."""

    rank: str
    exitcode: int | None
    error_file: str  # "<N/A>" when the rank left none
    traceback: str  # its first line: "Signal 9 (SIGKILL) received by PID ..." for a killed rank
    root_cause: bool  # the entry under "Root Cause (first observed failure)"

    @property
    def terminated_by_torchrun(self) -> bool:
        """SIGTERM: what torchrun sends the ranks still running when it stops the group."""
        return self.exitcode == -signal.SIGTERM

    @property
    def killed_silently(self) -> bool:
        """Ended by another signal, without an error file."""
        return (self.exitcode is not None and self.exitcode < 0 and not self.terminated_by_torchrun
                and self.error_file in ("", "<N/A>"))


def first_failure(torchrun_output: Sequence[str]) -> dict[str, str] | None:
    """The rank that failed first and how it ended, from the failure report torchrun prints.

    torchrun's own "Root Cause (first observed failure)" is the entry with the smallest timestamp,
    in whole seconds, and a rank without an error file is dated when torchrun notices it; so within
    one second it can name a rank that only reacted. The order here: a rank killed silently
    (SIGKILL, the OOM killer: its peers then raise "Connection reset by peer"); then any rank but
    those torchrun SIGTERMed while stopping the group (it lists them as failures too), torchrun's
    pick first; then torchrun's pick.
    """
    failures = torchrun_failures(torchrun_output)
    chosen = min(failures, key=lambda f: (not f.killed_silently, f.terminated_by_torchrun, not f.root_cause),
                 default=None)
    if chosen is None:
        return None
    how = f"exit code {'?' if chosen.exitcode is None else chosen.exitcode}"
    if chosen.traceback.startswith("Signal"):
        how += f" ({chosen.traceback})"
    return {"rank": chosen.rank, "how": how}


def torchrun_failures(torchrun_output: Sequence[str]) -> list[RankFailure]:
    """Every entry of the last failure report in torchrun's output, in the order printed."""
    lines = list(torchrun_output)
    reports = [i for i, line in enumerate(lines) if line.strip() == "Failures:"]
    entries: list[dict] = []
    root_cause = False
    for line in lines[reports[-1] if reports else 0:]:
        root_cause = root_cause or "Root Cause (first observed failure)" in line
        key, sep, value = (part.strip() for part in line.partition(":"))
        if sep and key == "rank" and value[:1].isdigit():
            entries.append({"rank": value.split()[0], "root_cause": root_cause})
        elif sep and key in ("exitcode", "error_file", "traceback") and entries and key not in entries[-1]:
            entries[-1][key] = value
    return [RankFailure(rank=e["rank"], exitcode=_leading_int(e.get("exitcode", "")),
                        error_file=e.get("error_file", ""), traceback=e.get("traceback", ""),
                        root_cause=e["root_cause"]) for e in entries]


def _leading_int(text: str) -> int | None:
    """-9 from "-9 (pid: 16910)  (SIGKILL)"."""
    head = text.split()[0] if text.split() else ""
    return int(head) if head.lstrip("-").isdigit() else None


def _rank_report(rank_dir: Path, what: str) -> str:
    stderr = rank_dir / "stderr.log"
    return f"rank {rank_dir.name} {what}\n--- last lines of {stderr} ---\n{_tail(stderr)}"


def _error_message(error_file: Path) -> str:
    """The exception line torchrun's @record wrote for a rank."""
    try:
        message = json.loads(error_file.read_text())["message"]
    except (ValueError, KeyError) as exc:
        return f"unreadable {error_file} ({exc})"
    return message.get("message", str(message)) if isinstance(message, dict) else str(message)


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3.torchrun --node-rank I --nnodes N [--master-addr A --master-port P] --data-dir D ...`:
    one node of an orchestrated run (run_node); its exit code is torchrun's."""
    import argparse

    parser = argparse.ArgumentParser(description=main.__doc__)
    for flag in ("--data-dir", "--target-dir", "--out-dir", "--config", "--aux-layer-ids", "--draft-vocab-size"):
        parser.add_argument(flag, required=True)
    for flag in ("--node-rank", "--nnodes"):
        parser.add_argument(flag, type=int, required=True)
    parser.add_argument("--master-addr", help="node 0's address; without it (one node only) --standalone")
    parser.add_argument("--master-port", type=int)
    args = parser.parse_args(argv)
    if (args.master_addr is None) != (args.master_port is None):
        parser.error("--master-addr and --master-port go together")
    if args.master_addr is None and args.nnodes != 1:
        parser.error("--master-addr and --master-port are needed with more than one node")
    node = NodePlace(args.nnodes, args.node_rank, args.master_addr, args.master_port)
    return run_node(Path(args.data_dir), Path(args.target_dir), Path(args.config), Path(args.out_dir),
                    [int(i) for i in args.aux_layer_ids.split(",")], int(args.draft_vocab_size), node)


if __name__ == "__main__":
    sys.exit(main())
