"""Days of served traffic written straight as SGLang dump files (the reference server's own pickler,
`eagle3.serving.request_dumps.dump_bytes`), for the capture cache's tests: no server needed, and the token
counts a test expects are counted here, from what was written, never by the code under test."""

from __future__ import annotations

import random
import time
from pathlib import Path

from eagle3.serving.request_dumps import GenerateReqInput, dump_bytes

STOP = {"type": "stop", "matched": 2}


def day_of_traffic(seed: int, n: int, vocab: int = 300) -> list[tuple[list[int], list[int]]]:
    """n (prompt ids, output ids) pairs, distinct across seeds (the seed is the first prompt token's offset)."""
    rng = random.Random(seed)
    return [([3 + seed % 50, *(rng.randrange(3, vocab) for _ in range(rng.randrange(4, 12)))],
             [rng.randrange(3, vocab) for _ in range(rng.randrange(3, 10))]) for _ in range(n)]


def write_dump(folder: Path, name: str, pairs: list[tuple[list[int], list[int]]],
               finished: float | None = None) -> Path:
    """One dump file of clean answers to `pairs`, as SGLang's dump_requests writes them."""
    finished = time.time() if finished is None else finished
    requests = [(GenerateReqInput(rid=f"{name}-{n}", input_ids=prompt, sampling_params={"temperature": 0.0}),
                 {"output_ids": output, "meta_info": {"finish_reason": STOP, "completion_tokens": len(output)}},
                 finished - 1.0, finished) for n, (prompt, output) in enumerate(pairs)]
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.pkl"
    path.write_bytes(dump_bytes({"server_args": {}, "config_updates": [], "resolved_config": {},
                                 "requests": requests}))
    return path


def tokens_of(pairs: list[tuple[list[int], list[int]]], max_length: int) -> int:
    """Tokens the samples of `pairs` hold: prompt + output, cut at max_length."""
    return sum(min(len(p) + len(o), max_length) for p, o in pairs)
