"""The reference server's request dumps, as SGLang 0.5.23's `TokenizerManager.dump_requests` and
`_dump_data_to_file` write them, turned on by `POST /configure_logging`.

Owns the logging settings `/configure_logging` sets (SGLang's `ConfigureLoggingReq` fields), the
list of finished requests, and the dump file: every `dump_requests_threshold` finished requests,
`<folder>/<%Y-%m-%d_%H-%M-%S>.pkl` holding `{"server_args", "config_updates", "resolved_config",
"requests"}`, requests as `(GenerateReqInput, out_dict, created_time, finished_time)` (epoch
seconds), pickle protocol 4, written from a background thread. The request object pickles under
SGLang's own name, `sglang.srt.managers.io_struct.GenerateReqInput` (NEWOBJ + BUILD of its
fields, as SGLang's dataclass pickles), so SGLang's stock unpickler loads these files too, and
eagleops' reader (`eagle3.data.served_dumps`) reads both alike.

Deliberate deviations from SGLang: `server_args` is a dict of this server's settings (the form
SGLang itself writes when watermarking is on), never a ServerArgs record; a file is written
atomically (temp file + rename; SGLang writes in place, so a reader can meet a half-written
file); a second dump within the same second gets `_1`, `_2`, ... before `.pkl` (SGLang
overwrites the first: its requests are lost). Like SGLang: health checks are never dumped, and
requests still below the threshold when the server stops are never written. Cancelled requests
(a client gone away) end without an answer here and are not dumped (SGLang dumps them as aborts).

Risk: the names written must stay SGLang's (a test loads a dump with SGLang's own unpickler).
The pure-Python pickler (`pickle._Pickler`, same opcodes as the C one) writes them without
importing sglang; it pickles ~1M token ids a second, in the writer thread.
"""

from __future__ import annotations

import io
import logging
import os
import pickle
import threading
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from eagle3.data.served_dumps import GENERATE_REQ_INPUT

logger = logging.getLogger("eagle3.serve")

DUMP_PROTOCOL = 4  # what SGLang's pickle.dump writes on Python 3.8-3.13
DEFAULT_THRESHOLD = 1000  # TokenizerManager.init_request_logging_and_dumping
DEFAULT_EXCLUDE_META_KEYS = ("routed_experts", "hidden_states")


@dataclass
class GenerateReqInput:
    """The fields of SGLang's GenerateReqInput for one normalized request (`obj` of a dump entry).

    Pickled as `sglang.srt.managers.io_struct.GenerateReqInput`; SGLang's unpickler sets these as
    its attributes, its other fields keep their class defaults.
    """

    rid: str
    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict = field(default_factory=dict)
    stream: bool = False
    return_prompt_token_ids: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    log_metrics: bool = True
    received_time: float | None = None
    is_single: bool = True
    batch_size: int = 1
    parallel_sample_num: int = 1


# Our class -> the (module, qualified name) pickle writes for it.
SGLANG_NAMES = {GenerateReqInput: GENERATE_REQ_INPUT}


class _SGLangNamesPickler(pickle._Pickler):
    """Writes SGLANG_NAMES' classes under SGLang's names (the C pickler insists on importing them)."""

    def save_global(self, obj: Any, name: str | None = None) -> None:
        names = SGLANG_NAMES.get(obj) if isinstance(obj, type) else None
        if names is None:
            super().save_global(obj, name)
            return
        assert self.proto >= 4, "STACK_GLOBAL needs protocol 4"
        self.save(names[0])
        self.save(names[1])
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)


def dump_bytes(payload: dict) -> bytes:
    """The dump payload pickled as SGLang writes it (protocol 4, SGLang's class names)."""
    buffer = io.BytesIO()
    _SGLangNamesPickler(buffer, protocol=DUMP_PROTOCOL).dump(payload)
    return buffer.getvalue()


class RequestDumper:
    """Finished requests -> SGLang-format dump files, every `threshold` requests (thread-safe)."""

    def __init__(self, server_args: dict) -> None:
        self.server_args = server_args
        self.folder = ""  # SGLang's default: no dumping
        self.threshold = DEFAULT_THRESHOLD
        self.exclude_meta_keys = list(DEFAULT_EXCLUDE_META_KEYS)
        self._pending: list[tuple] = []
        self._lock = threading.Lock()
        self._writers: list[threading.Thread] = []

    def configure(self, folder: str | None, threshold: int | None, exclude_meta_keys: list[str] | None) -> None:
        """Apply what is set (None: unchanged), as TokenizerManager.configure_logging does; "" stops dumping."""
        with self._lock:
            if folder is not None:
                self.folder = folder
            if threshold is not None:
                self.threshold = threshold
            if exclude_meta_keys is not None:
                self.exclude_meta_keys = list(exclude_meta_keys)

    @property
    def enabled(self) -> bool:
        return bool(self.folder)

    def record(self, obj: GenerateReqInput, out: dict, created_time: float, finished_time: float) -> None:
        """One finished request; writes a file (in the background) once `threshold` are pending."""
        with self._lock:
            if not self.folder:
                return
            meta = out.get("meta_info")
            if isinstance(meta, dict) and any(k in meta for k in self.exclude_meta_keys):
                out = {**out, "meta_info": {k: v for k, v in meta.items() if k not in self.exclude_meta_keys}}
            self._pending.append((obj, out, created_time, finished_time))
            if len(self._pending) < self.threshold:
                return
            batch, self._pending = self._pending, []
            folder = Path(self.folder)
        payload = {"server_args": self.server_args, "config_updates": [], "resolved_config": self.server_args,
                   "requests": batch}
        writer = threading.Thread(target=self._write, args=(folder, payload), name="eagle3-request-dump")
        self._writers = [w for w in self._writers if w.is_alive()] + [writer]
        writer.start()

    def wait(self, timeout: float | None = None) -> None:
        """Wait for the dump files being written (tests, shutdown)."""
        for writer in list(self._writers):
            writer.join(timeout)

    def _write(self, folder: Path, payload: dict) -> None:
        try:
            path = _write_dump(folder, payload)
        except OSError as e:  # the server keeps serving; the file's requests are lost, as in SGLang
            logger.error(f"Failed to dump {len(payload['requests'])} requests to {folder}: {e}")
            return
        logger.info(f"Dump {len(payload['requests'])} requests to {path}")


_name_lock = threading.Lock()


def _write_dump(folder: Path, payload: dict) -> Path:
    """`folder/<time>.pkl` (or `<time>_<n>.pkl` when taken), written via a temp file + rename."""
    data = dump_bytes(payload)
    folder.mkdir(parents=True, exist_ok=True)
    stem = datetime.now().strftime("%Y-%m-%d_%H-%M-%S")
    with _name_lock:  # two writer threads in the same second must not pick the same name
        path, n = folder / f"{stem}.pkl", 0
        while path.exists():
            n += 1
            path = folder / f"{stem}_{n}.pkl"
        tmp = folder / f".{path.name}.tmp"
        try:
            tmp.write_bytes(data)
            os.replace(tmp, path)
        except OSError:
            tmp.unlink(missing_ok=True)
            raise
    return path
