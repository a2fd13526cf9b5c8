"""The target's hidden states from SGLang itself (`target.engine: sglang`), in this process.

SGLang 0.5.23 serves a capture-only mode (`--enable-return-aux-hidden-states
--speculative-algorithm EAGLE3`, no draft; reference sglang-eagle3.md §2.6): the target's model
runner records the aux states at the layers `set_eagle3_layers_to_capture` picks -- SGLang's
own per-model rule, the one it applies when it serves the draft -- and keeps the final
(post-norm) hidden state the teacher needs. Over HTTP that mode returns only the aux states,
through `.tolist()` and JSON (~290 tokens/s per core at Kimi's width, §2.7). Here the same
runner runs in-process, built as SGLang's own `bench_one_batch` builds it
(`sglang.benchmark.one_batch.load_model`: model, KV pools, attention backend), and each batch
is one EXTEND forward with `CaptureHiddenMode.FULL`; the tensors go straight into shards.

Exactness, as the field learned it (SpecForge c7fc438e): no prefix-cache hit may shorten a
capture (our requests never match a prefix: a tree cache that shares nothing, radix cache off),
no chunked prefill (one forward per batch, sized to the KV pool), and each request's extend
length and the output's row count are checked against the token rows. The capture indices
SGLang actually hooked are compared with eagleops' copy of the rule (`eagle3.data.capture`)
and recorded in the shard manifest with SGLang's version.

Tensor parallelism (tp > 1): one process per rank, as bench_one_batch spawns them; rank 0
drives the dump and broadcasts each batch's rows over SGLang's TP group so every rank runs the
same forward (`_Followers`, `_follow`). A rank that dies must not leave the others waiting in a
collective: rank 0 checks its followers around each load, batch and stop, and a dead one fails the
capture in one line naming its rank and exit, the other followers killed and reaped; where rank 0
cannot leave the wait (a rendezvous, an NCCL collective), a watch thread ends rank 0's process with
that line after `stuck_grace_s`. Rank 0's own error kills the followers; rank 0's death ends them
(PR_SET_PDEATHSIG, SGLang's `kill_itself_when_parent_died`).

The same path runs on CPU, SGLang's own CPU tensor parallelism (its Xeon path), which is how the
tests run tp 2 (tests/eagle3/data/test_sglang_engine_tp.py): `SGLANG_USE_CPU_ENGINE=1`, `--device
cpu` (gloo groups: `srt/platforms/cpu.py`, `get_torch_distributed_backend_str`), the ranks' cores in
SGLang's `SGLANG_CPU_OMP_THREADS_BIND` (e.g. "0|1"; `srt/utils/numa_utils.py`, `init_threads_binding`),
the all-reduce gloo's, or sgl-kernel's shared-memory one where its CPU build and AMX are there
(`parallel_state.py`, `GroupCoordinator.all_reduce`). A CPU host has no NCCL library, and SGLang's
pynccl then disables itself; a CUDA build of torch brings one, so on `--device cpu` this module sets
SGLang's `SGLANG_NCCL_SO_PATH` to none (`_NO_NCCL_ON_CPU`).

Risk: these are SGLang internals, not its public API; they are pinned to SGLang 0.5.23
(`SUPPORTED_SGLANG`) and checked at start, so another version fails loudly instead of
capturing something else. The followers' failure handling is rehearsed on CPU only (gloo: a dead
peer's closed socket fails the collective; the rendezvous is the wait that needs the watch thread);
an NCCL collective on a dead peer is left to the same watch thread, not seen on a GPU here.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
from array import array
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3.data.capture import aux_ids_to_hf_indices, default_aux_layer_ids

SUPPORTED_SGLANG = "0.5.23"
_STOP = None  # what rank 0 broadcasts to end the followers' loop
_STUCK_GRACE_S = 30.0  # a follower dead this long while rank 0 waits in a collective: rank 0's process ends
_DEATH_SHOWS_S = 2.0  # after a failed collective, how long a dying follower's exit may take to show
_WATCH_TICK_S = 0.5
_ENDED = "the capture stopped and the other ranks were ended"
# SGLang's CPU TP expects no NCCL library on the machine (Xeon hosts, CPU torch): PyNcclCommunicator then
# disables itself ("missing NCCL library, e.g. in a non-GPU environment", srt/distributed/device_communicators/
# pynccl.py). A CUDA build of torch brings libnccl.so.2, which SGLang would bind to the CPU device and fail
# ("Expected a cuda device, but got: cpu"); on `--device cpu` SGLang's own SGLANG_NCCL_SO_PATH names no library.
_NO_NCCL_ON_CPU = "eagleops: --device cpu runs no NCCL"


@dataclass(frozen=True)
class SGLangCaptureSettings:
    """How SGLang's runner is started for capture (the launch flags it is given, in effect)."""

    model_path: str
    aux_layer_ids: list[int] | None = None
    tp: int = 1
    dtype: str = "auto"
    device: str = "cuda"
    max_batch_tokens: int = 16384
    mem_fraction_static: float | None = None
    trust_remote_code: bool = False
    extra_args: list[str] = field(default_factory=list)

    def launch_flags(self) -> list[str]:
        """SGLang launch flags of the capture-only mode, as `python -m sglang.launch_server` takes them."""
        flags = ["--model-path", self.model_path, "--device", self.device, "--tp-size", str(self.tp),
                 "--dtype", _sglang_dtype(self.dtype, self.device),
                 "--enable-return-aux-hidden-states", "--speculative-algorithm", "EAGLE3",
                 "--disable-radix-cache", "--disable-cuda-graph",
                 "--max-total-tokens", str(self.max_batch_tokens)]
        if self.aux_layer_ids is not None:
            flags += ["--return-aux-hidden-state-layer-ids", *map(str, self.aux_layer_ids)]
        if self.mem_fraction_static is not None:
            flags += ["--mem-fraction-static", str(self.mem_fraction_static)]
        if self.trust_remote_code:
            flags.append("--trust-remote-code")
        if self.device == "cpu":
            flags.append("--disable-custom-all-reduce")  # a CUDA IPC all-reduce; SGLang warns when it cannot set it up
        return flags + list(self.extra_args)


def _sglang_dtype(dtype: str, device: str) -> str:
    """`auto` is bfloat16 on CUDA and float32 on CPU, as eagleops' HF engine resolves it."""
    if dtype == "auto":
        return "bfloat16" if device.startswith("cuda") else "float32"
    return dtype


def check_capture_ids(aux_layer_ids: list[int] | None) -> None:
    """SGLang's capture-only mode takes non-negative, distinct ids (validation_hook.py); refuse others here."""
    if aux_layer_ids is None:
        return
    if any(i < 0 for i in aux_layer_ids):
        raise ValueError(f"target.aux_layer_ids {aux_layer_ids}: SGLang's capture mode takes ids >= 0, so id -1 "
                         "(the embeddings) cannot be captured with target.engine sglang")
    if len(set(aux_layer_ids)) != len(aux_layer_ids):
        raise ValueError(f"target.aux_layer_ids {aux_layer_ids}: repeated ids (SGLang captures each layer once)")


class SGLangFeatureExtractor:
    """SGLang's model runner as a capture engine: token rows -> (aux, last) packed, on its device.

    Attributes as `eagle3.data.capture.TargetFeatureExtractor`: `architecture`,
    `num_hidden_layers`, `hidden_size`, `aux_layer_ids` (resolved SGLang ids), `hf_indices`
    (the capture indices SGLang hooked), `device`. Call `close()` when done (stops TP followers).
    `stuck_grace_s`: at tp > 1, how long rank 0 may wait in a collective after a follower died
    before its process ends (`_Followers`).
    """

    def __init__(self, settings: SGLangCaptureSettings, stuck_grace_s: float = _STUCK_GRACE_S) -> None:
        check_capture_ids(settings.aux_layer_ids)
        _prepare_sglang(settings.device)
        self.settings = settings
        self._followers = _Followers.start(settings, stuck_grace_s) if settings.tp > 1 else None
        with self._with_followers():
            self.runner = _load_runner(settings, tp_rank=0)
            self._describe()

    def _describe(self) -> None:
        config = self.runner.model_config.hf_config
        text = getattr(config, "text_config", None) or config
        self.architecture = config.architectures[0]
        self.num_hidden_layers = text.num_hidden_layers
        self.hidden_size = text.hidden_size
        self.aux_layer_ids = (list(self.settings.aux_layer_ids) if self.settings.aux_layer_ids is not None
                              else default_aux_layer_ids(self.architecture, self.num_hidden_layers))
        self.hf_indices = sorted(_layers_to_capture(self.runner.model))
        expected = aux_ids_to_hf_indices(self.architecture, self.settings.aux_layer_ids, self.num_hidden_layers)
        if self.hf_indices != expected:
            raise ValueError(f"SGLang hooked capture indices {self.hf_indices} for aux ids {self.aux_layer_ids} of "
                             f"{self.architecture}, eagleops' rule says {expected}: the draft would be trained on "
                             "other layers than SGLang feeds it")

    @property
    def device(self) -> torch.device:
        return torch.device(self.runner.device)

    def capture_rows(self, rows: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Token rows -> aux [n, k*H] and last [n, H], the rows' tokens back to back (n = sum of lengths)."""
        rows = [list(r) for r in rows]
        total = sum(len(r) for r in rows)
        if total > self.settings.max_batch_tokens:
            raise ValueError(f"a capture batch of {total} tokens does not fit the runner's KV pool "
                             f"({self.settings.max_batch_tokens} tokens): lower data.capture_batch_size or raise "
                             "data.capture.max_batch_tokens")
        with self._with_followers():
            if self._followers is not None:
                self._followers.broadcast(rows)
            return _capture(self.runner, rows)

    @property
    def follower_pids(self) -> list[int]:
        """The process ids of TP ranks 1..tp-1 (none at tp 1)."""
        return [p.pid for p in self._followers.processes] if self._followers is not None else []

    def _with_followers(self) -> contextlib.AbstractContextManager:
        return self._followers.guard() if self._followers is not None else contextlib.nullcontext()

    def engine_record(self) -> dict:
        import sglang

        return {"name": "sglang", "version": sglang.__version__, "capture_indices": list(self.hf_indices),
                "tp": self.settings.tp, "launch_flags": self.settings.launch_flags()}

    def close(self) -> None:
        """Stop the TP followers and reap them (nothing to do at tp 1, or once they were ended)."""
        if self._followers is not None and not self._followers.stopped:
            self._followers.stop()

    def __enter__(self) -> SGLangFeatureExtractor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- SGLang's runner


def _prepare_sglang(device: str) -> None:
    """SGLang's CPU switches must be set before sglang is imported; the version must be the pinned one."""
    if device == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        os.environ.setdefault("SGLANG_NCCL_SO_PATH", _NO_NCCL_ON_CPU)
    import sglang

    if sglang.__version__ != SUPPORTED_SGLANG:
        raise RuntimeError(f"target.engine sglang: eagleops' in-process capture is written against SGLang "
                           f"{SUPPORTED_SGLANG}'s model runner; this host has SGLang {sglang.__version__}")


def _load_runner(settings: SGLangCaptureSettings, tp_rank: int):
    """SGLang's ModelRunner for one TP rank, set up as `sglang.benchmark.one_batch.load_model` does."""
    from sglang.benchmark import one_batch
    from sglang.srt.runtime_context import SpawnRanks, publish, spawn_world_rank
    from sglang.srt.server_args import PortArgs, prepare_server_args

    server_args = prepare_server_args(settings.launch_flags())
    server_args.resolve_once()
    one_batch._set_envs_and_config(server_args)
    port_args = _port_args(server_args, PortArgs)
    publish(server_args, role="scheduler",
            ranks=SpawnRanks(world_rank=spawn_world_rank(server_args, tp_rank=tp_rank, pp_rank=0), gpu_id=tp_rank))
    one_batch._init_process_global_configs()
    bench_runner, _ = one_batch.load_model(server_args, port_args, tp_rank, tp_rank)
    return bench_runner.torch_runner


def _port_args(server_args, port_args_cls):
    """One NCCL port for every rank: rank 0 picks it and passes it on (EAGLEOPS_CAPTURE_NCCL_PORT)."""
    port_args = port_args_cls.init_new(server_args)
    shared = os.environ.get("EAGLEOPS_CAPTURE_NCCL_PORT")
    if shared:
        port_args.nccl_port = int(shared)
    return port_args


def _layers_to_capture(model: torch.nn.Module) -> list[int]:
    """The capture indices `set_eagle3_layers_to_capture` set on the (text) model inside `model`."""
    for module in model.modules():
        layers = getattr(module, "layers_to_capture", None)
        if layers is not None:
            return list(layers)
    raise ValueError(f"{type(model).__name__}: SGLang set no layers_to_capture; is aux capture enabled?")


@torch.no_grad()
def _capture(runner, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """One EXTEND forward of `rows` with full hidden-state capture; the KV pools are freed after it."""
    from sglang.benchmark.one_batch import TreeCacheNamespace
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch
    from sglang.srt.runtime_context import get_schedule
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    reqs = [_extend_request(i, row) for i, row in enumerate(rows)]
    # a tree cache that shares no prefix: every request prefills all of its tokens
    tree = TreeCacheNamespace(page_size=get_schedule().page_size, device=runner.device,
                              token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator)
    batch = ScheduleBatch.init_new(reqs=reqs, req_to_token_pool=runner.req_to_token_pool,
                                   token_to_kv_pool_allocator=runner.token_to_kv_pool_allocator, tree_cache=tree,
                                   model_config=runner.model_config, enable_overlap=False,
                                   spec_algorithm=SpeculativeAlgorithm.NONE)
    try:
        batch.prepare_for_extend()
        _check_extend_lengths(batch, rows)
        if batch.input_ids is None and getattr(batch, "prefill_input_ids_cpu", None) is not None:
            batch.input_ids = batch.prefill_input_ids_cpu.to(batch.device, non_blocking=True)
            batch.prefill_input_ids_cpu = None
        forward = ForwardBatch.init_new(batch, runner, capture_hidden_mode=CaptureHiddenMode.FULL,
                                        return_hidden_states_before_norm=False)
        out = runner.forward(forward).logits_output
    finally:
        runner.req_to_token_pool.clear()
        runner.token_to_kv_pool_allocator.clear()
    return _checked_states(out, rows)


def _extend_request(index: int, row: list[int]):
    """A request that prefills `row` whole (no logprobs, no prefix)."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(rid=f"capture-{index}", origin_input_text="", origin_input_ids=array("q", row),
              sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
    req.full_untruncated_fill_ids = req.origin_input_ids
    req.logprob_start_len = -1
    req.extend_end = len(row)
    return req


def _check_extend_lengths(batch, rows: list[list[int]]) -> None:
    """Every request prefills exactly its row from position 0: a prefix or a shorter extend means a
    prefix-cache hit or a truncation, which would shorten its capture."""
    lengths = list(zip(batch.prefix_lens, batch.extend_lens, strict=True))
    for k, ((prefix, extend), row) in enumerate(zip(lengths, rows, strict=True)):
        if prefix != 0 or extend != len(row):
            raise RuntimeError(f"SGLang prefills tokens {prefix}..{prefix + extend} of a {len(row)}-token sample "
                               f"(request capture-{k}): a prefix-cache hit or truncation would shorten its capture")


def _checked_states(out, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux, last) of a FULL-capture forward, checked to hold one row per token of `rows`."""
    aux, last = out.hidden_states, out.last_hidden_states
    total = sum(len(r) for r in rows)
    if aux is None or last is None:
        raise RuntimeError("SGLang returned no hidden states: the runner is not in capture-only mode "
                           "(--enable-return-aux-hidden-states)")
    if aux.shape[0] != total or last.shape[0] != total:
        raise RuntimeError(f"SGLang returned {aux.shape[0]} aux and {last.shape[0]} final rows for {total} tokens")
    return aux, last


# --------------------------------------------------------------------------- tensor parallel


class _Followers:
    """TP ranks 1..tp-1 in processes of their own, each running rank 0's batches (`_follow`), watched.

    Rank 0 works with them only inside `guard()`: a follower found dead there (before the work, or
    after it failed, e.g. a gloo collective whose peer's socket closed) ends the others and raises one
    line naming its rank and exit; rank 0's own error ends them too. A collective that cannot fail
    (NCCL waits on a dead peer forever) is the watch thread's: when a follower has died and rank 0 is
    still inside `guard()` `stuck_grace_s` later, it writes the same line to stderr and ends this
    process -- the only way out of such a wait. The followers end themselves when rank 0's process dies
    (SGLang's `kill_itself_when_parent_died`, PR_SET_PDEATHSIG).
    """

    def __init__(self, processes: list, stuck_grace_s: float) -> None:
        self.processes = processes  # rank k at index k-1
        self.stuck_grace_s = stuck_grace_s
        self.failure: str | None = None  # why they were ended early; no batch runs after it
        self._busy = False  # rank 0 is inside guard()
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="eagleops-tp-watch", daemon=True).start()

    @classmethod
    def start(cls, settings: SGLangCaptureSettings, stuck_grace_s: float) -> _Followers:
        os.environ.setdefault("EAGLEOPS_CAPTURE_NCCL_PORT", str(_free_port()))
        context = multiprocessing.get_context("spawn")
        processes = [context.Process(target=_follow, args=(settings, rank), daemon=True, name=f"sglang-tp{rank}")
                     for rank in range(1, settings.tp)]
        for process in processes:
            process.start()
        return cls(processes, stuck_grace_s)

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Rank 0's work with the followers (its load, a batch, the stop): a dead follower fails it in one line."""
        if self.failure is not None or self._stopped.is_set():
            raise RuntimeError(f"SGLang capture: the TP followers were ended ({self.failure or 'closed'}); "
                               "open a new engine")
        if death := self.death(wait=0):
            self.kill(death)
            raise RuntimeError(f"{death}; {_ENDED}")
        self._busy = True
        try:
            yield
        except BaseException as err:
            # a collective that failed because a follower died: its exit shows a moment after its socket closed
            death = self.death(wait=_DEATH_SHOWS_S)
            self.kill(death or f"rank 0 failed: {type(err).__name__}: {err}".splitlines()[0])
            if death:
                raise RuntimeError(f"{death}; {_ENDED}") from err
            raise
        finally:
            self._busy = False

    def broadcast(self, rows: list[list[int]] | None) -> None:
        from sglang.srt.distributed import get_tp_group

        get_tp_group().broadcast_object(rows, src=0)

    def death(self, wait: float) -> str | None:
        """The first follower that has exited, in words (waiting up to `wait` s for one to), else None."""
        multiprocessing.connection.wait([p.sentinel for p in self.processes], timeout=wait)
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode is not None:
                return f"{_rank_words(rank, process)} {_exit_words(process.exitcode)}"
        return None

    def kill(self, reason: str) -> None:
        """End every follower now and reap it (one of them died, or rank 0 failed)."""
        self.failure = reason
        self._stopped.set()
        for process in self.processes:
            if process.is_alive():
                process.kill()
        for process in self.processes:
            process.join(timeout=30)

    def stop(self) -> None:
        """Rank 0's stop: every follower leaves its loop and exits (killed if still running 60 s later)."""
        with self.guard():
            self._stopped.set()  # the followers' exits from here on are the expected ones
            self.broadcast(_STOP)
        for process in self.processes:
            process.join(timeout=60)
        if any(process.is_alive() for process in self.processes):
            self.kill("a follower did not stop within 60 s")
        for rank, process in enumerate(self.processes, start=1):
            if process.exitcode != 0:
                raise RuntimeError(f"{_rank_words(rank, process)} {_exit_words(process.exitcode)} while stopping")

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def _watch(self) -> None:
        """Ends this process when a follower died while rank 0 waits, past the grace, in a collective."""
        multiprocessing.connection.wait([p.sentinel for p in self.processes])
        stuck = 0.0
        while not self._stopped.wait(_WATCH_TICK_S):
            stuck = stuck + _WATCH_TICK_S if self._busy else 0.0
            if stuck >= self.stuck_grace_s:
                death = self.death(wait=0) or "SGLang capture: a TP follower exited"
                for process in self.processes:
                    if process.is_alive():
                        process.kill()
                print(f"{death}; rank 0 still waited on it {self.stuck_grace_s:g} s later (a "
                      "rendezvous or collective a dead rank never joins), so this process ends",
                      file=sys.stderr, flush=True)
                os._exit(1)


def _rank_words(rank: int, process) -> str:
    return f"SGLang capture: TP rank {rank} (pid {process.pid})"


def _exit_words(exitcode: int) -> str:
    """multiprocessing's exit code in words: -9 -> 'was killed by SIGKILL', 1 -> 'exited with code 1'."""
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    if exitcode == 0:
        return "exited before rank 0 stopped it"
    return f"exited with code {exitcode} (its traceback is above)"


def _follow(settings: SGLangCaptureSettings, rank: int) -> None:
    """A follower rank: the same runner, the same forwards as rank 0, until rank 0 says stop."""
    _prepare_sglang(settings.device)
    from sglang.srt.distributed import get_tp_group
    from sglang.srt.utils import kill_itself_when_parent_died

    kill_itself_when_parent_died()  # rank 0's process gone (even SIGKILL): this rank goes too
    runner = _load_runner(settings, tp_rank=rank)
    while (rows := get_tp_group().broadcast_object(None, src=0)) is not _STOP:
        _capture(runner, rows)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def settings_for(target_dir: Path | str, aux_layer_ids: list[int] | None, *, tp: int, dtype: str,
                 max_batch_tokens: int, trust_remote_code: bool, extra_args: Sequence[str] = (),
                 mem_fraction_static: float | None = None) -> SGLangCaptureSettings:
    """Capture settings for a target directory on this machine (the device: CUDA when there is one)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return SGLangCaptureSettings(str(target_dir), aux_layer_ids, tp, dtype, device, max_batch_tokens,
                                 mem_fraction_static, trust_remote_code, list(extra_args))
