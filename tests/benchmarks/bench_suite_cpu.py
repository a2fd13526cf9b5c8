"""Where the test suite's CPU goes: every process sampled once a second, charged to a process kind and a test.

    python3 tests/benchmarks/bench_suite_cpu.py record DIR [-- COMMAND...]   (default command: make test)
    python3 tests/benchmarks/bench_suite_cpu.py report DIR [--top N]

On CI's 2-core machine the suite is CPU-bound (both cores busy from start to end, 4 workers), so its wall
time is its CPU seconds over 2: that is the figure to cut, and this tool says where it is spent.

`record` runs COMMAND (from the repository root) while a sampler reads /proc/<pid>/stat of every process
each second and writes each one's CPU growth (user + sys) to DIR/samples.txt, with its command line and
parent when first seen. pytest loads tests/benchmarks/suite_cpu_plugin.py (PYTEST_ADDOPTS), so every worker
logs its tests' spans to DIR/tests.<worker>.<pid>.log.

`report` prints the machine's busy CPU seconds against what was sampled, then CPU seconds by process kind
(`python -m <module>`, a script, a binary: count, total, mean per process), by test module and by test. A
process is charged to the test its pytest worker ran at that moment: the worker found up its parents, or,
for a server that left its launcher (setsid, a remote shell that exited), from the `popen-gwN` tmp folder in
its command line. What neither finds (the SGLang venv's install, PostgreSQL) is listed as such.

Limits: a process that lives less than a second between two samples is not seen (its CPU is in the
machine's total, not in the tables). A process that execs another gets its new command line on the next pass
(re-read when its name in /proc/PID/stat changes, as an exec changes it). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TICKS = os.sysconf("SC_CLK_TCK")
SHELLS = ("bash", "sh", "/bin/sh", "/bin/bash", "/usr/bin/bash")
FORKED = "-m eagle3.forkserver"  # a warm start's child reads so until it writes its own command line


# ------------------------------------------------------------------ record


def _read_stat(pid: str) -> tuple[int, int, str, str] | None:
    """(ppid, cpu ticks, start time, comm) of one process, None once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    comm = raw[raw.index("(") + 1:raw.rindex(")")]
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[1]), int(fields[11]) + int(fields[12]), fields[19], comm


def _cmdline(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:500].strip()
    except OSError:
        return ""


def sample_forever(out, stop: threading.Event, every_s: float = 1.0) -> None:
    """Writes `{"new": ...}` for a process first seen, `<t> <pid> <ticks>` for its CPU growth since the last
    sample, and `# <t> <cpu fields of /proc/stat>` for the machine, until `stop` is set."""
    seen: dict[tuple[int, str], list] = {}  # (pid, start) -> [ticks so far, command line, comm]
    first_pass = True  # what ran before the command started is not its CPU: the first pass only sets the baseline
    while not stop.is_set():
        now = time.time()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            stat = _read_stat(pid)
            if stat is None:
                continue
            ppid, ticks, start, comm = stat
            key = (int(pid), start)
            known = seen.get(key)
            # first seen, or it exec'd another program, or a warm start's child not yet named (eagle3.forkserver)
            if known is None or comm != known[2] or (FORKED in known[1] and _cmdline(pid) != known[1]):
                cmd = _cmdline(pid)
                out.write(json.dumps({"new": int(pid), "start": start, "ppid": ppid, "cmd": cmd, "t": now}) + "\n")
                known = seen[key] = [known[0] if known else (ticks if first_pass else 0), cmd, comm]
            if ticks > known[0]:
                out.write(f"{now:.1f} {pid} {ticks - known[0]}\n")
                known[0] = ticks
        out.write(f"# {now:.1f} {Path('/proc/stat').read_text().splitlines()[0][3:].strip()}\n")
        out.flush()
        first_pass = False
        stop.wait(every_s)


def record(folder: Path, command: list[str]) -> int:
    folder.mkdir(parents=True, exist_ok=True)
    stop = threading.Event()
    with (folder / "samples.txt").open("w") as out:
        sampler = threading.Thread(target=sample_forever, args=(out, stop), daemon=True)
        sampler.start()
        env = {**os.environ, "EAGLEOPS_SUITE_CPU_DIR": str(folder.resolve()),
               "PYTEST_ADDOPTS": f"{os.environ.get('PYTEST_ADDOPTS', '')} -p tests.benchmarks.suite_cpu_plugin".strip()}
        started = time.time()
        proc = subprocess.Popen(command, cwd=REPO, env=env)
        try:
            rc = proc.wait()
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
            rc = proc.wait()
        stop.set()
        sampler.join()
    print(f"{' '.join(command)}: exit {rc} after {time.time() - started:.0f} s; samples in {folder}", file=sys.stderr)
    return rc


# ------------------------------------------------------------------ report


def process_kind(cmd: str) -> str:
    """`-m <module>` for `python -m`, `py <script>` for a Python script, else the program's name."""
    argv = cmd.split(" ")
    program = Path(argv[0]).name if argv and argv[0] else "(no command line)"
    if "exec(eval(sys.stdin.readline()))" in cmd:
        return "pytest-xdist worker (and its forks)"
    if program.startswith("python"):
        module = re.search(r"\s-m\s+(\S+)", cmd)
        if module:
            return f"-m {module.group(1)}"
        script = next((a for a in argv[1:] if a and not a.startswith("-")), "")
        return "py " + re.sub(r"/tmp/\S*/", "<tmp>/", script)[-60:]
    if program in SHELLS:
        return f"{program} {Path(argv[1]).name if len(argv) > 1 else ''}".strip()
    return program.split(":")[0]


class Samples:
    def __init__(self, folder: Path):
        self.procs: dict[tuple, dict] = {}
        self.growth: list[tuple[float, tuple, float]] = []
        self.machine: list[tuple[float, list[int]]] = []
        current: dict[int, tuple] = {}
        for line in (folder / "samples.txt").read_text().splitlines():
            if line.startswith("{"):
                proc = json.loads(line)
                key = (proc["new"], proc["start"])
                self.procs[key] = {**self.procs.get(key, {}), **proc}
                current[proc["new"]] = key
            elif line.startswith("#"):
                t, *fields = line[2:].split()
                self.machine.append((float(t), [int(f) for f in fields]))
            elif line:
                t, pid, ticks = line.split()
                key = current.get(int(pid))
                if key:
                    self.growth.append((float(t), key, int(ticks) / TICKS))
        self.spans: dict[int, list] = collections.defaultdict(list)  # worker pid -> [(start, end, nodeid)]
        self.worker_pid: dict[str, int] = {}
        for log in folder.glob("tests.gw*.log"):
            started: dict[str, float] = {}
            for line in log.read_text().splitlines():
                mark, t, pid, nodeid = line.split(" ", 3)
                self.worker_pid[log.name.split(".")[1]] = int(pid)
                if mark == "S":
                    started[nodeid] = float(t)
                else:
                    self.spans[int(pid)].append((started.pop(nodeid, float(t)), float(t), nodeid))
        for spans in self.spans.values():
            spans.sort()
        self._by_pid = {key[0]: key for key in self.procs}

    def worker_of(self, key: tuple, depth: int = 0) -> int | None:
        """The pytest worker a process descends from; else the one named by a popen-gwN folder in its command."""
        if key[0] in self.spans:
            return key[0]
        proc = self.procs[key]
        parent = self._by_pid.get(proc["ppid"])
        if parent and parent != key and depth < 50:
            found = self.worker_of(parent, depth + 1)
            if found is not None:
                return found
        named = re.search(r"popen-(gw\d+)", proc.get("cmd", ""))
        return self.worker_pid.get(named.group(1)) if named else None

    def test_at(self, worker: int, t: float) -> str:
        spans = self.spans[worker]
        i = bisect.bisect_right(spans, (t, float("inf"), "")) - 1
        return spans[i][2] if i >= 0 and spans[i][0] <= t <= spans[i][1] + 1.5 else "(between tests)"


def report(folder: Path, top: int) -> None:
    s = Samples(folder)
    (t0, first), (t1, last) = s.machine[0], s.machine[-1]
    diff = [b - a for a, b in zip(first, last)]
    idle = (diff[3] + diff[4]) / TICKS
    busy = (sum(diff[:8]) - diff[3] - diff[4]) / TICKS
    cpu_by_proc = collections.Counter()
    by_test, by_module = collections.Counter(), collections.Counter()
    kinds_in_module = collections.defaultdict(collections.Counter)
    unattributed = collections.Counter()
    worker_cache: dict[tuple, int | None] = {}
    for t, key, seconds in s.growth:
        cpu_by_proc[key] += seconds
        kind = process_kind(s.procs[key].get("cmd", ""))
        if key not in worker_cache:
            worker_cache[key] = s.worker_of(key)
        worker = worker_cache[key]
        if worker is None:
            unattributed[kind] += seconds
            continue
        test = s.test_at(worker, t)
        module = test.split("::")[0]
        by_test[test] += seconds
        by_module[module] += seconds
        kinds_in_module[module][kind] += seconds
    kinds = collections.defaultdict(lambda: [0, 0.0])
    for key, proc in s.procs.items():
        kind = process_kind(proc.get("cmd", ""))
        kinds[kind][0] += 1
        kinds[kind][1] += cpu_by_proc[key]
    sampled = sum(cpu_by_proc.values())
    print(f"{t1 - t0:.0f} s wall, {busy:.0f} CPU-s busy on {os.cpu_count()} cores ({idle:.0f} idle); "
          f"{sampled:.0f} CPU-s sampled in {len(s.procs)} processes; {sum(by_module.values()):.0f} charged to tests "
          f"(by module below), {sum(unattributed.values()):.0f} to no worker")
    print("\nCPU-s by process kind (count, total, per process):")
    for kind, (count, total) in sorted(kinds.items(), key=lambda kv: -kv[1][1])[:top]:
        print(f"  {total:8.1f} {count:5d} {total / max(count, 1):7.2f}  {kind}")
    print("\nCPU-s by test module (its processes' kinds):")
    for module, total in by_module.most_common(top):
        detail = ", ".join(f"{k} {v:.0f}" for k, v in kinds_in_module[module].most_common(3))
        print(f"  {total:8.1f}  {module}  [{detail}]")
    print("\nCPU-s by test (setup and teardown included):")
    for test, total in by_test.most_common(top):
        print(f"  {total:8.1f}  {test}")
    print("\nCPU-s of processes no worker owns, by kind:")
    for kind, total in unattributed.most_common(top // 2):
        print(f"  {total:8.1f}  {kind}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    rec = sub.add_parser("record", help="run a command (default: make test) while sampling every process")
    rec.add_argument("folder", type=Path)
    rec.add_argument("command", nargs=argparse.REMAINDER, help="after `--`; default: make test")
    rep = sub.add_parser("report", help="CPU seconds by process kind, test module and test")
    rep.add_argument("folder", type=Path)
    rep.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    if args.mode == "record":
        command = args.command[1:] if args.command[:1] == ["--"] else args.command
        return record(args.folder, command or ["make", "test"])
    if not (args.folder / "samples.txt").is_file():
        print(f"{args.folder}: no samples.txt here (run `record {args.folder}` first)", file=sys.stderr)
        return 2
    report(args.folder, args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
