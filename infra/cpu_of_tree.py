"""`python3 infra/cpu_of_tree.py -- COMMAND...`: run COMMAND and print its wall time and the CPU seconds (user + sys)
of its whole process tree, the suite's budget figure (.ci/run; tests/benchmarks/NOTES_suite_cpu.md).

A process's own rusage counts only the children it waited for; servers the suite starts detached (setsid, a
shell that exits) are reparented away and their CPU would be missed. So this process becomes the tree's child
subreaper (prctl PR_SET_CHILD_SUBREAPER): orphans are reparented to it, it reaps them, and RUSAGE_CHILDREN then
holds every descendant that ended. Descendants still running when COMMAND ends are listed (nothing the suite
starts may be left running) and not waited for. The machine's busy CPU seconds over the same span (/proc/stat,
every process on the machine) are printed beside it. Exits with COMMAND's status. Standard library only.
"""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def machine_busy_s() -> float:
    fields = [int(v) for v in open("/proc/stat").readline().split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def children_left() -> list[str]:
    me, found = str(os.getpid()), []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = open(f"/proc/{pid}/stat").read()
            if stat[stat.rindex(")") + 2:].split()[1] == me:
                found.append(f"{pid} " + open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()[:160])
        except OSError:
            continue
    return found


def main(argv: list[str]) -> int:
    command = argv[argv.index("--") + 1:] if "--" in argv else argv
    if not command:
        print("usage: cpu_of_tree.py -- COMMAND...", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    subreaper = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    started, busy_before = time.monotonic(), machine_busy_s()
    proc = subprocess.Popen(command)
    signal.signal(signal.SIGINT, lambda *_: proc.send_signal(signal.SIGINT))  # Ctrl-C goes to the suite
    while proc.poll() is None:
        reap()
        time.sleep(1)
    rc = proc.returncode
    reap()
    wall, busy = time.monotonic() - started, machine_busy_s() - busy_before
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    left = children_left()
    print(f"\n== {' '.join(command)}: exit {rc}; wall {wall:.0f} s; CPU of its process tree {usage.ru_utime:.1f} s "
          f"user + {usage.ru_stime:.1f} s sys = {usage.ru_utime + usage.ru_stime:.1f} CPU-s"
          f"{'' if subreaper else ' (no subreaper: detached processes missed)'}; machine busy {busy:.0f} CPU-s on "
          f"{os.cpu_count()} cores", flush=True)
    if left:
        print(f"== still running after it ({len(left)}, not counted):\n" + "\n".join(left), flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
