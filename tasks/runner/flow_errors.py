"""An exception that leaves a flow body or a stage task leaves it with its secrets masked.

Prefect builds a failed flow or task run's state message from the exception itself, after the function
ended (`prefect.states.exception_to_failed_state`: `f"{type(exc).__name__}: {exc}"`), shows it in the UI
and the API, and stores the exception as the run's result. `redacted_failures`, under `@flow` or `@task`,
masks it first: for a flow, whatever its body raises outside a stage too (the config and its overrides,
the run folder and MLflow set-up, the nightly's registry calls, the teardown in a `finally`); for a
stage's task, its own failure (the flow's `StageFailed` is masked by tasks.runner.attempt as well).
The registry's and the watch's tasks live in wings below this one (tasks.tracking, tasks.watch) and
raise their own one-line, masked errors instead.

The exception keeps its type, traceback and chain (the CLI answers a `ConfigError` or `DiskFull` in
one line by its type): its text is masked in place. Only an exception whose text comes from somewhere
this cannot reach is replaced, by a `RedactedError` carrying the masked text and the same traceback.
Risk: a secret not known in this process yet (the config failed before its secrets were registered):
the config is loaded again here, once, to register them before masking.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any, Callable, TypeVar

from tasks.config.load import load_experiment
from tasks.config.masked import secret_values
from tasks.config.secrets import redact, redact_obj, register_secrets

F = TypeVar("F", bound=Callable[..., Any])
# Attributes that some exceptions build their text from instead of args (OSError, MlflowException, ours).
_TEXT_ATTRIBUTES = ("strerror", "filename", "filename2")


class RedactedError(RuntimeError):
    """Stands for an exception whose text could not be masked in place; the message is its masked text."""


def redacted_failures(fn: F) -> F:
    """Decorate a flow's or task's function (under `@flow`/`@task`): an exception escaping it is raised again with
    secrets masked."""
    signature = inspect.signature(fn)

    @functools.wraps(fn)
    def body(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except Exception as err:
            _register_config_secrets(signature, args, kwargs)
            masked = redact_exception(err)
            if masked is err:
                raise
            raise masked from None

    body.eagleops_redacting = True  # type: ignore[attr-defined]
    return body  # type: ignore[return-value]


def is_redacting(fn: Callable[..., Any]) -> bool:
    """Whether `fn` (a flow's or task's `.fn`) is wrapped by `redacted_failures`."""
    return getattr(fn, "eagleops_redacting", False)


def redact_exception(err: BaseException) -> BaseException:
    """`err` with every secret in its text masked: in place (args, text attributes, the chained exceptions),
    else a `RedactedError` with the masked text and `err`'s traceback."""
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        _mask_in_place(current)
        current = current.__cause__ or current.__context__
    text = _text(err)
    if redact(text) == text:
        return err
    return RedactedError(f"{type(err).__name__}: {redact(text)}").with_traceback(err.__traceback__)


def _mask_in_place(err: BaseException) -> None:
    try:
        err.args = tuple(redact_obj(a) if isinstance(a, (str, list, tuple, dict)) else a for a in err.args)
        for name, value in list(vars(err).items()):
            if isinstance(value, (str, list, dict)):
                setattr(err, name, redact_obj(value))
        for name in _TEXT_ATTRIBUTES:
            if isinstance(getattr(err, name, None), str):
                setattr(err, name, redact(getattr(err, name)))
    except (AttributeError, TypeError):  # a read-only attribute: the text check after this decides
        pass


def _text(err: BaseException) -> str:
    try:
        return str(err)
    except Exception:  # noqa: BLE001 -- a broken __str__ is no secret: Prefect will show the type alone
        return ""


def _register_config_secrets(signature: inspect.Signature, args: tuple, kwargs: dict) -> None:
    """The secrets of the config the flow was given, for a failure before the run registered them."""
    try:
        bound = signature.bind_partial(*args, **kwargs).arguments
        if bound.get("config_path"):
            register_secrets(secret_values(load_experiment(bound["config_path"], bound.get("variant"))))
    except Exception:  # noqa: BLE001 -- a config that does not load holds no expanded secret to register
        pass
