"""Transfer throughput over SSH on loopback: OpenSSH scp vs our verified `upload_file` and
`download_file` (vs paramiko `put` and scp followed by a remote hash, for reference).

Run by hand (it is a measurement, not a test):

    PYTHONPATH=$PWD python tests/benchmarks/bench_upload.py --size-mib 512 --repeats 3

One private sshd (tests/sshd.py) serves all variants; the same random file goes through each
variant in turn, round-robin, `--repeats` times, into a tmpfs (/dev/shm) by default so disk
speed does not enter: uploads copy it onto the "host", downloads copy it back from there.
Every copy is checked against the source's sha256 before it counts. Timing is end to end
(connect, key exchange, auth, transfer; for `upload_file` and `download_file` also both sides'
hashing and the rename). Each direction's ratios are against scp in that direction, from the
same run. Client CPU is this process plus reaped children; server CPU is what the sshd listener
reaped from its per-connection children.
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Callable

import paramiko
import psutil

from tasks.config.schema import HostConfig
from tasks.hosts.remote import connect, sha256_file
from tests.sshd import SshdServer, start_sshd


def write_random_file(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        left = size
        while left:
            block = os.urandom(min(left, 1 << 24))
            f.write(block)
            left -= len(block)


def scp(server: SshdServer, source: str, target: str, *options: str) -> None:
    subprocess.run(
        ["scp", "-q", "-P", str(server.port), "-i", str(server.user_key), "-o", "BatchMode=yes",
         "-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "StrictHostKeyChecking=yes", *options, source,
         target],
        check=True, timeout=3600,
    )


def upload_with_scp(server: SshdServer, src: Path, dest: str, options: tuple[str, ...] = ()) -> None:
    scp(server, str(src), f"{server.user}@127.0.0.1:{dest}", *options)


def download_with_scp(server: SshdServer, src: Path, dest: str, options: tuple[str, ...] = ()) -> None:
    scp(server, f"{server.user}@127.0.0.1:{src}", dest, *options)


def upload_with_scp_then_verify(server: SshdServer, src: Path, dest: str) -> None:
    """scp, then a second pass on the host (openssl re-reads the copy): how upload_file verified before
    it hashed while streaming, kept as the like-for-like cost of verifying after the copy."""
    upload_with_scp(server, src, dest)
    subprocess.run(
        ["ssh", "-p", str(server.port), "-i", str(server.user_key), "-o", "BatchMode=yes",
         "-o", f"UserKnownHostsFile={server.known_hosts}", "-o", "StrictHostKeyChecking=yes",
         f"{server.user}@127.0.0.1", f"openssl dgst -sha256 -r {shlex.quote(dest)}"],
        check=True, timeout=3600, stdout=subprocess.DEVNULL,
    )


def upload_with_executor(host: HostConfig, server: SshdServer, src: Path, dest: str) -> dict:
    with connect(host) as executor:
        result = executor.upload_file(src, dest)
    return {"transfer_s": result.transfer_seconds, "verify_s": result.verify_seconds, "moved": result.bytes_sent}


def download_with_executor(host: HostConfig, server: SshdServer, src: Path, dest: str) -> dict:
    with connect(host) as executor:
        result = executor.download_file(str(src), dest)
    return {"transfer_s": result.transfer_seconds, "verify_s": result.verify_seconds, "moved": result.bytes_received}


def upload_with_sftp_put(server: SshdServer, src: Path, dest: str) -> None:
    client = paramiko.SSHClient()
    client.load_host_keys(str(server.known_hosts))
    client.set_missing_host_key_policy(paramiko.RejectPolicy())
    client.connect("127.0.0.1", server.port, username=server.user, key_filename=str(server.user_key),
                   allow_agent=False, look_for_keys=False, timeout=30)
    try:
        with client.open_sftp() as sftp:
            sftp.put(str(src), dest)
    finally:
        client.close()


UPLOAD_SCP, DOWNLOAD_SCP = "upload: scp (OpenSSH)", "download: scp (OpenSSH)"
# scp's default cipher is chacha20-poly1305; ours is aes128-gcm (ssh.py FAST_CIPHER). The rows
# with this option show how much of a ratio is the cipher and how much is the transfer itself.
SAME_CIPHER = ("-c", "aes128-gcm@openssh.com")
Variant = Callable[[SshdServer, Path, str], "dict | None"]


def variants(host: HostConfig) -> dict[str, Variant]:
    """Each variant by name; ours run against `host` (the sshd, with the host python asked for)."""
    return {
        UPLOAD_SCP: upload_with_scp,
        "upload: scp -c aes128-gcm (our cipher; plain copy)": partial(upload_with_scp, options=SAME_CIPHER),
        "upload: scp + remote openssl dgst (a second pass on the host)": upload_with_scp_then_verify,
        "upload: upload_file (aes128-gcm, hashed while streaming, verified)": partial(upload_with_executor, host),
        "upload: paramiko SFTPClient.put, defaults": upload_with_sftp_put,
        DOWNLOAD_SCP: download_with_scp,
        "download: scp -c aes128-gcm (our cipher; plain copy)": partial(download_with_scp, options=SAME_CIPHER),
        "download: download_file (aes128-gcm, hashed while streaming, verified)": partial(download_with_executor,
                                                                                          host),
    }


def client_cpu_s() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def server_cpu_s(server: SshdServer) -> float:
    times = psutil.Process(server.process.pid).cpu_times()
    return times.children_user + times.children_system


def wait_for_sessions_to_end(server: SshdServer) -> None:
    """Per-connection sshd children exit a moment after the client closes; their CPU counts once reaped."""
    for _ in range(200):
        if not server.connection_pids():
            return
        time.sleep(0.05)
    raise RuntimeError(f"sshd sessions still open: {server.connection_pids()}")


def measure(name: str, variant: Variant, server: SshdServer, src: Path, dest: str, expected_sha: str) -> dict:
    if os.path.exists(dest):
        os.remove(dest)
    load_before = os.getloadavg()[0]
    cpu0, srv0, t0 = client_cpu_s(), server_cpu_s(server), time.perf_counter()
    phases = variant(server, src, dest) or {}
    seconds = time.perf_counter() - t0
    wait_for_sessions_to_end(server)
    cpu, srv = client_cpu_s() - cpu0, server_cpu_s(server) - srv0
    actual = sha256_file(dest)
    if actual != expected_sha:
        raise RuntimeError(f"{name}: {dest} has sha256 {actual}, source has {expected_sha}")
    os.remove(dest)
    return {"seconds": seconds, "client_cpu": cpu, "server_cpu": srv, "load": load_before, **phases}


def report(results: dict[str, list[dict]], size: int) -> str:
    gib = size / 2**30
    scp_mbps = {direction: statistics.median(size / 1e6 / r["seconds"] for r in results[name])
                for direction, name in (("upload", UPLOAD_SCP), ("download", DOWNLOAD_SCP))}
    lines = ["| Variant | MB/s median | min-max | x scp (same direction) | CPU s/GiB client / server | "
             "load avg (1 min) at start |", "|---|---|---|---|---|---|"]
    for name, runs in results.items():
        baseline = scp_mbps[name.split(":")[0]]
        rates = [size / 1e6 / r["seconds"] for r in runs]
        median = statistics.median(rates)
        client = statistics.median(r["client_cpu"] for r in runs) / gib
        server = statistics.median(r["server_cpu"] for r in runs) / gib
        loads = ", ".join(f"{r['load']:.1f}" for r in runs)
        lines.append(f"| {name} | {median:.0f} | {min(rates):.0f}-{max(rates):.0f} | {median / baseline:.2f} | "
                     f"{client:.1f} / {server:.1f} | {loads} |")
        if "transfer_s" in runs[0]:
            transfer = [r["moved"] / 1e6 / r["transfer_s"] for r in runs]
            verify = statistics.median(r["verify_s"] for r in runs)
            lines.append(f"| ... its streaming phase alone (verifying outside it: median {verify:.2f} s) | "
                         f"{statistics.median(transfer):.0f} | {min(transfer):.0f}-{max(transfer):.0f} | "
                         f"{statistics.median(transfer) / baseline:.2f} | | |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mib", type=int, default=512, help="size of the random file (MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="runs per variant (median reported)")
    parser.add_argument("--dest-dir", default="/dev/shm", help="where the copies land (tmpfs by default)")
    parser.add_argument("--src-dir", default=None, help="where the source file is written (default: a tmp dir)")
    parser.add_argument("--host-python", default=sys.executable,
                        help="hosts[].python for upload_file/download_file (default: this interpreter)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    work = Path(tempfile.mkdtemp(prefix="bench-upload-", dir=args.src_dir))
    dest_dir = Path(tempfile.mkdtemp(prefix="bench-upload-dest-", dir=args.dest_dir))
    server = start_sshd(work / "sshd")
    try:
        src, size = work / "payload.bin", args.size_mib * 2**20
        write_random_file(src, size)
        expected = sha256_file(src)  # also leaves the file in the page cache
        print(f"{args.size_mib} MiB, sha256 {expected[:16]}..., dest {dest_dir}, {os.cpu_count()} CPUs, "
              f"paramiko {paramiko.__version__}, python {sys.version.split()[0]}, host python {args.host_python}, "
              f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
        chosen = variants(server.host_config(python=args.host_python))
        results: dict[str, list[dict]] = {name: [] for name in chosen}
        for repeat in range(args.repeats):
            for name, variant in chosen.items():
                run = measure(name, variant, server, src, str(dest_dir / f"copy-{repeat}.bin"), expected)
                results[name].append(run)
                phases = (f", streaming {run['transfer_s']:.1f} s + verify {run['verify_s']:.1f} s"
                          if "transfer_s" in run else "")
                print(f"  run {repeat + 1} {name}: {size / 1e6 / run['seconds']:.0f} MB/s in {run['seconds']:.1f} s "
                      f"(client {run['client_cpu']:.1f} CPU-s, server {run['server_cpu']:.1f} CPU-s, "
                      f"load {run['load']:.1f}{phases})", flush=True)
        print(report(results, size))
        print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        server.stop()
        shutil.rmtree(dest_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
