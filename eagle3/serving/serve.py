"""`python -m eagle3.serve`: an SGLang-compatible HTTP server around eagle3.serving.decoding, on CPU.

Owns the serving contract SGLang 0.5.23 gives a deploy and a benchmark: its launch flags
(`eagle3.serving.settings`), its endpoints and response shapes (`eagle3.serving.http_api`) and
its scheduling, metrics and periodic decode log line (`eagle3.serving.scheduler`). It lets the
pipeline deploy and benchmark against a real process on a machine without a GPU.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import sys

import torch
import uvicorn
from transformers.utils import logging as transformers_logging

from eagle3.serving.http_api import build_app
from eagle3.serving.scheduler import Scheduler
from eagle3.serving.settings import build_settings
from eagle3.serving.sglang_args import SERVE_IGNORED_FLAGS, LaunchArgsError, build_arg_parser

logger = logging.getLogger("eagle3.serve")


def configure_logging(level: str) -> None:
    """SGLang's prefix: `[%Y-%m-%d %H:%M:%S] message` (TP=1 server: no rank tags)."""
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO), format="[%(asctime)s] %(message)s",
                        datefmt="%Y-%m-%d %H:%M:%S", force=True)


def log_ignored_flags(ns) -> None:
    for name in SERVE_IGNORED_FLAGS:
        value = getattr(ns, name)
        if value not in (None, False):
            logger.info(f"Ignoring --{name.replace('_', '-')}={value}: eagle3.serve runs on CPU without it.")


def collect_from_now_on() -> None:
    """The model loaded: what the start allocated is frozen (gc.freeze, never walked again), collection back on."""
    gc.freeze()
    gc.enable()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_arg_parser(prog="eagle3.serve")
    try:
        ns = parser.parse_args(argv)
    except LaunchArgsError as e:
        parser.print_usage(sys.stderr)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    configure_logging(ns.log_level)
    transformers_logging.disable_progress_bar()
    log_ignored_flags(ns)
    # Batch-1 decoding of a small model is latency-bound: one thread per server (OMP_NUM_THREADS to
    # change it). More threads than free cores spin in OpenMP barriers and ran 5-30x slower on 2 cores.
    torch.set_num_threads(max(1, int(os.environ.get("OMP_NUM_THREADS", "1"))))
    try:
        settings = build_settings(argv)
    except (ValueError, FileNotFoundError) as e:
        logger.error(f"Invalid launch arguments: {e}")
        return 1
    logger.info(f"server_args: {json.dumps(settings.resolution.resolved_settings())}")
    scheduler = Scheduler(settings)
    app = build_app(scheduler, settings)
    server = uvicorn.Server(uvicorn.Config(app, host=ns.host, port=ns.port, log_level="warning", access_log=False,
                                           timeout_graceful_shutdown=5))
    scheduler.on_load_error = lambda: setattr(server, "should_exit", True)
    if not gc.isenabled():  # `python -m eagle3.serve` loads without garbage collection (eagle3/serve.py)
        scheduler.on_loaded = collect_from_now_on
    scheduler.start()
    try:
        server.run()
    finally:
        scheduler.stop()
    return 1 if scheduler.load_error else 0


if __name__ == "__main__":
    sys.exit(main())
