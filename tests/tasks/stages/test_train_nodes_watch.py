"""tasks/stages/train/nodes.py without a training: the default rendezvous address (`_master`) and the stall
timeout of the watch loop (`_watch`), with real launcher processes on this machine and a real sshd.

A node's host name and the executor that reaches it are separate in `Node`, so a process here can play
a remote node; the one environment value faked is SSH_CONNECTION, the address a remote sshd would see.
"""

from __future__ import annotations

import logging
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from eagle3.config import TrainConfig
import tasks.stages.train.nodes as train_nodes
from tasks.config.load import load_experiment
from tasks.hosts.remote import LocalExecutor, connect
from tasks.stages.train.nodes import (
    DEFAULT_MASTER_PORT,
    Node,
    NodeFailed,
    _launch,
    _launch_node_0_on_its_port,
    _master,
    _watch,
)
from tests.helpers import TEST_TARGET_YAML
from tests.tasks.hosts.remote.helpers import live_processes

CONFIG = """\
experiment: nodes-unit
runs_root: {runs}
{target}data: {{draft_vocab_size: 64}}
train: {{nodes: {nodes}{rendezvous}}}
hosts:
  - {{name: gpu-2, address: gpu-2.example, user: ubuntu}}
  - {{name: gpu-3, address: 10.9.9.9, user: ubuntu, jump_host: gpu-2}}
{extra}"""


def config(tmp_path: Path, nodes: str, rendezvous: str = "", extra: str = ""):
    path = tmp_path / "nodes.yaml"
    path.write_text(CONFIG.format(runs=tmp_path / "runs", target=TEST_TARGET_YAML, nodes=nodes, extra=extra,
                                  rendezvous=f", rendezvous: {rendezvous!r}" if rendezvous else ""))
    return load_experiment(path)


def node(rank: int, host: str, executor, root: Path) -> Node:
    return Node(rank, host, str(root / f"node-{rank}"), sys.executable, "", executor)


def test_default_rendezvous_is_node_0_as_the_other_nodes_reach_it(tmp_path, monkeypatch):
    local = LocalExecutor()
    free = local.first_free_port(DEFAULT_MASTER_PORT)  # 29500 unless another test's training holds it
    cfg = config(tmp_path, "[local, gpu-2]")
    assert _master(config(tmp_path, "[local, local]"), [node(0, "local", local, tmp_path)] * 2) == \
        ("127.0.0.1", free)
    assert _master(config(tmp_path, "[gpu-2, local]"), [node(0, "gpu-2", local, tmp_path)] * 2) == \
        ("gpu-2.example", free)
    assert _master(config(tmp_path, "[local, gpu-2]", "10.0.0.5:29999"), [node(0, "local", local, tmp_path)] * 2) == \
        ("10.0.0.5", 29999)
    # one node: torchrun --standalone (its store binds a port the OS hands out), unless the user set one
    assert _master(config(tmp_path, "[gpu-2]"), [node(0, "gpu-2", local, tmp_path)]) is None
    assert _master(config(tmp_path, "[gpu-2]", "10.0.0.5:29999"), [node(0, "gpu-2", local, tmp_path)]) == \
        ("10.0.0.5", 29999)
    # node 0 here, node 1 remote: the address node 1's sshd sees this machine connect from, never 127.0.0.1
    monkeypatch.setenv("SSH_CONNECTION", "10.1.2.3 40122 10.1.2.4 22")
    nodes = [node(0, "local", local, tmp_path), node(1, "gpu-2", local, tmp_path)]
    assert _master(cfg, nodes) == ("10.1.2.3", free)
    monkeypatch.setenv("SSH_CONNECTION", "")
    with pytest.raises(NodeFailed, match="train.rendezvous: node 1 \\(gpu-2\\) does not say"):
        _master(cfg, nodes)
    with pytest.raises(NodeFailed, match="train.rendezvous: node 1 \\(gpu-3\\) is reached through jump host gpu-2"):
        _master(config(tmp_path, "[local, gpu-3]"), [node(0, "local", local, tmp_path), node(1, "gpu-3", local, tmp_path)])


def test_default_rendezvous_over_a_real_sshd_is_this_end_of_the_connection(tmp_path, sshd):
    host = sshd.host_config()
    extra = (f"  - {{name: testhost, address: 127.0.0.1, port: {host.port}, user: {host.user}, key_file: {host.key_file},"
             f" known_hosts: {host.known_hosts}}}\n")
    cfg = config(tmp_path, "[local, testhost]", extra=extra)
    with connect(host) as ssh:
        this_end = ssh._client.get_transport().sock.getsockname()[0]  # the socket's own local address
        assert _master(cfg, [node(0, "local", LocalExecutor(), tmp_path), node(1, "testhost", ssh, tmp_path)]) == \
            (this_end, ssh.first_free_port(DEFAULT_MASTER_PORT))


def test_the_default_rendezvous_port_moves_past_one_that_node_0_holds(tmp_path, monkeypatch):
    """A second training on one host (a nightly beside a hand run) must not dial the first one's store."""
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        port = held.getsockname()[1]
        monkeypatch.setattr(train_nodes, "DEFAULT_MASTER_PORT", port)
        address, chosen = _master(config(tmp_path, "[local, local]"), [node(0, "local", LocalExecutor(), tmp_path)] * 2)
        assert address == "127.0.0.1" and chosen > port
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", chosen))  # free indeed


def _node_0_launcher(tmp_path: Path, local: LocalExecutor):
    """Node 0 of a two-node run and what launches it: the real launcher (eagle3.torchrun, then torchrun), whose
    store binds the rendezvous port and then waits for node 1, which never comes."""
    config = tmp_path / "train_config.json"
    config.write_text(TrainConfig(devices=1).model_dump_json())
    node0 = node(0, "local", local, tmp_path)

    def launch(each: Node, master: tuple[str, int]) -> None:
        _launch(each, 2, master, str(tmp_path / "data"), str(tmp_path / "target"), str(config), [1], 64)

    return node0, launch


@pytest.fixture
def held_port():
    """A port another process's server holds, as the store of another training that took it first."""
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        held.bind(("0.0.0.0", 0))
        held.listen()
        yield held.getsockname()[1]


def test_node_0_that_loses_its_port_to_another_training_relaunches_on_the_next_free_one(tmp_path, held_port, caplog):
    """The race first_free_port leaves: the port was free when node 0's host was asked and another training's
    store bound it before node 0's torchrun did. Node 0 fails (EADDRINUSE); it must start again on a port it
    then holds, before any other node is told where to dial."""
    caplog.set_level(logging.INFO)
    local = LocalExecutor()
    node0, launch = _node_0_launcher(tmp_path, local)
    try:
        address, port = _launch_node_0_on_its_port(node0, ("127.0.0.1", held_port), launch, fixed=False,
                                                   timeout_s=120)
        assert address == "127.0.0.1" and port > held_port
        assert local.port_listener(port, node0.pid) == "group"  # node 0's own torchrun store serves it
        assert "EADDRINUSE" in caplog.text  # the first launch's torchrun said why it failed
        assert f"another process took port {held_port}" in caplog.text
    finally:
        if node0.pid is not None:
            local.kill_group(node0.pid)
    assert live_processes(node0.out_dir) == []


def test_a_taken_train_rendezvous_port_fails_the_stage_naming_the_field(tmp_path, held_port):
    local = LocalExecutor()
    node0, launch = _node_0_launcher(tmp_path, local)
    try:
        with pytest.raises(NodeFailed, match=f"train.rendezvous 127.0.0.1:{held_port} is taken on its host by another"):
            _launch_node_0_on_its_port(node0, ("127.0.0.1", held_port), launch, fixed=True, timeout_s=120)
    finally:
        if node0.pid is not None:
            local.kill_group(node0.pid)


def test_a_launcher_that_hangs_without_exiting_fails_the_stage_naming_the_node(tmp_path, monkeypatch):
    """Node 0 logs steps for ~2 s then blocks (as at a collective); node 1 never logs (hung at start). With
    train.stall_timeout_s 1: no failure while node 0 writes, then one naming node 1, silent longest."""
    monkeypatch.setattr(train_nodes, "POLL_S", 0.2)
    local = LocalExecutor()
    nodes = [node(0, "local", local, tmp_path), node(1, "gpu-2", local, tmp_path)]
    scripts = ["for i in 1 2 3 4 5; do echo step $i; sleep 0.4; done; exec sleep 3511", "exec sleep 3512"]
    for each, script in zip(nodes, scripts):
        os.makedirs(each.root)
        each.pid = local.start_detached(["sh", "-c", script], log_file=each.log_file,
                                        pid_file=os.path.join(each.root, "node.pid"))
    started = time.monotonic()
    try:
        with pytest.raises(NodeFailed) as failure:
            _watch(nodes, lambda step, row: None, lambda what, done, total: None, 10, stall_timeout_s=1.0)
        took = time.monotonic() - started
    finally:
        for each in nodes:
            local.kill_group(each.pid)
    message = str(failure.value)
    assert message.startswith("training stalled: no node logged anything and no metrics came for 1 s "
                              "(train.stall_timeout_s)"), message
    assert f"silent longest: node 1 (gpu-2), launcher pid {nodes[1].pid}" in message
    assert 2.0 < took < 8, took  # node 0's lines kept it alive; then about a second of silence
    assert live_processes("sleep 351") == []
