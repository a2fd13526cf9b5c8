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
same forward (`_Followers`, `_follow`). That part needs CUDA (SGLang's TP groups initialise
pynccl) and is the only GPU-only glue here; tp 1 runs the same code on CPU
(`SGLANG_USE_CPU_ENGINE=1`), which is how the tests run it.

Risk: these are SGLang internals, not its public API; they are pinned to SGLang 0.5.23
(`SUPPORTED_SGLANG`) and checked at start, so another version fails loudly instead of
capturing something else.
"""

from __future__ import annotations

import multiprocessing
import os
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from eagle3.data.capture import aux_ids_to_hf_indices, default_aux_layer_ids

SUPPORTED_SGLANG = "0.5.23"
_STOP = None  # what rank 0 broadcasts to end the followers' loop


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
    """

    def __init__(self, settings: SGLangCaptureSettings) -> None:
        check_capture_ids(settings.aux_layer_ids)
        _prepare_sglang(settings.device)
        self.settings = settings
        self._followers = _Followers.start(settings) if settings.tp > 1 else None
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
        if self._followers is not None:
            self._followers.broadcast(rows)
        return _capture(self.runner, rows)

    def engine_record(self) -> dict:
        import sglang

        return {"name": "sglang", "version": sglang.__version__, "capture_indices": list(self.hf_indices),
                "tp": self.settings.tp, "launch_flags": self.settings.launch_flags()}

    def close(self) -> None:
        if self._followers is not None:
            self._followers.stop()
            self._followers = None

    def __enter__(self) -> SGLangFeatureExtractor:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# --------------------------------------------------------------------------- SGLang's runner


def _prepare_sglang(device: str) -> None:
    """SGLang's CPU engine switch must be set before sglang is imported; the version must be the pinned one."""
    if device == "cpu":
        os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
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


# --------------------------------------------------------------------------- tensor parallel (CUDA only)


class _Followers:
    """TP ranks 1..tp-1 in processes of their own, each running rank 0's batches (`_follow`)."""

    def __init__(self, processes: list) -> None:
        self.processes = processes

    @classmethod
    def start(cls, settings: SGLangCaptureSettings) -> _Followers:
        os.environ.setdefault("EAGLEOPS_CAPTURE_NCCL_PORT", str(_free_port()))
        context = multiprocessing.get_context("spawn")
        processes = [context.Process(target=_follow, args=(settings, rank), daemon=True)
                     for rank in range(1, settings.tp)]
        for process in processes:
            process.start()
        return cls(processes)

    def broadcast(self, rows: list[list[int]] | None) -> None:
        from sglang.srt.distributed import get_tp_group

        get_tp_group().broadcast_object(rows, src=0)

    def stop(self) -> None:
        self.broadcast(_STOP)
        for process in self.processes:
            process.join(timeout=60)
            if process.is_alive():
                process.kill()


def _follow(settings: SGLangCaptureSettings, rank: int) -> None:
    """A follower rank: the same runner, the same forwards as rank 0, until rank 0 says stop."""
    from sglang.srt.distributed import get_tp_group

    _prepare_sglang(settings.device)
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
