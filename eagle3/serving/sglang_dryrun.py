"""Ask the real SGLang what a launch argv resolves to, without starting a server.

Owns two things:
- a script, run by whatever python has sglang installed (a GPU host over SSH, or the CPU
  venv from infra/install-sglang-cpu.sh), that runs SGLang's own `load_plugins()`,
  `prepare_server_args(argv)` and `ServerArgs.resolve_once()` exactly as
  `sglang.launch_server` does, captures the INFO/WARNING lines SGLang logs meanwhile, and
  prints ONE JSON object on stdout:
      {"ok": true, "sglang_version": ..., "resolved": {...}, "warnings": [...]}
      {"ok": false, "sglang_version": ..., "error": "<ExceptionType: message>", "warnings": [...]}
  Exit 0 both ways (a failed resolution is an answer); exit 2 with a JSON error when sglang
  cannot be imported or the script's own arguments are wrong.
- `compare_dry_run(dry_json, resolution)`: SGLang's answer against eagleops' prediction
  (`eagle3.serving.sglang_args.resolve_speculative_args`), as one-line differences.

Usage (stdin is the script itself when piped over SSH, so argv carries everything):
    python sglang_dryrun.py [--full] -- --model-path M --speculative-algorithm EAGLE3 ...
    python - [--full] -- FLAGS... < sglang_dryrun.py
    python sglang_dryrun.py [--full] --batch FILE          (FILE: JSON list of argv lists)
    python sglang_dryrun.py [--full] --batch-json '[[...], [...]]'
Batch mode prints one JSON list, one object per argv, and pays SGLang's import once.
`--full` adds "resolved_all": every field of `ServerArgs.resolved_dict()`.

Self-contained on purpose: only the standard library at module level and no eagleops
imports, so the source can be piped into a remote interpreter; sglang is imported inside
`main()`.

Risk: effective values are read with `resolved_dict()`, never from ServerArgs attributes,
which keep the raw input after resolution (reference sglang-eagle3.md, "Trap"). Warnings
are the INFO+ records of the `sglang.*` loggers (SGLang's `prepare_server_args` re-configures
the root logger with `force=True`, which would drop a handler put there); Python `warnings`
(import-time noise such as "Only CUDA ... support AWQ") and `print` output are not recorded.
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from eagle3.serving.sglang_args import SpecResolution

# The effective settings reported under "resolved" (resolved_dict() key names); the ones
# eagleops predicts come first, then the platform-dependent ones it does not model.
RESOLVED_FIELDS = (
    "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "max_running_requests", "speculative_draft_model_path", "speculative_draft_model_revision",
    "speculative_use_rejection_sampling", "speculative_adaptive", "disable_overlap_schedule", "enable_mixed_chunk",
    "device", "attention_backend", "prefill_attention_backend", "decode_attention_backend", "page_size",
    "speculative_draft_attention_backend", "speculative_attention_mode", "speculative_token_map",
    "speculative_draft_window_size", "speculative_draft_sink_size", "tp_size", "model_path",
)
# Settings both sides know; `device` is left out on purpose: eagleops predicts it from
# `detected_device`, the dry run is always given `--device` explicitly.
COMPARED_FIELDS = (
    "speculative_algorithm", "speculative_num_steps", "speculative_eagle_topk", "speculative_num_draft_tokens",
    "max_running_requests", "speculative_draft_model_path", "speculative_draft_model_revision",
    "speculative_use_rejection_sampling", "speculative_adaptive", "disable_overlap_schedule", "enable_mixed_chunk",
)
CAPTURED_LEVELS = {logging.INFO: "info", logging.WARNING: "warning", logging.ERROR: "error",
                   logging.CRITICAL: "critical"}


class _UsageError(Exception):
    """The script's own arguments are wrong (exit 2)."""


# ---------------------------------------------------------------------------------------
# Comparison with eagleops' prediction (runs in the eagleops process, no sglang needed).
# ---------------------------------------------------------------------------------------

def compare_dry_run(dry_json: dict, resolution: "SpecResolution") -> list[str]:
    """Differences between SGLang's dry run and `resolve_speculative_args`, one line each.

    Args:
        dry_json: one object printed by this script (not a batch list).
        resolution: eagleops' prediction for the same argv.
    Returns [] when they agree on success/failure (and the exception type), on every
    COMPARED_FIELDS value, and on the speculative log lines (eagleops' adjustments against
    SGLang's captured lines from its speculative loggers). What SGLang only reports once the
    worker starts (`resolution.runtime_errors`, the token-map warning) is not compared:
    resolution cannot see it.
    """
    if not isinstance(dry_json, dict) or "ok" not in dry_json:
        found = sorted(dry_json) if isinstance(dry_json, dict) else type(dry_json).__name__
        raise ValueError(f"dry_json: expected one dry-run object with an 'ok' key, found {found}")
    predicted_error = resolution.errors[0] if resolution.errors else None
    if not dry_json["ok"]:
        return _compare_failure(dry_json.get("error", ""), predicted_error)
    if predicted_error is not None:
        return [f"resolution: sglang succeeds, eagleops predicted failure {predicted_error!r}"]
    # eagleops lists SGLang's worker-start warnings among the adjustments too; resolution
    # cannot log those, so they are left out here. Imported here, not at module level, so
    # that the script stays free of eagleops imports when piped to a remote python.
    from eagle3.serving.sglang_args import MSG_TOKEN_MAP_IGNORED

    runtime_lines = (MSG_TOKEN_MAP_IGNORED,)  # eagle_worker_v2.py: EagleDraftWorker.init_token_map
    predicted_lines = [(level, text) for level, text in resolution.adjustments if text not in runtime_lines]
    diffs = _compare_settings(dry_json.get("resolved", {}), resolution.resolved_settings())
    diffs += _compare_log_lines(dry_json.get("warnings", []), predicted_lines)
    return diffs


def _compare_failure(sglang_error: str, predicted_error: str | None) -> list[str]:
    if predicted_error is None:
        return [f"resolution: sglang fails with {sglang_error!r}, eagleops predicted success"]
    sglang_type, _, sglang_message = sglang_error.partition(":")
    if sglang_type == "SystemExit" and predicted_error.startswith("error: "):
        # Both are argparse's own error line: "sglang serve: error: X" against "error: X".
        if sglang_message.strip().endswith(predicted_error):
            return []
    elif predicted_error.startswith(sglang_type.strip()):
        return []
    return [f"resolution error: sglang raises {sglang_error!r}, eagleops predicted {predicted_error!r}"]


def _compare_settings(sglang: dict, predicted: dict) -> list[str]:
    diffs = []
    for name in COMPARED_FIELDS:
        if name not in sglang:
            diffs.append(f"{name}: missing from the dry run's 'resolved' (eagleops predicted {predicted[name]!r})")
        elif sglang[name] != predicted[name]:
            diffs.append(f"{name}: sglang says {sglang[name]!r}, eagleops predicted {predicted[name]!r}")
    return diffs


def _compare_log_lines(captured: list[dict], predicted: list[tuple[str, str]]) -> list[str]:
    """Each predicted (level, text) must be logged by SGLang, and each speculative line predicted."""
    logged = [(w["level"], w["message"]) for w in captured]
    speculative = [(w["level"], w["message"]) for w in captured if _is_speculative_logger(w.get("logger", ""))]
    diffs = []
    for level, text in predicted:
        if (level, text) not in logged:
            diffs.append(f"log line: eagleops predicted {level} {text!r}, sglang did not log it")
    for level, text in speculative:
        if (level, text) not in predicted:
            diffs.append(f"log line: sglang logged {level} {text!r}, eagleops predicted no such line")
    return diffs


def _is_speculative_logger(name: str) -> bool:
    """SGLang's speculative resolution logs from these modules (speculative_hook.py, speculative/*)."""
    return name == "sglang.srt.arg_groups.speculative_hook" or name.startswith("sglang.srt.speculative")


# ---------------------------------------------------------------------------------------
# The dry run itself (runs where sglang is installed).
# ---------------------------------------------------------------------------------------

class _LogCapture(logging.Handler):
    """Collects INFO and above from the `sglang` logger tree, in order."""

    def __init__(self) -> None:
        super().__init__(level=logging.INFO)
        self.records: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        level = CAPTURED_LEVELS.get(record.levelno, record.levelname.lower())
        self.records.append({"level": level, "logger": record.name, "message": record.getMessage()})


def _json_value(value: Any) -> Any:
    """resolved_dict() values as JSON: plain values pass, anything else becomes its str()."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return str(value)


def _exception_text(exc: BaseException, stderr_text: str) -> str:
    """`Type: message`; argparse's exit becomes SystemExit with argparse's own error line."""
    if isinstance(exc, SystemExit):
        lines = [ln for ln in stderr_text.splitlines() if ln.strip()]
        return f"SystemExit: {lines[-1] if lines else f'exit code {exc.code}'}"
    return f"{type(exc).__name__}: {exc}"


def resolve_with_sglang(argv: Sequence[str], full: bool = False) -> dict:
    """Run SGLang's own argument resolution on a launch argv; returns the JSON-ready result.

    Must run in a process where sglang imports; `load_plugins()` is expected to have run.
    """
    import sglang
    from sglang.srt.server_args import prepare_server_args

    capture = _LogCapture()
    sglang_logger = logging.getLogger("sglang")
    sglang_logger.addHandler(capture)
    stderr_buffer = io.StringIO()
    # Resolution writes SGLANG_* variables into os.environ (e.g. SGLANG_USE_CUDA_IPC_TRANSPORT);
    # the next argv of a batch must start from the same environment as a fresh launch.
    environ_before = dict(os.environ)
    result: dict[str, Any] = {"argv": list(argv), "sglang_version": getattr(sglang, "__version__", None)}
    try:
        # argparse writes its usage error to stderr before exiting: keep that text. SGLang's
        # logging.basicConfig in prepare_server_args binds its handler to this buffer too,
        # so its log lines reach the real stderr below, after the answer is complete.
        with contextlib.redirect_stderr(stderr_buffer):
            server_args = prepare_server_args(list(argv))
        server_args.resolve_once()
        resolved = server_args.resolved_dict()
        result["ok"] = True
        result["resolved"] = {k: _json_value(resolved[k]) for k in RESOLVED_FIELDS if k in resolved}
        if full:
            result["resolved_all"] = {k: _json_value(v) for k, v in resolved.items()}
    except (Exception, SystemExit) as exc:  # SGLang's failure is the answer, not a crash
        result["ok"] = False
        result["error"] = _exception_text(exc, stderr_buffer.getvalue())
        result["traceback_tail"] = traceback.format_exc().strip().splitlines()[-6:]
    finally:
        sglang_logger.removeHandler(capture)
        os.environ.clear()
        os.environ.update(environ_before)
        sys.stderr.write(stderr_buffer.getvalue())
    result["warnings"] = capture.records
    return result


def _parse_own_args(argv: list[str]) -> tuple[bool, list[list[str]] | None, list[str]]:
    """(full, batch argvs or None, single argv) from this script's command line."""
    own, sglang_argv = (argv[: argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else ([], argv)
    if "--" not in argv and argv and argv[0] in ("--full", "--batch", "--batch-json"):
        own, sglang_argv = argv, []
    full, batch = False, None
    i = 0
    while i < len(own):
        if own[i] == "--full":
            full, i = True, i + 1
        elif own[i] in ("--batch", "--batch-json") and i + 1 < len(own):
            batch, i = _load_batch(own[i], own[i + 1]), i + 2
        else:
            raise _UsageError(f"unknown or incomplete option {own[i]!r}; expected --full, --batch FILE, "
                              "--batch-json JSON, then -- and SGLang launch flags")
    if batch is None and not sglang_argv:
        raise _UsageError("no SGLang launch flags given (pass them after --, or --batch FILE)")
    if batch is not None and sglang_argv:
        raise _UsageError("give either --batch/--batch-json or launch flags after --, not both")
    return full, batch, sglang_argv


def _load_batch(option: str, value: str) -> list[list[str]]:
    try:
        text = open(value).read() if option == "--batch" else value
    except OSError as e:
        raise _UsageError(f"--batch {value}: cannot read it ({e})") from e
    try:
        batch = json.loads(text)
    except json.JSONDecodeError as e:
        raise _UsageError(f"{option}: expected a JSON list of argv lists, found invalid JSON ({e})") from e
    if not isinstance(batch, list) or not all(isinstance(a, list) and all(isinstance(s, str) for s in a)
                                               for a in batch):
        raise _UsageError(f"{option}: expected a JSON list of argv lists of strings, found {type(batch).__name__}")
    return batch


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> int:
    """Command line entry; prints exactly one JSON document on stdout."""
    try:
        full, batch, single = _parse_own_args(list(sys.argv[1:] if argv is None else argv))
    except _UsageError as e:
        _print_json({"ok": False, "error": f"UsageError: {e}", "warnings": []})
        return 2
    # SGLang's imports and resolution may print; stdout must carry only the JSON answer.
    with contextlib.redirect_stdout(sys.stderr):
        try:
            from sglang.srt.plugins import load_plugins
        except Exception as e:  # noqa: BLE001 - any import failure means "no usable sglang here"
            not_importable = {"ok": False, "error": f"sglang is not importable: {type(e).__name__}: {e}",
                              "warnings": []}
        else:
            not_importable = None
            # launch_server.py and `sglang serve` load plugins before parsing: a platform
            # plugin can change device and backend choices.
            load_plugins()
            results = [resolve_with_sglang(a, full) for a in (batch if batch is not None else [single])]
    if not_importable is not None:
        _print_json(not_importable)
        return 2
    _print_json(results if batch is not None else results[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
