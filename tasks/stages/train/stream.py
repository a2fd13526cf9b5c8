"""The capture side of `data.hidden_states: stream`, beside training: started on the data host before
training, watched while it runs, stopped after it (eagle3.training.streaming holds both sides).

In order, around train_draft's training (tasks.stages.train.stage locally, tasks.stages.train.nodes on the data host):
1. a capture side an earlier, killed orchestrator left running is stopped (`stream.json` in the stage
   folder records where it runs), and the shards earlier attempts of the stage left on the data host are
   deleted (the budget bounds the stream, not each attempt);
2. a new stream session in the training run's stream folder (`<out_dir>/stream`, beside the checkpoints,
   on the data host): training's order over the train split (DataPlan, world size, total steps), the
   shard size and the stall timeout, written before either side starts;
3. `python -m eagle3.training.streaming.producer` detached on the data host (tasks.hosts.jobs) with the
   target and the data stage's dataset there; while training runs, every poll relays its progress and
   log lines into the run log and raises when it failed;
4. after training: its `done` (it deletes what is left once every rank consumed everything); whatever
   happened, its process group is stopped.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from eagle3.training.streaming.layout import STREAM_DIR, plan_stream
from tasks.config.schema import ExperimentConfig
from tasks.hosts.jobs import HostJob, HostJobFailed, poll_delay
from tasks.hosts.remote import Executor
from tasks.log import logger
from tasks.runner.context import StageContext

RECORD = "stream.json"  # where the stage's capture side runs: stopped by the next attempt if still alive
FINISH_TIMEOUT_S = 600.0  # after training: time for the capture side to see the last progress and clean up


@dataclass(frozen=True)
class StreamPlace:
    """Where the capture side runs: the data host's executor and Python, and its paths there."""

    host: str  # "local" or a hosts[].name
    executor: Executor
    python: str
    train_out_dir: str  # training's output folder on the data host (node 0's): the stream folder is inside
    target_dir: str
    dataset_dir: str
    job_root: str  # the capture side's log, pid and config

    @property
    def stream_dir(self) -> str:
        return posixpath.join(self.train_out_dir, STREAM_DIR)


class CaptureSide:
    """The running capture side: `poll` relays and checks it, `finish` waits for its end, `stop` ends it."""

    def __init__(self, job: HostJob, host: str, log, progress) -> None:
        self.job, self.host, self.log, self.progress = job, host, log, progress

    def poll(self) -> bool:
        """Relay what it wrote; raise HostJobFailed if it ended without finishing. Whether it still runs."""
        alive = self.job.poll(self._on_event, lambda line: self.log.info(f"[capture {self.host}] {line}"))
        if not alive and "done" not in self.job.outcome:
            self.job.result()  # raises, with its error and log tail
        return alive

    def _on_event(self, event: dict) -> None:
        if event["event"] == "progress":
            self.progress("stream shards", event["done"], event["total"])
        elif event["event"] in ("log", "error"):
            self.log.info(f"[capture {self.host}] {event['message']}")

    def finish(self, timeout_s: float = FINISH_TIMEOUT_S) -> dict:
        """After training: the capture side's summary, once it has seen the last progress and deleted the rest."""
        started = time.monotonic()
        deadline = started + timeout_s
        while self.poll():
            if time.monotonic() > deadline:
                raise HostJobFailed(f"the stream's capture side on {self.host} did not finish within {timeout_s:.0f} s "
                                    "after training ended")
            time.sleep(poll_delay(started, 1.0))
        return self.job.result()["summary"]

    def stop(self) -> None:
        self.job.stop()


@contextlib.contextmanager
def capture_side(cfg: ExperimentConfig, ctx: StageContext, place: StreamPlace, world_size: int) -> Iterator[CaptureSide]:
    """Steps 1-3 of the module docstring; the capture side is stopped when the block exits."""
    _stop_leftover(ctx, place)
    _drop_other_attempts_shards(place)
    data = ctx.upstream["generate_data"]
    stream = plan_stream(cfg.train, data["num_samples"]["train"], world_size, cfg.data.shard_size)
    place.executor.makedirs(place.job_root)
    place.executor.run([place.python, "-m", "eagle3.training.streaming.layout", "start", place.stream_dir,
                        "--plan", json.dumps(stream.to_json()), "--stall-timeout-s", str(cfg.train.stall_timeout_s)],
                       log_output=False, timeout=120)
    job = HostJob(place.executor, "stream-capture", place.job_root)
    job.start([place.python, "-m", "eagle3.training.streaming.producer", "--target-dir", place.target_dir,
               "--dataset-dir", place.dataset_dir, "--stream-dir", place.stream_dir,
               "--config", _upload_config(cfg, ctx, place)])
    ctx.write_json(RECORD, {"host": place.host, "pid": job.pid, "stream_dir": place.stream_dir})
    logger().info(f"stream: capture side started on {place.host} (pid {job.pid}); {stream.num_shards} shards of "
                  f"{stream.shard_size} samples over {stream.total_steps} steps, at most "
                  f"{cfg.data.stream.disk_budget_gb} GB on disk in {place.stream_dir}")
    side = CaptureSide(job, place.host, logger(), ctx.progress("stream capture"))
    try:
        yield side
    finally:
        side.stop()


def _upload_config(cfg: ExperimentConfig, ctx: StageContext, place: StreamPlace) -> str:
    """The target and data sections as the capture side reads them."""
    target = cfg.target.model_copy(update={"kind": "hf", "model_path": place.target_dir})
    local = ctx.stage_dir / "stream_capture_config.json"
    local.write_text(json.dumps({"target": json.loads(target.model_dump_json()),
                                 "data": json.loads(cfg.data.model_dump_json(exclude={"regenerate": {"api_key"}}))},
                                indent=2))
    remote = posixpath.join(place.job_root, local.name)
    if str(Path(remote)) != str(local):
        place.executor.upload_file(local, remote)
    return remote


def _stop_leftover(ctx: StageContext, place: StreamPlace) -> None:
    """A capture side an earlier attempt recorded and never stopped (its orchestrator was killed)."""
    path = ctx.stage_dir / RECORD
    if not path.is_file():
        return
    record = json.loads(path.read_text())
    if record.get("host") == place.host and record.get("pid") and place.executor.is_alive(record["pid"]):
        logger().warning(f"stream: stopping the capture side (pid {record['pid']}) an earlier run left on {place.host}")
        place.executor.kill_group(record["pid"])


def _drop_other_attempts_shards(place: StreamPlace) -> None:
    """Streamed shards an earlier attempt of this stage left on the data host (it failed; its config changed
    since): the budget bounds the stream's disk, not each attempt's. Only shards go -- recapturable scratch;
    the attempts' checkpoints and logs stay."""
    parts = place.train_out_dir.split("/")
    attempts = [i for i, part in enumerate(parts) if part.startswith("attempt-")]
    if not attempts:
        return
    stage, this = "/".join(parts[: attempts[-1]]), "/".join(parts[: attempts[-1] + 1])
    found = place.executor.run(["find", stage, "-path", f"*/{STREAM_DIR}/shard-*.safetensors", "-not", "-path",
                                f"{this}/*", "-print", "-delete"], log_output=False, timeout=300).stdout.split()
    if found:
        logger().info(f"stream: deleted {len(found)} streamed shards earlier attempts left on {place.host} "
                      f"(under {stage})")


@contextlib.contextmanager
def relayed_in_background(side: CaptureSide, every_s: float = 2.0) -> Iterator[None]:
    """Poll the capture side on a thread while this one trains (a failure there also stops training's reads:
    eagle3.training.streaming.dataset raises when it waits for a shard that will not come)."""
    stop, errors = threading.Event(), []

    def relay() -> None:
        while not stop.wait(every_s):
            try:
                if not side.poll():
                    return
            except HostJobFailed as err:
                errors.append(err)
                return

    thread = threading.Thread(target=relay, name="stream-capture-relay", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    if errors:
        raise errors[0]
