"""Whole optimizer steps (teacher, forward, backward, clip, AdamW) replayed as CUDA graphs, one graph
per input shape.

Why: an 8B-shaped draft's step keeps an H200 busy ~60 ms, and the host needs 56-62 ms to launch it
(~1,250 kernels, compiled-region wrappers, guard checks, custom autograd functions): on a slower host
the GPU waits between kernels. A replayed graph launches them all with no Python in between.

How (torch.cuda.graphs' whole-network capture): the first `warmup` steps of a shape run eagerly on
a side stream (compilation, cuDNN plans and AdamW's state happen there, and they are real steps of
the run); the next one is captured on that stream with its inputs in static buffers and then
replayed; later steps of that shape copy their batch into the buffers and replay. The step must
leave gradients as None (as the eager step does), so backward allocates them inside the graph's
memory, which all graphs of one `StepGraphs` share (they replay one at a time, in one stream).
Capture does not run the step: `__call__` replays right after capturing.

Risk: a graph replays exactly what the host launched during its capture. A value the host computes
then (a Python float, a shape, a branch) is frozen: AdamW's learning rate (with its other
hyperparameters) is therefore a device tensor that `before_replay` refreshes
(`eagle3.training.adamw.load_hyperparameters`), and the step counters are device tensors already.
Nothing in the step may wait for the device (`.item()`, `nonzero`): such a step fails its capture,
and the run stops with an error naming train.cuda_graphs.
"""

from __future__ import annotations

from collections import Counter
from typing import Callable, Hashable

import torch
from torch import Tensor

Inputs = list[dict[str, Tensor]]  # a step's micro-batches
StepFn = Callable[[Inputs], tuple[Tensor, ...]]


def shape_key(inputs: Inputs) -> Hashable:
    """What a captured graph is specific to: each micro-batch's tensor names, shapes and dtypes."""
    return tuple(tuple((name, tuple(t.shape), t.dtype) for name, t in sorted(batch.items())) for batch in inputs)


def describe(key: Hashable) -> str:
    """A shape key for a log line: how many input tensors, and their distinct shapes."""
    entries = [entry for batch in key for entry in batch]
    shapes = sorted({tuple(shape) for _, shape, _ in entries})
    return f"{len(entries)} inputs of shapes {', '.join(str(list(s)) for s in shapes)}" if entries else "no inputs"


def _tensors(inputs: Inputs) -> list[Tensor]:
    return [t for batch in inputs for t in batch.values()]


class CapturedStep:
    """One step captured for one input shape; `replay(inputs)` copies the inputs in and runs it."""

    def __init__(self, step: StepFn, example: Inputs, stream: torch.cuda.Stream, pool) -> None:
        self.inputs = [{name: torch.empty_like(t) for name, t in batch.items()} for batch in example]
        self._copy_in(example)
        stream.wait_stream(torch.cuda.current_stream())
        self.graph = torch.cuda.CUDAGraph()
        # thread_local: the DataLoader's pin-memory thread keeps calling the CUDA runtime (pinned allocations,
        # event queries) while this thread captures; in the default global mode any such call fails the capture
        with torch.cuda.graph(self.graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
            self.outputs = step(self.inputs)

    def _copy_in(self, inputs: Inputs) -> None:
        for statics, batch in zip(self.inputs, inputs):
            for name, static in statics.items():
                static.copy_(batch[name], non_blocking=True)

    def replay(self, inputs: Inputs) -> tuple[Tensor, ...]:
        self._copy_in(inputs)
        self.graph.replay()
        return tuple(t.clone() for t in self.outputs)  # the next replay overwrites the static outputs


class StepGraphs:
    """`step(inputs)` for any input shape: eager for a shape's first `warmup` steps, a replayed graph after.

    Args:
        step: one whole optimizer step of `inputs` (device tensors); returns device tensors, and leaves
            every gradient None.
        before_replay: refreshes what the graph reads but the host decides per step (the learning rate).
        warmup: eager steps of a shape before it is captured (the first compiles).
    """

    def __init__(self, step: StepFn, before_replay: Callable[[], None] = lambda: None, warmup: int = 2,
                 log: Callable[[str], None] = print) -> None:
        self.step, self.before_replay, self.warmup, self.log = step, before_replay, warmup, log
        self.stream = torch.cuda.Stream()
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[Hashable, CapturedStep] = {}
        self.eager_steps: Counter = Counter()
        self.replays = 0

    def __call__(self, inputs: Inputs) -> tuple[Tensor, ...]:
        key = shape_key(inputs)
        graph = self.graphs.get(key)
        if graph is None and self.eager_steps[key] < self.warmup:
            self.eager_steps[key] += 1
            return self._eager(inputs)
        if graph is None:
            graph = self._capture(key, inputs)
        self.before_replay()
        self.replays += 1
        return graph.replay(inputs)

    def _capture(self, key: Hashable, inputs: Inputs) -> CapturedStep:
        """The graph of `key`'s shape. A failed capture is final: torch (2.11) leaves the caching allocator and
        the RNG mid-capture when the capture is invalidated, and later CUDA work in the process goes wrong
        (seen on the H200: wrong losses, "Offset increment outside graph capture"), so no eager fallback."""
        try:
            graph = self.graphs[key] = CapturedStep(self.step, inputs, self.stream, self.pool)
        except RuntimeError as err:
            raise RuntimeError(f"CUDA graph capture failed for {describe(key)}: {str(err).splitlines()[0]}. "
                               f"The step cannot be replayed as a graph: set train.cuda_graphs: false and "
                               f"resume") from err
        torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph has its own pool now
        self.log(f"captured the step as a CUDA graph for {describe(key)}")
        return graph

    def _eager(self, inputs: Inputs) -> tuple[Tensor, ...]:
        """The step on the capture stream (per-stream lazy state, such as cuBLAS workspaces, is made there)."""
        main = torch.cuda.current_stream()
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            outputs = self.step(inputs)
        main.wait_stream(self.stream)
        for t in _tensors(inputs):
            t.record_stream(self.stream)  # read on the side stream, freed on the main one
        for t in outputs:
            t.record_stream(main)  # made on the side stream, read on the main one
        return outputs


def bucket_length(length: int, bucket: int) -> int:
    """`length` rounded up to a multiple of `bucket` tokens (one graph per bucket, not per length)."""
    return -(-length // bucket) * bucket


def pad_time(batch: Inputs, length: int) -> Inputs:
    """Right-pad every [B, T, ...] tensor of a collated batch to T = `length` with zeros, as collation pads:
    padded positions are outside attention_mask and loss_mask, so the loss and the gradients of the real
    positions do not change (causal attention: no real query reads a later position)."""
    out = {}
    for name, t in batch.items():
        extra = length - t.shape[1]
        out[name] = t if extra == 0 else torch.nn.functional.pad(t, (0, 0) * (t.dim() - 2) + (0, extra))
    return out
