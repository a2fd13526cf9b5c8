"""train_draft on torchrun nodes (`train.nodes`): this machine or inventory hosts over SSH, one node each.

Node i gets `devices` ranks; node 0 hosts the rendezvous store and global rank 0, so its disk
holds the checkpoints, history.jsonl and summary.json. In order:

1. each node's environment: its python imports torch and eagle3, and has the GPUs asked for;
2. inputs: the dataset and target are uploaded once per host under a folder named by their
   digest (reused by later attempts and runs; equal files are skipped), an init checkpoint and the
   train config per node;
3. resume: node 0's checkpoints are copied here, then to every node (ranks check they resumed
   from the same step); launchers left by an earlier, killed attempt are stopped first;
4. launch `python -m eagle3.torchrun --node-rank i ...` detached on each node (its own process
   group: torchrun, ranks, loader workers), node 0 first (see the rendezvous below), recorded in
   `<stage>/nodes.json`;
5. until every launcher exits: relay each node's log into the run log, rank 0's new history rows
   into MLflow, watch each launcher; the first failure stops every node and raises naming the
   node, its host, the failed rank and its log tail; so does a stall -- no node's log grew and no
   history row came for `train.stall_timeout_s` while launchers still run (a hung rank, a
   rendezvous nobody joins) -- naming the node silent longest;
6. node 0's output folder comes back to `<stage>/draft`, as if trained here.

Whatever ends the stage -- success, a failure, Ctrl-C -- no launcher is left running.

The rendezvous (`train.rendezvous`, else `_master`): node 0's inventory address; a `local` node 0
with remote nodes is this machine as those nodes reach it -- the client address their SSH server
sees (SSH_CONNECTION), never 127.0.0.1, where each remote node would dial itself. Its port: 29500, or the
next one free on node 0 when another training's store (or anything else) holds it there; node 0 starts
first, and the others only once it listens there (a second training starting on that host at the same
moment may take the port between the check and the bind: node 0 then moves to the next free one). One
node and no `train.rendezvous`: torchrun `--standalone`, whose store takes a port the OS hands out.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from eagle3.data.shards import MANIFEST
from eagle3.training.schedule import DataPlan, planned_steps
from eagle3.training.torchrun import NODE_STATUS
from eagle3.training.train import relay_history_rows
from tasks.config.schema import ExperimentConfig
from tasks.hosts.jobs import new_log_lines, poll_delay, watch_once
from tasks.hosts.remote import (
    CommandFailed,
    Executor,
    LocalExecutor,
    RemoteError,
    connect,
)
from tasks.log import logger
from tasks.runner.context import StageContext
from tasks.stages.train.stream import CaptureSide, StreamPlace, capture_side

DEFAULT_MASTER_PORT = 29500
MASTER_PORT_TRIES = 5  # ports node 0 tries when other processes take each one first
POLL_S = 2.0
NODES_FILE = "nodes.json"  # launchers of the current attempt, for stopping leftovers
MetricsFn = Callable[[int, dict[str, float]], None]
ProgressFn = Callable[[str, int, int], None]


class NodeFailed(RuntimeError):
    """A node's launcher failed or vanished; the message names node, host, rank and log tail."""


@dataclass
class Node:
    rank: int
    host: str  # "local" or a hosts[].name
    root: str  # this node's folder on its machine
    python: str
    inputs: str  # where uploaded datasets and targets are kept on that host, by digest
    executor: Executor
    pid: int | None = None
    log_offset: int = 0

    @property
    def out_dir(self) -> str:
        return posixpath.join(self.root, "draft")

    @property
    def log_file(self) -> str:
        return posixpath.join(self.root, "node.log")

    def label(self) -> str:
        return f"node {self.rank} ({self.host})"


def train_on_nodes(cfg: ExperimentConfig, ctx: StageContext, dataset_dir: Path, target_dir: Path,
                   aux_layer_ids: list[int], on_metrics: MetricsFn, progress: ProgressFn) -> dict[str, Any]:
    """Train on cfg.train.nodes; the summary train_draft returns, with paths on this machine.

    `progress(what, done, total)` gets rank 0's optimizer steps as its history rows arrive.
    """
    local_out = ctx.stage_dir / "draft"
    local_out.mkdir(parents=True, exist_ok=True)
    nodes = [_open_node(cfg, ctx, rank, name) for rank, name in enumerate(cfg.train.nodes)]
    try:
        _stop_leftovers(ctx, nodes)
        for node in nodes:
            _check_node(cfg, node)
        inputs = [_stage_inputs(cfg, ctx, node, dataset_dir, target_dir) for node in nodes]
        _sync_checkpoints(nodes, local_out)
        master = _master(cfg, nodes)

        def launch(node: Node, at: tuple[str, int] | None) -> None:
            data, target, config = inputs[node.rank]
            _launch(node, len(nodes), at, data, target, config, aux_layer_ids, cfg.data.draft_vocab_size)
            _record(ctx, nodes)

        with _stream_capture(cfg, ctx, nodes, inputs) as capture:  # data.hidden_states: stream, else None
            try:
                if master is None:
                    launch(nodes[0], None)  # one node: --standalone
                else:
                    master = _launch_node_0_on_its_port(nodes[0], master, launch, fixed=bool(cfg.train.rendezvous),
                                                        timeout_s=cfg.train.stall_timeout_s)
                    for node in nodes[1:]:
                        launch(node, master)
                _watch(nodes, on_metrics, progress, total_steps(cfg, dataset_dir), cfg.train.stall_timeout_s, capture)
            finally:
                _stop_all(nodes)
                _record(ctx, nodes)
            streamed = capture.finish() if capture is not None else None
        return _bring_back(nodes[0], local_out) | ({"stream": streamed} if streamed else {})
    finally:
        for node in nodes:
            node.executor.close()


# --------------------------------------------------------------------------- placement


def _open_node(cfg: ExperimentConfig, ctx: StageContext, rank: int, name: str) -> Node:
    executor = connect(name, cfg.hosts)
    if isinstance(executor, LocalExecutor):
        return Node(rank, name, str(ctx.stage_dir / f"node-{rank}"), executor.python, "", executor)
    host = cfg.host(name)
    run, train_root = ctx.run_dir, posixpath.join(executor.expand_path(host.workdir), "train")
    root = posixpath.join(train_root, run.parent.name, run.name, ctx.stage_dir.relative_to(run).as_posix(),
                          f"node-{rank}")
    return Node(rank, name, root, host.python, posixpath.join(train_root, "inputs"), executor)


def _master(cfg: ExperimentConfig, nodes: list[Node]) -> tuple[str, int] | None:
    """Where every node dials torchrun's store on node 0: train.rendezvous, else node 0's address as they reach it
    and a port found free there. None for one node and no train.rendezvous: it runs `--standalone`."""
    if cfg.train.rendezvous:
        address, port = cfg.train.rendezvous.rsplit(":", 1)
        return address, int(port)
    if len(nodes) == 1:
        return None
    port = _free_master_port(nodes[0], DEFAULT_MASTER_PORT)
    if nodes[0].host != "local":
        return cfg.host(nodes[0].host).address, port
    remote = [node for node in nodes if node.host != "local"]
    return (_this_machine_as_seen_by(cfg, remote) if remote else "127.0.0.1"), port


def _free_master_port(node: Node, start: int) -> int:
    """The first port from `start` free on node 0 (another training's store, or anything else, may hold 29500)."""
    port = node.executor.first_free_port(start)
    if port != start:
        logger().info("rendezvous: port %d is in use on %s; node 0 hosts torchrun's store on %d", start,
                      node.label(), port)
    return port


def _launch_node_0_on_its_port(node0: Node, master: tuple[str, int], launch: Callable[[Node, tuple[str, int]], None],
                               fixed: bool, timeout_s: float) -> tuple[str, int]:
    """Launch node 0 and wait until its torchrun listens on the rendezvous port, before any other node dials it.

    A port found free is not held: another training starting on that host at the same moment can bind it
    first, and nodes dialing it would join that training's store. Node 0 then fails at once (EADDRINUSE)
    and is launched again on the next free port, up to MASTER_PORT_TRIES times; a train.rendezvous port is
    the user's choice, and taken it fails the stage.
    """
    address, port = master
    for _ in range(MASTER_PORT_TRIES):
        launch(node0, (address, port))
        if _holds_its_port(node0, port, timeout_s):
            return address, port
        if fixed:
            raise NodeFailed(f"training failed on {node0.label()}: train.rendezvous {address}:{port} is taken on its "
                             "host by another process; free it or set train.rendezvous to a free port")
        node0.executor.kill_group(node0.pid)
        node0.pid = None
        logger().warning("rendezvous: another process took port %d on %s as node 0 started; trying the next free "
                         "port", port, node0.label())
        port = _free_master_port(node0, port + 1)
    raise NodeFailed(f"training failed on {node0.label()}: {MASTER_PORT_TRIES} rendezvous ports in a row were taken "
                     "on its host as node 0 started; set train.rendezvous to a free port")


def _holds_its_port(node0: Node, port: int, timeout_s: float) -> bool:
    """True once node 0's process group listens on `port`; False when node 0 ended because something else holds
    it; NodeFailed when it ended otherwise, or did not listen within `timeout_s` (train.stall_timeout_s)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        listener = node0.executor.port_listener(port, node0.pid)
        if listener == "group":
            return True
        alive, _ = _watch_node(node0)
        if not alive:
            if listener == "other" or "EADDRINUSE" in _log_tail(node0):
                return False
            status = _node_status(node0)
            if status is not None and status["returncode"] == 0:
                return True  # a one-node training that ended before a probe saw its store
            raise NodeFailed(_failure_message(node0, status))
        time.sleep(poll_delay(started, POLL_S))
    raise NodeFailed(f"training stalled: {node0.label()} did not listen on rendezvous port {port} within "
                     f"{timeout_s:.0f} s (train.stall_timeout_s); last lines of {node0.log_file}:\n{_log_tail(node0)}")


def _this_machine_as_seen_by(cfg: ExperimentConfig, remote: list[Node]) -> str:
    """This machine's address as the remote nodes see it connect (their SSH_CONNECTION's client address).

    Through a jump host they see the jump host, and nodes that see different addresses cannot share one
    rendezvous address: both ask for train.rendezvous.
    """
    seen: dict[str, str] = {}
    for node in remote:
        if cfg.host(node.host).jump_host:
            raise NodeFailed(f"train.rendezvous: {node.label()} is reached through jump host "
                             f"{cfg.host(node.host).jump_host}, so which address of this machine (node 0) it can dial "
                             "is unknown; set train.rendezvous to address:port of this machine that every node reaches")
        words = node.executor.run(["sh", "-c", 'printf %s "$SSH_CONNECTION"'], log_output=False, timeout=60).stdout.split()
        if len(words) != 4:
            raise NodeFailed(f"train.rendezvous: {node.label()} does not say where this machine connects from "
                             f"(SSH_CONNECTION={' '.join(words)!r}); set train.rendezvous to address:port of this machine")
        seen[node.label()] = words[0]
    if len(set(seen.values())) > 1:
        raise NodeFailed(f"train.rendezvous: the nodes see this machine (node 0) at different addresses ({seen}); "
                         "set train.rendezvous to address:port of this machine that every node reaches")
    address = next(iter(seen.values()))
    logger().info("rendezvous: node 0 is this machine; every node dials it at %s (as %s sees it; "
                  "train.rendezvous overrides)", address, ", ".join(seen))
    return address


_PROBE = ("import json, torch, eagle3.training.train; print(json.dumps({'torch': torch.__version__, "
          "'cuda_devices': torch.cuda.device_count() if torch.cuda.is_available() else 0}))")


def _check_node(cfg: ExperimentConfig, node: Node) -> None:
    """The node's python imports torch and eagle3 and has `devices` GPUs, or trains on CPU (gloo)."""
    try:
        result = node.executor.run([node.python, "-c", _PROBE], log_output=False, timeout=120)
    except CommandFailed as err:
        raise NodeFailed(f"{node.label()}: {node.python} cannot import torch and eagle3 (install eagleops "
                         f"there): {err}") from err
    facts = json.loads(result.stdout.strip().splitlines()[-1])
    gpus = facts["cuda_devices"]
    if gpus and gpus < cfg.train.devices:
        raise NodeFailed(f"{node.label()}: train.devices is {cfg.train.devices} but the host has {gpus} GPUs")
    if not gpus and cfg.train.precision == "bf16":
        raise NodeFailed(f"{node.label()}: train.precision bf16 needs a GPU; the host has none")
    logger().info("%s: torch %s, %s", node.label(), facts["torch"],
                  f"{gpus} GPUs (nccl)" if gpus else f"no GPU: {cfg.train.devices} CPU ranks (gloo)")


def _stage_inputs(cfg: ExperimentConfig, ctx: StageContext, node: Node, dataset_dir: Path,
                  target_dir: Path) -> tuple[str, str, str]:
    """(dataset, target, train config) paths on the node; uploads what a remote node lacks."""
    train_cfg = cfg.train.model_copy()
    node.executor.makedirs(node.root)
    made = ctx.upstream["generate_data"]["outputs"]
    if made.get("host") == node.host:  # the data stage ran on this node's host: its dataset is there
        data, target = made["host_dataset_dir"], made["host_target_dir"]
        logger().info("%s: training on the dataset the data stage wrote there (%s)", node.label(), data)
    elif made.get("host") not in (None, "local"):
        raise NodeFailed(f"{node.label()}: the dataset is on {made['host']} (data.host) and stays there; train on it "
                         f"with train.nodes: [{made['host']}]")
    elif isinstance(node.executor, LocalExecutor):
        data, target = str(dataset_dir), str(target_dir)
    else:
        shared = posixpath.join(node.inputs, ctx.upstream_digests["generate_data"][:16])
        data, target = posixpath.join(shared, "dataset"), posixpath.join(shared, "target")
        logger().info("%s: uploading the dataset and target to %s", node.label(), shared)
        node.executor.upload_dir(dataset_dir, data)
        node.executor.upload_dir(target_dir, target)
        if cfg.train.init_checkpoint:
            init = posixpath.join(node.root, "init")
            _upload_path(node.executor, Path(cfg.train.init_checkpoint), init)
            train_cfg.init_checkpoint = init
    config_local = ctx.stage_dir / f"train_config.node-{node.rank}.json"
    config_local.write_text(train_cfg.model_dump_json())
    config = posixpath.join(node.root, "train_config.json")
    node.executor.upload_file(config_local, config)
    return data, target, config


def _upload_path(executor: Executor, local: Path, remote: str) -> None:
    if local.is_dir():
        executor.upload_dir(local, remote)
    else:
        executor.makedirs(remote)
        executor.upload_file(local, posixpath.join(remote, local.name))


# --------------------------------------------------------------------------- resume


def _sync_checkpoints(nodes: list[Node], local_out: Path) -> None:
    """Node 0's latest checkpoint (the newest there is) here, then this copy to every node."""
    node0, local_ckpts = nodes[0], local_out / "checkpoints"
    _download_latest_checkpoint(node0, local_ckpts)
    if not (local_ckpts / "latest").is_file():
        return
    for node in nodes:
        latest = (local_ckpts / "latest").read_text().strip()
        logger().info("%s: resuming from node 0's checkpoint %s", node.label(), latest)
        node.executor.upload_dir(local_ckpts, posixpath.join(node.out_dir, "checkpoints"))


def _download_latest_checkpoint(node: Node, local_ckpts: Path) -> None:
    """The `latest` pointer and the checkpoint it names (older ones stay on the node)."""
    remote = posixpath.join(node.out_dir, "checkpoints")
    try:
        name = node.executor.read_file(posixpath.join(remote, "latest")).strip()
    except (FileNotFoundError, CommandFailed):
        return
    node.executor.download_dir(posixpath.join(remote, name), local_ckpts / name)
    node.executor.download_file(posixpath.join(remote, "latest"), local_ckpts / "latest")


# --------------------------------------------------------------------------- launch and watch


def _launch(node: Node, nnodes: int, master: tuple[str, int] | None, data: str, target: str, config: str,
            aux_layer_ids: list[int], draft_vocab_size: int) -> None:
    """Start the node's launcher detached; `master` None: one node, `--standalone`."""
    node.executor.run(["rm", "-f", posixpath.join(node.out_dir, NODE_STATUS), node.log_file], log_output=False,
                      timeout=60)
    node.executor.makedirs(node.out_dir)
    argv = [node.python, "-m", "eagle3.torchrun", "--data-dir", data, "--target-dir", target, "--out-dir", node.out_dir,
            "--config", config, "--aux-layer-ids", ",".join(map(str, aux_layer_ids)),
            "--draft-vocab-size", str(draft_vocab_size), "--node-rank", str(node.rank), "--nnodes", str(nnodes)]
    if master is not None:
        argv += ["--master-addr", master[0], "--master-port", str(master[1])]
    node.pid = node.executor.start_detached(argv, cwd=node.root, log_file=node.log_file,
                                            pid_file=posixpath.join(node.root, "node.pid"))
    node.log_offset = 0


def total_steps(cfg: ExperimentConfig, dataset_dir: Path) -> int:
    """Optimizer steps the ranks will take, as the trainer plans them (for progress and ETA), from the
    shards' manifest (here even when the shards stay on the data host): one dataset item per sample."""
    world = cfg.train.devices * len(cfg.train.nodes)
    manifest = json.loads((Path(dataset_dir) / "hidden_states" / MANIFEST).read_text())
    plan = DataPlan(manifest["num_samples"]["train"], cfg.train.batch_size, world, cfg.train.grad_accum,
                    cfg.train.seed)
    return planned_steps(plan, cfg.train.epochs, cfg.train.max_steps)


def _stream_capture(cfg: ExperimentConfig, ctx: StageContext, nodes: list[Node], inputs: list[tuple[str, str, str]]):
    """The stream's capture side on node 0's host (the data host), writing beside node 0's checkpoints."""
    if cfg.data.hidden_states != "stream":
        return contextlib.nullcontext(None)
    node0, (data, target, _) = nodes[0], inputs[0]
    place = StreamPlace(node0.host, node0.executor, node0.python, node0.out_dir, target, data, node0.root)
    return capture_side(cfg, ctx, place, world_size=cfg.train.devices * len(nodes))


def _watch(nodes: list[Node], on_metrics: MetricsFn, progress: ProgressFn, total: int, stall_timeout_s: float,
           capture: CaptureSide | None = None) -> None:
    """Relay logs and metrics until every launcher exited; raise NodeFailed at the first failure, or when
    nothing progressed (no node's log grew, no history row came) for `stall_timeout_s`. A stream's capture
    side is relayed too; its failure ends the watch (HostJobFailed)."""
    def relay(step: int, row: dict[str, float]) -> None:
        on_metrics(step, row)
        progress("optimizer steps", step, total)

    metrics = _MetricsRelay(nodes[0], relay)
    running = {node.rank for node in nodes}
    last_output = {node.rank: time.monotonic() for node in nodes}
    started = time.monotonic()
    while running:
        time.sleep(poll_delay(started, POLL_S))
        now = time.monotonic()
        ended = []
        for node in nodes:
            if node.rank in running:
                alive, grew = _watch_node(node)
                if not alive:
                    ended.append(node)
            else:
                grew = _relay_log(node)
            if grew:
                last_output[node.rank] = now
        if metrics.poll():
            last_output[nodes[0].rank] = now
        if capture is not None:
            capture.poll()
        _check_stalled(nodes, running, last_output, stall_timeout_s)
        for node in ended:
            status = _node_status(node)
            if status is None or status["returncode"] != 0:
                raise NodeFailed(_failure_message(node, status))
            logger().info("%s: finished", node.label())
            running.discard(node.rank)
    metrics.poll()


def _check_stalled(nodes: list[Node], running: set[int], last_output: dict[int, float], timeout_s: float) -> None:
    """NodeFailed when no node has written anything for `timeout_s`, naming the one silent longest.

    Only rank 0 logs steps, so one quiet node is normal; every node quiet is a hang somewhere (a stuck
    collective silences its peers too): the node that went quiet first is where to look.
    """
    now = time.monotonic()
    if now - max(last_output.values()) < timeout_s:
        return
    quiet = min((n for n in nodes if n.rank in running), key=lambda n: last_output[n.rank])
    silences = ", ".join(f"{n.label()} {now - last_output[n.rank]:.0f} s" for n in nodes if n.rank in running)
    raise NodeFailed(f"training stalled: no node logged anything and no metrics came for {timeout_s:.0f} s "
                     f"(train.stall_timeout_s) while the launchers still run; silent longest: {quiet.label()}, "
                     f"launcher pid {quiet.pid} (silent for: {silences}); last lines of {quiet.log_file}:\n"
                     f"{_log_tail(quiet)}")


def _watch_node(node: Node) -> tuple[bool, bool]:
    """Whether the node's launcher still runs, then its new log lines into the run log (read after that check, so
    an ended node's last lines are in): (alive, whether there were any)."""
    alive, lines, offset = watch_once(node.executor, node.pid, node.log_file, node.log_offset)
    return alive, _relay_lines(node, lines, offset)


def _relay_log(node: Node) -> bool:
    """New complete lines of the node's log into the run log; whether there were any."""
    return _relay_lines(node, *new_log_lines(node.executor, node.log_file, node.log_offset))


def _relay_lines(node: Node, lines: list[str], offset: int) -> bool:
    for line in lines:
        logger().info("[%s] %s", node.label(), line)
    grew, node.log_offset = offset != node.log_offset, offset
    return grew


def _node_status(node: Node) -> dict | None:
    try:
        return json.loads(node.executor.read_file(posixpath.join(node.out_dir, NODE_STATUS)))
    except (FileNotFoundError, ValueError):
        return None


def _failure_message(node: Node, status: dict | None) -> str:
    if status is None:
        tail = _log_tail(node)
        return (f"training failed on {node.label()}: its launcher (pid {node.pid}) ended without a status "
                f"(killed?); last lines of {node.log_file}:\n{tail}")
    return (f"training failed on {node.label()}: torchrun exited with {status['returncode']}: "
            f"{status['failures']}")


def _log_tail(node: Node) -> str:
    try:
        return node.executor.read_file(node.log_file, tail_lines=20)
    except (FileNotFoundError, CommandFailed):
        return "(no log)"


class _MetricsRelay:
    """Rank 0's new history.jsonl rows on node 0 to `on_metrics`, once each."""

    def __init__(self, node0: Node, on_metrics: MetricsFn):
        self.node0, self.on_metrics = node0, on_metrics
        self.path = posixpath.join(node0.out_dir, "history.jsonl")
        self.seen: set = set()

    def poll(self) -> bool:
        """Relay the rows not seen yet; whether there were any."""
        try:
            text = self.node0.executor.read_file(self.path)
        except (FileNotFoundError, CommandFailed):
            return False
        before = len(self.seen)
        self.seen = relay_history_rows(text, self.seen, self.on_metrics)
        return len(self.seen) != before


# --------------------------------------------------------------------------- stop, record, bring back


def _stop_all(nodes: list[Node]) -> None:
    """Every launcher's process group, whatever state it is in (kill_group is idempotent)."""
    for node in nodes:
        if node.pid is None:
            continue
        try:
            node.executor.kill_group(node.pid)
        except (RemoteError, OSError) as err:
            logger().warning("%s: could not stop process group %d: %s", node.label(), node.pid, err)
            continue
        node.pid = None


def _record(ctx: StageContext, nodes: list[Node]) -> None:
    ctx.write_json(NODES_FILE, [{"rank": n.rank, "host": n.host, "root": n.root, "pid": n.pid} for n in nodes])


def _stop_leftovers(ctx: StageContext, nodes: list[Node]) -> None:
    """Launchers an earlier attempt recorded and never stopped (its orchestrator was killed)."""
    path = ctx.stage_dir / NODES_FILE
    if not path.is_file():
        return
    by_host = {n.host: n for n in nodes}
    for entry in json.loads(path.read_text()):
        node = by_host.get(entry["host"])
        if entry.get("pid") is None or node is None:
            continue
        if node.executor.is_alive(entry["pid"]):
            logger().warning("node %s (%s): stopping launcher %d left by an earlier run", entry["rank"],
                             entry["host"], entry["pid"])
            node.executor.kill_group(entry["pid"])


OUTPUT_FILES = ("summary.json", "history.jsonl", "training_curves.png", "train_config.json")


def _bring_back(node0: Node, local_out: Path) -> dict[str, Any]:
    """Node 0's outputs into `local_out` -- the files above and the final checkpoint, not every
    rank's torchrun logs -- with summary paths rewritten to this machine's copies."""
    if node0.out_dir != str(local_out):
        _download_latest_checkpoint(node0, local_out / "checkpoints")
        for name in OUTPUT_FILES:
            _download_if_present(node0, name, local_out)
    summary = json.loads((local_out / "summary.json").read_text())
    return {k: _localize(v, node0.out_dir, local_out) for k, v in summary.items()}


def _download_if_present(node: Node, name: str, local_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):  # download_file's own answer for a missing file
        node.executor.download_file(posixpath.join(node.out_dir, name), local_dir / name)


def _localize(value: Any, remote_root: str, local_root: Path) -> Any:
    if isinstance(value, str) and (value == remote_root or value.startswith(remote_root + "/")):
        return str(local_root / posixpath.relpath(value, remote_root))
    return value

