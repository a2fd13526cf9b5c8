"""tasks/hosts/servers.py `wait_healthy` against the launch race on a port: the port was free at the preflight,
and another run's server bound it while the launched one still loaded its weights. Its answers must not pass
for the launched server's. Real processes and real HTTP servers on this machine; the executor's probe reads
which process group holds the listening socket (/proc).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tasks.hosts.remote import LocalExecutor
from tasks.hosts.servers import PortTaken, ServerHandle, wait_healthy
from tests.helpers import free_port
from tests.tasks.hosts.remote.helpers import live_processes

# An HTTP server that answers every GET with 200 and a JSON naming itself, as /health_generate and /server_info do.
SERVER_PY = """import http.server, json, sys
class Answer(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        body = json.dumps({"served_by": sys.argv[2]}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("0.0.0.0", int(sys.argv[1])), Answer).serve_forever()
"""


def start(executor: LocalExecutor, tmp_path: Path, name: str, argv: list[str], port: int) -> ServerHandle:
    log, pid_file = tmp_path / f"{name}.log", tmp_path / f"{name}.pid"
    pid = executor.start_detached(argv, log_file=str(log), pid_file=str(pid_file))
    return ServerHandle(name, "local", pid, port, str(log), str(pid_file), argv, False,
                        local_url=f"http://127.0.0.1:{port}")


@pytest.fixture
def servers(tmp_path):
    executor, started = LocalExecutor(), []

    def launch(name: str, argv: list[str], port: int) -> ServerHandle:
        started.append(start(executor, tmp_path, name, argv, port))
        return started[-1]

    yield executor, launch
    for handle in started:
        executor.kill_group(handle.pid)
    assert live_processes(str(tmp_path)) == []


def test_a_port_another_server_took_during_startup_fails_the_launch_naming_it(servers):
    executor, launch = servers
    port = free_port()
    launch("other-run", [sys.executable, "-c", SERVER_PY, str(port), "other-run"], port)
    loading = launch("baseline", ["sh", "-c", "echo loading weights; exec sleep 3600"], port)  # never binds
    with pytest.raises(PortTaken) as failure:  # a ServerFailed the regeneration servers retry on another port
        wait_healthy(executor, loading, timeout_s=30)
    message = str(failure.value)
    assert message.startswith(f"baseline: port {port} on local answers, but from another process than the server "
                              f"launched (pid {loading.pid})"), message
    assert "loading weights" in message  # the launched server's log tail


def test_the_launched_server_that_holds_its_port_is_healthy(servers):
    executor, launch = servers
    port = free_port()
    own = launch("baseline", [sys.executable, "-c", SERVER_PY, str(port), "baseline"], port)
    assert wait_healthy(executor, own, timeout_s=30) == {"served_by": "baseline"}
