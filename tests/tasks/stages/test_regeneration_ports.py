"""The data stage's regeneration servers pick their own ports (tasks/stages/data/regeneration.py): one that another
process binds while the server still imports moves the server to the next free port instead of failing the stage.
A real `python -m eagle3.serve` of the tiny target on 127.0.0.1 and a real socket taking its port mid-start; the
same race on a port the user set (deploy.port, through `launch` alone) still fails, naming the port.
"""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from eagle3.config import TinyTargetConfig
from eagle3.data.tiny_target import build_tiny_target
from tasks.config.schema import ExperimentConfig
from tasks.hosts.remote import LocalExecutor
from tasks.hosts.remote.warm_start import SWITCH
from tasks.hosts.server_registry import read_servers
from tasks.hosts.servers import Placement, PortTaken, launch, stop
from tasks.runner.context import StageContext
from tasks.stages.data.regeneration import launch_on_a_free_port
from tests.helpers import free_port, reference_servers_alive

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def cold_starts(monkeypatch):
    """The race is on a cold start's seconds of imports before the bind (a warm start binds sooner)."""
    monkeypatch.setenv(SWITCH, "0")

TARGET = TinyTargetConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=7,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                          corpus_max_bytes=60_000, train_steps=10, batch_size=4, seq_len=64, eval_tokens=1024,
                          num_threads=1)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return build_tiny_target(TARGET, tmp_path_factory.mktemp("regen-ports-target"))


class PortThief(threading.Thread):
    """Binds and listens on `port` as soon as a server's pid file appears under `logs` (the server was launched
    on the free port and is still importing), and holds it until `release()`."""

    def __init__(self, logs: Path, port: int) -> None:
        super().__init__(daemon=True)
        self.logs, self.port, self.sock = logs, port, socket.socket()
        self.taken, self.released = threading.Event(), threading.Event()

    def run(self) -> None:
        deadline = time.monotonic() + 60
        while not list(self.logs.glob("*.pid")) and time.monotonic() < deadline:
            time.sleep(0.01)
        self.sock.bind(("127.0.0.1", self.port))
        self.sock.listen()
        self.taken.set()
        self.released.wait(300)
        self.sock.close()

    def release(self) -> None:
        self.released.set()
        self.join(10)


def setup(tmp_path: Path, target_dir: Path, port: int) -> tuple[ExperimentConfig, Placement, StageContext]:
    cfg = ExperimentConfig(experiment="regen-ports", deploy={"server": "reference", "port": port,
                                                             "startup_timeout_s": 180})
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    ctx = StageContext("generate_data", run_dir / "generate_data", run_dir, "", "")
    placement = Placement(LocalExecutor(), None, str(tmp_path / "servers"), str(target_dir), "")
    return cfg, placement, ctx


def test_a_port_taken_while_the_server_starts_moves_it_to_the_next_free_one(target_dir, tmp_path, caplog):
    port = free_port()
    cfg, placement, ctx = setup(tmp_path, target_dir, port)
    thief = PortThief(tmp_path / "servers" / "logs", port)
    thief.start()
    try:
        handle = launch_on_a_free_port(cfg, placement.executor, placement, ctx, port, 0)
        try:
            assert thief.taken.is_set() and handle.port != port
            assert httpx.get(f"{handle.local_url}/health_generate", timeout=30).status_code == 200
        finally:
            stop(ctx.run_dir, handle, placement.executor)
    finally:
        thief.release()
    assert f"regenerate 0: port {port} on local was taken while the server started" in caplog.text
    statuses = sorted((record["port"], record["status"]) for record in read_servers(ctx.run_dir).values())
    assert statuses == sorted([(port, "stopped"), (handle.port, "stopped")])  # the one that lost the race too
    assert reference_servers_alive(str(tmp_path)) == []


def test_the_same_race_on_the_deploy_port_fails_the_launch_naming_the_port(target_dir, tmp_path):
    port = free_port()
    cfg, placement, ctx = setup(tmp_path, target_dir, port)
    thief = PortThief(tmp_path / "servers" / "logs", port)
    thief.start()
    try:
        with pytest.raises(PortTaken) as failure:
            launch(cfg, placement, ctx.run_dir, label="baseline", spec=None, predicted=None)
    finally:
        thief.release()
    message = str(failure.value).lower()
    assert message.startswith("baseline: the server exited during startup") and "address already in use" in message
    assert f"{port}" in message
    assert reference_servers_alive(str(tmp_path)) == []
