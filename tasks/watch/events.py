"""The Prefect events eagleops emits about production: what the watch saw and what the nightly gate decided.

Owns the event names and their resources, the contract the automations (`flows/automations.py`) match on:
- `eagleops.draft.drift`: the served accept length stayed below the champion's band for `watch.for` windows;
- `eagleops.served.changed`: the server runs settings, a draft, a target or an engine other than the
  champion was measured with;
- `eagleops.served.unreachable`: the server (or the Prometheus the watch reads it through) does not answer;
- `eagleops.champion.promoted` / `eagleops.champion.kept`: the nightly gate's decision.
The resource of a served event is the endpoint, labelled with the model and version it serves
(`eagleops.model`, `eagleops.model.version`); a champion event's resource is the registered model.
Every payload is redacted (a webhook token in an endpoint URL never leaves).
"""

from __future__ import annotations

from typing import Any

from prefect.events import emit_event

from tasks.config.secrets import redact, redact_obj
from tasks.log import logger

DRIFT = "eagleops.draft.drift"
CHANGED = "eagleops.served.changed"
UNREACHABLE = "eagleops.served.unreachable"
PROMOTED = "eagleops.champion.promoted"
KEPT = "eagleops.champion.kept"
WATCH_EVENTS = (DRIFT, CHANGED, UNREACHABLE)


def served_resource(endpoint: str, model: str | None, version: str | None) -> dict[str, str]:
    shown = redact(endpoint)
    resource = {"prefect.resource.id": f"eagleops.served.{shown}", "prefect.resource.name": shown,
                "eagleops.endpoint": shown}
    if model:
        resource.update({"eagleops.model": model, "eagleops.model.version": str(version or "")})
    return resource


def model_resource(model: str, version: str | None) -> dict[str, str]:
    return {"prefect.resource.id": f"eagleops.model.{model}", "prefect.resource.name": model,
            "eagleops.model": model, "eagleops.model.version": str(version or "")}


def emit(event: str, resource: dict[str, str], payload: dict[str, Any]) -> str | None:
    """Emit one event; its id, or None where no Prefect API takes events (logged once, never raised)."""
    sent = emit_event(event=event, resource=resource, payload=redact_obj(payload))
    if sent is None:
        logger().warning(f"{event}: no Prefect API to send the event to (set PREFECT_API_URL)")
        return None
    return str(sent.id)


def emit_champion_decision(model: str, challenger: str, champion_before: str | None, promoted: bool,
                           reason: str, journaled: str | None = None) -> str | None:
    """`eagleops.champion.promoted` or `.kept` for a nightly gate's decision on `challenger`. `journaled`: the
    registry did not answer and the alias move waits in that journal for `eagleops sync` (`aliases_moved` false,
    the reason says so), so no one reads the promotion as done."""
    if journaled:
        reason = f"{reason} (aliases not moved yet: journaled in {journaled}; eagleops sync applies it)"
    payload = {"challenger": challenger, "champion_before": champion_before, "reason": reason,
               "champion": challenger if promoted else champion_before, "aliases_moved": not journaled}
    return emit(PROMOTED if promoted else KEPT, model_resource(model, challenger if promoted else champion_before),
                payload)
