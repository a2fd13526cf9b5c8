"""A real OpenSSH sshd on 127.0.0.1 for tests: own config, host key, user key, free port.

Key-only login for the current user (root in CI), no PAM, no passwords. `start_sshd()` runs
`sshd -D` (foreground, so it is our child) and `SshdServer.stop()` stops it and every
process it started (per-connection children call setsid, so they are found through the
process tree, not the process group) and checks none is left.
"""

from __future__ import annotations

import getpass
import os
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tasks.config.schema import HostConfig

SSHD = "/usr/sbin/sshd"
SFTP_SERVERS = ["/usr/lib/openssh/sftp-server", "/usr/libexec/openssh/sftp-server", "/usr/lib/ssh/sftp-server"]


class SshdUnavailable(RuntimeError):
    """sshd is not installed or would not start; tests that need it skip with this message."""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _keygen(path: Path, comment: str) -> None:
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(path)],
                   check=True, capture_output=True, timeout=60)


def _config(directory: Path, port: int, extra: list[str]) -> str:
    sftp = next((p for p in SFTP_SERVERS if Path(p).exists()), "internal-sftp")
    lines = [
        f"Port {port}",
        "ListenAddress 127.0.0.1",
        f"HostKey {directory / 'host_ed25519'}",
        f"PidFile {directory / 'sshd.pid'}",
        f"AuthorizedKeysFile {directory / 'authorized_keys'}",
        "PubkeyAuthentication yes",
        "PasswordAuthentication no",
        "KbdInteractiveAuthentication no",
        "UsePAM no",
        "PermitRootLogin prohibit-password",
        "StrictModes no",
        "AllowTcpForwarding yes",
        "MaxSessions 64",
        "MaxStartups 64",
        "LogLevel VERBOSE",
        # bash started by sshd for a command reads the user's ~/.bashrc unless it is a nested shell (SHLVL >= 1 on
        # entry). Where ~/.bashrc runs `pyenv init` (this machine and CI's) that is ~0.45 s and ~0.13 s CPU per
        # remote command and SFTP session, on a suite of ~2,600 sessions; and its rehash lock, left by a session
        # killed mid-rehash, once stalled every later command 60 s. A GPU host's shell setup is not what the
        # tests test: every remote Python is named by path (HostConfig.python).
        "SetEnv SHLVL=1",
        f"Subsystem sftp {sftp}",
        *extra,
    ]
    return "\n".join(lines) + "\n"


@dataclass
class SshdServer:
    directory: Path
    port: int
    process: subprocess.Popen
    user: str
    host_key: Path
    user_key: Path
    known_hosts: Path
    log: Path
    _children: set[int] = field(default_factory=set)

    def host_config(self, **overrides) -> HostConfig:
        """A HostConfig for this sshd; its known_hosts file already holds the host key."""
        values = dict(name="testhost", address="127.0.0.1", port=self.port, user=self.user,
                      key_file=str(self.user_key), known_hosts=str(self.known_hosts), connect_timeout_s=10,
                      connect_retries=2)
        values.update(overrides)
        return HostConfig(**values)

    def connection_pids(self) -> list[int]:
        """Per-connection sshd processes now alive (what a test kills to cut a connection for real)."""
        try:
            return [p.pid for p in psutil.Process(self.process.pid).children(recursive=False)]
        except psutil.NoSuchProcess:
            return []

    def log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self) -> None:
        """Stop sshd and everything below it; raise if anything survives."""
        try:
            tree = [psutil.Process(self.process.pid), *psutil.Process(self.process.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            try:
                proc.terminate()
            except psutil.NoSuchProcess:
                continue
        _, alive = psutil.wait_procs(tree, timeout=10)
        for proc in alive:
            proc.kill()
        _, alive = psutil.wait_procs(alive, timeout=10)
        self.process.wait(timeout=10)
        if alive:
            raise RuntimeError(f"sshd processes survived SIGKILL: {[p.pid for p in alive]}")


def _wait_for_banner(port: int, process: subprocess.Popen, log: Path, limit_s: float = 30.0) -> None:
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SshdUnavailable(f"sshd exited with {process.returncode}: {log.read_text(errors='replace')[-2000:]}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=2) as conn:
                if conn.recv(64).startswith(b"SSH-"):
                    return
        except OSError:
            time.sleep(0.1)
    raise SshdUnavailable(f"sshd did not answer on 127.0.0.1:{port} within {limit_s} s")


def start_sshd(directory: Path, extra_config: list[str] | None = None) -> SshdServer:
    """Start a private sshd under `directory` (created); SshdUnavailable if it cannot run."""
    if not Path(SSHD).exists() or shutil.which("ssh-keygen") is None:
        raise SshdUnavailable(f"{SSHD} or ssh-keygen missing (apt-get install openssh-server)")
    directory.mkdir(parents=True, exist_ok=True)
    host_key, user_key = directory / "host_ed25519", directory / "user_ed25519"
    if not host_key.exists():
        _keygen(host_key, "eagleops-test-host")
        _keygen(user_key, "eagleops-test-user")
    (directory / "authorized_keys").write_text((directory / "user_ed25519.pub").read_text())
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(parents=True, exist_ok=True)  # privilege-separation directory
    log = directory / "sshd.log"
    for _ in range(3):  # the free port can be taken between probe and bind
        port = free_port()
        (directory / "sshd_config").write_text(_config(directory, port, extra_config or []))
        with open(log, "ab") as sink:
            process = subprocess.Popen([SSHD, "-D", "-e", "-f", str(directory / "sshd_config")],
                                       stdout=subprocess.DEVNULL, stderr=sink, start_new_session=True)
        try:
            _wait_for_banner(port, process, log)
        except SshdUnavailable:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
            continue
        host_pub = (directory / "host_ed25519.pub").read_text().split()
        known_hosts = directory / "known_hosts"
        known_hosts.write_text(f"[127.0.0.1]:{port} {host_pub[0]} {host_pub[1]}\n")
        return SshdServer(directory, port, process, getpass.getuser(), host_key, user_key, known_hosts, log)
    raise SshdUnavailable(f"sshd would not start; log:\n{log.read_text(errors='replace')[-2000:]}")
