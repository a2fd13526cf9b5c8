"""What the served-dump tests share: the reference server in-process (real app and worker behind
uvicorn on 127.0.0.1) serving the session's tiny target with a random EAGLE-3 draft, and a
helper that finds sampling settings under which an answer ends on a clean stop."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import torch

from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
from eagle3.export import export_sglang
from eagle3.serving.http_api import build_app
from eagle3.serving.scheduler import Scheduler
from eagle3.serving.settings import build_settings
from tests.helpers import serve_in_thread

TIMEOUT = httpx.Timeout(60.0)
SPEC_FLAGS = ["--speculative-num-steps", "2", "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "3"]


def build_random_draft(target_dir: Path, out_dir: Path) -> Path:
    """A random EAGLE-3 draft for the target, exported in SGLang's format."""
    config = json.loads((Path(target_dir) / "config.json").read_text())
    torch.manual_seed(0)
    draft_cfg = DraftModelConfig.from_target_config(config, draft_vocab_size=config["vocab_size"],
                                                    aux_layer_ids=[1, 3, 5])
    return export_sglang(Eagle3DraftModel(draft_cfg), config, out_dir, dtype="float32")


@contextlib.contextmanager
def reference_server(target_dir: Path, draft_dir: Path) -> Iterator[tuple[str, Scheduler]]:
    """(base URL, scheduler) of the reference server on the target + draft, stopped on exit."""
    settings = build_settings(["--model-path", str(target_dir), "--speculative-algorithm", "EAGLE3",
                               "--speculative-draft-model-path", str(draft_dir), *SPEC_FLAGS,
                               "--max-running-requests", "4", "--device", "cpu", "--random-seed", "0"])
    scheduler = Scheduler(settings)
    scheduler.start()
    try:
        assert scheduler.ready.wait(timeout=120), scheduler.load_error
        with serve_in_thread(build_app(scheduler, settings)) as url:
            yield url, scheduler
    finally:
        scheduler.stop()
        scheduler.join(timeout=15)
        scheduler.dumps.wait(timeout=30)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=TIMEOUT)


def stopping_sampling(url: str, prompt: dict, max_new_tokens: int = 12, seed: int = 1234) -> dict:
    """Seeded sampling_params under which `prompt` (the /generate body's text or input_ids) ends on a clean
    stop: the stop token is the 4th token of the same seeded continuation, so it stops there (or
    earlier, where that token or an eos first appears). Sampled, not greedy: the session's tiny target
    repeats one token greedily."""
    sampling = {"temperature": 1.0, "seed": seed}
    probe = post(url, "/generate", {**prompt, "sampling_params": {**sampling, "max_new_tokens": 6, "ignore_eos": True}})
    assert probe.status_code == 200, probe.text
    return {**sampling, "max_new_tokens": max_new_tokens, "stop_token_ids": [probe.json()["output_ids"][3]]}
