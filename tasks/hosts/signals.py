"""Signals held while a teardown runs: SIGINT and SIGTERM that arrive during it wait until it is done.

Risk: the second signal. Ctrl-C starts the flow's teardown; a second Ctrl-C (a user's reflex, or a
scheduler's SIGTERM after its grace period) raised KeyboardInterrupt inside that teardown, and every
server after the one being stopped stayed up. Inside `signals_held` each such signal is logged and
held; when the block ends the previous handlers are back, and a held signal is delivered again --
unless an exception is already unwinding (the first interrupt, or the failure that started the
teardown), which stays the error. kill -9 still ends everything at once.

Handlers belong to the main thread; elsewhere the block runs without holding anything.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Iterator

HELD = (signal.SIGINT, signal.SIGTERM)


@contextlib.contextmanager
def signals_held(log: logging.Logger | logging.LoggerAdapter, what: str) -> Iterator[None]:
    """Hold SIGINT/SIGTERM while the block runs (`what` names it in the log line), then deliver them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []

    def hold(signum, frame) -> None:
        held.append(signum)
        log.warning(f"{signal.Signals(signum).name} received during {what}: finishing it first")

    previous = {signum: signal.signal(signum, hold) for signum in HELD}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
    if held and sys.exc_info()[1] is None:
        signal.raise_signal(held[0])
