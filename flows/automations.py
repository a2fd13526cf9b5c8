"""`eagleops deploy-flows`' automations: what happens when the watch or a nightly says something.

- drift or change of a model (`eagleops.draft.drift`, `eagleops.served.changed` whose resource is labelled
  `eagleops.model: NAME`) -> run that model's nightly deployment, at most once per `watch.cooldown_s` for each
  served version. The watch already re-sends an alert that lasts at most that often, but per endpoint and per
  alert: one look at a worse draft sends a drift and a draft change, and a fleet of servers sends one each. The
  trigger's own window (Prefect 3.9.1, a reactive trigger with `within` = the cooldown and `for_each` the
  version: it fires on the first event, then drops every event that occurred before the window's end,
  server/events/triggers.py `evaluate`) makes all of them one nightly; a new champion's version opens its own
  window. "Never while one runs" is the nightly deployment's concurrency limit (1, CANCEL_NEW, infra/prefect.yaml):
  a run started while another holds the slot is Cancelled;
- a nightly flow run Failed or Crashed -> one notification;
- a champion promoted or kept (`eagleops.champion.promoted` / `.kept`, emitted by the gate) -> a notification;
- a server unreachable (`eagleops.served.unreachable`) -> a notification.
Notifications go through one Prefect custom-webhook block (`eagleops-oncall`), made from the URL in the environment
variable `EAGLEOPS_WEBHOOK_URL` (a secret: the block keeps it in its secrets, never printed). Every
automation is replaced by name, so a second deploy-flows creates nothing new.

Risk: Prefect's automations run in the Prefect server's own services (triggers, actions); a server started
with `--no-services` accepts them and never fires them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

from tasks.watch.events import CHANGED, DRIFT, KEPT, PROMOTED, UNREACHABLE

WEBHOOK_ENV = "EAGLEOPS_WEBHOOK_URL"
BLOCK_NAME = "eagleops-oncall"
PREFIX = "eagleops: "


@dataclass(frozen=True)
class NightlyDeployment:
    """A registered nightly deployment and the model its config trains (export.registered_model)."""

    id: str
    name: str
    model: str
    cooldown_s: float  # the config's watch.cooldown_s


def ensure_webhook_block(url: str | None = None) -> str | None:
    """The `eagleops-oncall` Webhook block (created or updated from $EAGLEOPS_WEBHOOK_URL); its id, or None unset."""
    from prefect.blocks.notifications import CustomWebhookNotificationBlock

    url = url or os.environ.get(WEBHOOK_ENV)
    if not url:
        return None
    # The whole URL is a block secret (it usually carries the token), put in by template when a message is sent.
    block = CustomWebhookNotificationBlock(
        name=BLOCK_NAME, url="{{webhook_url}}", method="POST", secrets={"webhook_url": url},
        json_data={"subject": "{{subject}}", "body": "{{body}}", "source": "{{name}}"}, allow_private_urls=True)
    return str(block.save(BLOCK_NAME, overwrite=True))


def automation_specs(nightlies: list[NightlyDeployment], block_id: str | None) -> list:
    """The automations deploy-flows keeps (see the module docstring), as prefect.automations.Automation objects."""
    from prefect.automations import Automation, EventTrigger, Posture, RunDeployment, SendNotification

    specs = []
    for nightly in nightlies:
        specs.append(Automation(
            name=f"{PREFIX}drift or change of {nightly.model} -> {nightly.name}",
            description="The watch saw the served draft drift below its band or run other than it was measured with.",
            trigger=EventTrigger(expect={DRIFT, CHANGED}, match={"eagleops.model": nightly.model},
                                 for_each={"eagleops.model.version"}, posture=Posture.Reactive, threshold=1,
                                 within=timedelta(seconds=nightly.cooldown_s)),
            actions=[RunDeployment(source="selected", deployment_id=nightly.id)]))
    if block_id is None:
        return specs

    def notify(name: str, trigger, subject: str, body: str) -> Automation:
        return Automation(name=PREFIX + name, trigger=trigger,
                          actions=[SendNotification(block_document_id=block_id, subject=subject, body=body)])

    event_body = "{{ event.event }} on {{ event.resource.id }}: {{ event.payload }}"
    specs.append(notify("nightly failed -> notify", EventTrigger(
        expect={"prefect.flow-run.Failed", "prefect.flow-run.Crashed"}, match_related={
            "prefect.resource.role": "flow", "prefect.resource.name": "eagle3-nightly"},
        posture=Posture.Reactive, threshold=1, within=0),
        "eagleops: a nightly retrain {{ event.event.split('.')[-1] }}",
        "Flow run {{ event.resource['prefect.resource.name'] }} ({{ event.resource.id }}) ended "
        "{{ event.event.split('.')[-1] }}: {{ event.payload.validated_state.message }}"))
    specs.append(notify("champion decision -> notify", EventTrigger(
        expect={PROMOTED, KEPT}, posture=Posture.Reactive, threshold=1, within=0),
        "eagleops: {{ event.event }}", event_body))
    specs.append(notify("server unreachable -> notify", EventTrigger(
        expect={UNREACHABLE}, posture=Posture.Reactive, threshold=1, within=0),
        "eagleops: a production server does not answer", event_body))
    return specs


def ensure_automations(specs: list) -> dict[str, str]:
    """Create each automation, replacing one of the same name; {name: "created" | "replaced"}."""
    from prefect.automations import Automation

    outcome = {}
    for spec in specs:
        existing = Automation.read(name=spec.name) if _exists(spec.name) else None
        if existing is not None:
            existing.delete()
        spec.create()
        outcome[spec.name] = "replaced" if existing is not None else "created"
    return outcome


def _exists(name: str) -> bool:
    from prefect.automations import Automation

    try:
        Automation.read(name=name)
    except ValueError:  # Prefect 3.9: "Automation with name ... not found"
        return False
    return True


def nightly_deployments(client, prefect_file, project_dir) -> list[NightlyDeployment]:
    """The registered nightly deployments of prefect.yaml, each with the model its config trains."""
    import yaml

    from tasks.config.load import ConfigError, load_experiment

    found = []
    for entry in (yaml.safe_load(prefect_file.read_text()) or {}).get("deployments") or []:
        if not str(entry.get("entrypoint", "")).endswith(":nightly_retrain"):
            continue
        config = (entry.get("parameters") or {}).get("config_path")
        try:
            cfg = load_experiment(project_dir / config) if config else None
        except ConfigError:  # a config that needs the GPU host's environment: no model to match on here
            cfg = None
        if cfg is not None and cfg.export.registered_model:
            deployment = client.read_deployment_by_name(f"eagle3-nightly/{entry['name']}")
            found.append(NightlyDeployment(str(deployment.id), entry["name"], cfg.export.registered_model,
                                           cfg.watch.cooldown_s))
    return found
