"""The verdict of a benchmark, and when speculation disappoints, its probable causes ranked with evidence.

An alarm is raised for a speculative setting that is not faster than the baseline, or whose
online accept length falls well below what the draft's offline figures promise at the depth
the config asked for (`bench.accept_length_tolerance`). The causes reason from what ran: the
settings each server reports in /server_info and its decode log, the requests the benchmark
sent (endpoint, the chat template they went through), the draft's training record, and the
served model's and draft's files as the serving host has them (`tasks.hosts.served.ServedModel`, read
from the paths the deployed server reports). Each check looks at one kind of evidence:

- settings: the server runs other values than asked (the seed's 16 draft tokens run as 2), or
  other values than the preflight predicted, or reports none;
- hidden-state layers (or their order) the served draft is fed vs the ones it was trained on
  (the seed's [embed, L3, L31] vs [L3, L31, L59]), and a served target other than the trained one;
- the chat template the prompts went through, and the server's own, vs the training data's
  (and answers re-tokenized from text instead of the target's own ids);
- draft-vocabulary coverage of what the target generated (the training record's coverage when
  the endpoint returns no token ids);
- cumulative acceptance by draft position (verify steps accepting >= k drafts) well below training's
  cumulative product of acc_k at the same position;
- cost: a verify step costing more target steps than it yields tokens;
- the client's figures disagreeing with the server's own.
Faults (a rewrite nobody opted into, a server that runs other settings than checked, wrong
layers, another template) are reported whatever the figures say (a toy target may tolerate a
wrong layer set that a real one does not); the rest explain a disappointing figure and are looked
for only under an alarm. A rewrite the config opted into (`allow_adjustments`, every sweep
setting) is recorded with its setting and becomes a cause only when it explains an alarm.
Evidence a check needs and does not have is listed under `missing_evidence`, never guessed.
A healthy run gets no causes at all.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from eagle3.data.capture import sglang_layers_to_capture
from eagle3.export import TRAINING_RECORD, describe_hf_indices
from tasks.config.schema import ExperimentConfig
from tasks.stages.bench.report import cumulative

SPEC_FIELDS = ("num_steps", "eagle_topk", "num_draft_tokens")
ALL_SETTINGS = "all settings"


@dataclass(frozen=True)
class Missing:
    """Evidence a check needed and did not have (reported in the verdict, never guessed)."""

    check: str
    reason: str


def expected_accept_length(acc: list[float], depth: int) -> float:
    """1 + sum_k prod_{j<=k} acc_j over the first `depth` draft positions (the chain's expectation)."""
    total, alive = 1.0, 1.0
    for a in acc[:max(depth, 0)]:
        alive *= a or 0.0
        total += alive
    return total


def asked_depth(asked: dict, effective: dict) -> int:
    """How deep the config expected the draft to go: the asked steps, or for a chain the asked draft tokens - 1."""
    steps = asked.get("num_steps") or effective.get("num_steps") or 1
    tokens = asked.get("num_draft_tokens")
    topk = asked.get("eagle_topk") or effective.get("eagle_topk") or 1
    return max(steps, tokens - 1) if tokens and topk == 1 else steps


# ------------------------------------------------------------------ causes: each setting


def cause_settings_rewritten(row: dict, alarms: list[str] = (), **_) -> dict | None:
    """The server runs other values than asked, or than the preflight predicted (the server's report decides)."""
    asked, served = row["asked"], row["effective"]
    predicted, source = row.get("predicted") or served, row.get("settings_source") or "prediction"
    changed = {k: (v, served.get(k)) for k, v in asked.items() if v is not None and served.get(k) != v}
    unpredicted = {k: (predicted.get(k), v) for k, v in served.items()
                   if k in SPEC_FIELDS and predicted.get(k) is not None and v != predicted[k]}
    if not changed and not unpredicted:
        return None
    parts = [f"asked {k} {a}, the server runs {e}" for k, (a, e) in changed.items()] or \
        [f"the server runs {', '.join(f'{k} {served.get(k)}' for k in SPEC_FIELDS)}"]
    why = ("topk 1 forces num_draft_tokens = num_steps + 1" if served.get("eagle_topk") == 1 else
           "SGLang's own resolution changed it") if not unpredicted else "not SGLang's rule for the flags checked"
    summary = f"the server rewrote the speculative settings: {'; '.join(parts)} ({why}; reported by {source})"
    if unpredicted:
        shown = ", ".join(f"{k} {p}" for k, (p, _) in unpredicted.items())
        summary += f"; the preflight predicted {shown}: the server does not run what was checked"
    kind, score = _rewrite_weight(row, bool(unpredicted), alarms)
    if score is None:
        return None
    return {"cause": "settings_rewritten", "score": score, "kind": kind, "summary": summary,
            "evidence": {"asked": asked, "served": served, "predicted": predicted, "reported_by": source,
                         "opted_in": bool(row.get("allow_adjustments"))}}


def _rewrite_weight(row: dict, unpredicted: bool, alarms: list[str]) -> tuple[str, float | None]:
    """A rewrite nobody opted into, or one the preflight did not predict, is a fault; an opted-in one only
    explains an alarm (most when the asked depth, which the offline promise is measured at, was cut)."""
    if unpredicted or not row.get("allow_adjustments"):
        return "fault", 0.95
    if not alarms:
        return "note", None
    cut = asked_depth(row["asked"], row["effective"]) > (row["effective"].get("num_steps") or 0)
    short = any("accept length" in a for a in alarms)
    return "explanation", 0.9 if cut and short else 0.3


def cause_server_report(row: dict, **_) -> dict | Missing | None:
    """The server's own report is missing or says it does not speculate."""
    problems, score = [], 0.5
    if row.get("settings_source") == "prediction":
        problems.append("/server_info reports no speculative settings, so what the server runs is unknown (its row "
                        "carries the preflight's prediction)")
    lines = row.get("log_decode_lines")
    if lines and row.get("log_accept_len") is None:
        problems.append(f"its log has {lines} decode lines and none with an accept len: it logs as a server that "
                        "does not speculate")
        score = 0.9
    if not problems:
        return Missing("decode_log", "the server log has no decode line to read (fewer decode steps than "
                       "--decode-log-interval, or another log format)") if not lines else None
    return {"cause": "server_report", "score": score, "kind": "fault", "summary": "; ".join(problems),
            "evidence": {"settings_source": row.get("settings_source"), "decode_lines": lines,
                         "log_accept_len": row.get("log_accept_len")}}


def cause_position_falloff(row: dict, acc: list[float], **_) -> dict | None:
    """Online cumulative acceptance by draft position vs the same quantity from training, within the served depth.

    Online, `accepted_by_position[k]` is the share of verify steps that accepted at least k + 1 drafts
    (cumulative). Training's acc_k (0-based, as the training history names it) is conditional: position
    k + 1 right given the earlier ones right. So the offline counterpart is prod_{j<=k} acc_j, which is
    what the benchmark plot draws (`tasks.stages.bench.report.cumulative`). Example: acc [0.9, 0.8, 0.5] ->
    offline [0.9, 0.72, 0.36]; online [0.85, 0.65, 0.28] is no fall-off (0.28 of 0.36), though 0.28 is
    below 0.6 x the conditional 0.5.
    """
    depth = row["effective"].get("num_steps") or 0
    online = (row.get("accepted_by_position") or [])[:depth]  # positions past the served depth never draft
    offline = cumulative(acc[:depth])
    if not online or not offline:
        return None
    gaps = [(k, on, off) for k, (on, off) in enumerate(zip(online, offline)) if off and on < 0.6 * off]
    if not gaps:
        return None
    k, on, off = gaps[0]
    return {"cause": "position_falloff", "score": 0.5, "kind": "explanation",
            "summary": f"acceptance falls off from draft position {k + 1}: {on:.2f} of verify steps accept >= {k + 1} "
                       f"drafts online vs {off:.2f} expected from training (the product of its "
                       f"{'acc_0' if k == 0 else f'acc_0..acc_{k}'})",
            "evidence": {"online_cumulative_by_position": online, "training_cumulative_by_position": offline,
                         "training_acc": acc[:depth]}}


def cause_cost(row: dict, baseline: dict | None, **_) -> dict | None:
    if baseline is None or not row.get("verify_s") or not baseline.get("itl_p50_s"):
        return None
    step, verify = baseline["itl_p50_s"], row["verify_s"]
    tokens = row.get("decode_accept_length") or 1.0
    bound = tokens * step / verify
    if bound >= 1.05:
        return None
    return {"cause": "cost", "score": 0.7 if bound < 1 else 0.4, "kind": "explanation",
            "summary": f"a verify step costs {verify / step:.2f} target steps and yields {tokens:.2f} tokens: at most "
                       f"{bound:.2f}x; more draft tokens cannot pay, fewer steps or a cheaper draft can",
            "evidence": {"target_step_s": step, "verify_step_s": verify, "tokens_per_verify": tokens}}


def cause_disagreement(row: dict, **_) -> dict | None:
    if not row.get("disagreements"):
        return None
    return {"cause": "client_server_disagree", "score": 0.4, "kind": "explanation",
            "summary": "the server's own figures disagree with the client's: " + "; ".join(row["disagreements"]),
            "evidence": {"disagreements": row["disagreements"]}}


# ------------------------------------------------------------------ causes: what every setting shares


def cause_layer_mismatch(served: dict, alarms: list[str] = (), **_) -> dict | Missing | None:
    """The layers SGLang feeds the served draft (its eagle_config ids on the served target) vs its training record."""
    record, draft_config, target = served.get("training_record"), served.get("draft_config"), served.get("target_config")
    where = f"{served.get('host')}:{(served.get('paths') or {}).get('draft')}"
    if not target or draft_config is None or record is None:
        return Missing("layers", f"the served draft {where} has no readable config.json and {TRAINING_RECORD} (or "
                       "the served model no config.json): its layers cannot be compared with its training")
    arch, layers = (target.get("architectures") or [None])[0], target.get("num_hidden_layers")
    if record.get("architecture") != arch or record.get("num_hidden_layers") != layers:
        return {"cause": "target_mismatch", "score": 1.0, "kind": "fault",
                "summary": f"the draft was trained on a {record.get('num_hidden_layers')}-layer "
                           f"{record.get('architecture')} target; the server serves a {layers}-layer {arch} "
                           f"({(served.get('paths') or {}).get('model')})",
                "evidence": {"trained": [record.get("architecture"), record.get("num_hidden_layers")],
                             "served": [arch, layers]}}
    ids = draft_config.get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    try:
        fed = sglang_layers_to_capture(arch, list(ids) if ids is not None else None, layers)
    except ValueError as err:  # an architecture whose capture rule is not known here
        return Missing("layers", f"which layers SGLang feeds a {arch} is not known here: {err}")
    trained = list(record.get("hf_indices", []))
    if fed == trained:
        return None
    shows = any("accept length" in a for a in alarms)
    same_set = sorted(fed) == sorted(trained)
    return {"cause": "layer_mismatch", "score": 1.0 if shows else 0.8, "kind": "fault",
            "summary": f"the draft was trained on {describe_hf_indices(trained)} but the server feeds it "
                       f"{describe_hf_indices(fed)}" + (" (same layers, other order)" if same_set else "")
                       + ("" if shows else "; the figures do not show it on this target (a real one will)"),
            "evidence": {"trained_hf_indices": trained, "served_hf_indices": fed, "eagle_config_ids": ids,
                         "served_draft": where}}


def cause_template(served: dict, requests: dict, data: dict | None = None, **_) -> dict | Missing | None:
    """The chat template the prompts went through, and the server's own, vs the one the training data used."""
    trained = (served.get("training_record") or {}).get("chat_template_sha256")
    sent, own = requests.get("template_sha256"), served.get("chat_template_sha256")
    problems = []
    if trained and sent and sent != trained:
        problems.append(f"the benchmark's prompts went through another chat template ({requests.get('template_source')}"
                        f": {sent[:12]}) than the training data ({trained[:12]})")
    if trained and own and own != trained and requests.get("endpoint") != "chat":
        problems.append(f"the server's own chat template ({served.get('template_source')}: {own[:12]}) differs from "
                        f"the training data's ({trained[:12]}): chat clients send prompts the draft never saw")
    regen = (data or {}).get("regeneration", {})
    if regen.get("backend") == "http" and not regen.get("keeps_token_ids"):
        problems.append("training answers came back as text and were re-tokenized, so the draft trained on token "
                        "streams the target does not emit")
    if problems:
        return {"cause": "template_or_tokenization", "score": 0.6, "kind": "fault", "summary": "; ".join(problems),
                "evidence": {"training_template_sha256": trained, "requests_template_sha256": sent,
                             "server_template_sha256": own, "server_template_source": served.get("template_source"),
                             "regeneration": regen}}
    if not trained:
        return Missing("template", f"the served draft's {TRAINING_RECORD} carries no chat template hash")
    if not sent:
        return Missing("template", f"the chat template the prompts went through is unknown "
                       f"({requests.get('template_source') or 'no request record'})")
    return None


def cause_vocab_coverage(rows: list[dict], served: dict, **_) -> dict | Missing | None:
    """Share of the target's generated tokens the draft can propose; the training record's when none came back."""
    hot = _draft_vocab(served.get("draft_local_dir"))
    tokens = _generated_tokens(rows)
    if hot is not None and tokens:
        coverage, source = sum(t in hot for t in tokens) / len(tokens), f"{len(tokens)} tokens the target generated"
    else:
        coverage = (served.get("training_record") or {}).get("draft_vocab_coverage")
        source = "the training record (coverage of the training answers)"
        if coverage is None:
            why = "the endpoint returned no output_ids" if not tokens else "the served draft's d2t is not readable here"
            return Missing("vocab_coverage", f"{why}, and the training record carries no coverage")
    if coverage >= 0.95:
        return None
    return {"cause": "vocab_coverage", "score": round(min(0.85, (1 - coverage) * 2), 3), "kind": "explanation",
            "summary": f"{100 * (1 - coverage):.1f}% of the target's output tokens are outside the draft's vocabulary "
                       f"(the draft can never propose them; from {source})",
            "evidence": {"coverage": coverage, "source": source,
                         "draft_vocab_size": len(hot) if hot is not None else None, "tokens": len(tokens)}}


def _generated_tokens(rows: list[dict]) -> list[int]:
    """The baseline's output ids, else a speculative setting's (greedy speculation emits the target's own tokens)."""
    for row in sorted(rows, key=lambda r: r["speculative"]):
        tokens = [t for ids in row.get("output_ids") or [] if ids for t in ids]
        if tokens:
            return tokens
    return []


def _draft_vocab(draft_dir: str | Path | None) -> set[int] | None:
    weights = Path(draft_dir) / "model.safetensors" if draft_dir else None
    if weights is None or not weights.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        if "d2t" not in f.keys():
            return None
        d2t = f.get_tensor("d2t")
    return {int(i) + int(off) for i, off in enumerate(d2t.tolist())}


# Faults are wrong whatever the figures say (a toy target may hide them): always looked for.
SETTING_FAULTS = (cause_settings_rewritten, cause_server_report)
SHARED_FAULTS = (cause_layer_mismatch, cause_template)
# Explanations of a disappointing figure: looked for only under an alarm.
SETTING_EXPLANATIONS = (cause_position_falloff, cause_cost, cause_disagreement)
SHARED_EXPLANATIONS = (cause_vocab_coverage,)


# ------------------------------------------------------------------ verdict


def alarms_for(row: dict, baseline: dict | None, acc: list[float], tolerance: float) -> list[str]:
    alarms = []
    if baseline and row["tok_s_median"] is not None and row["tok_s_median"] <= baseline["tok_s_median"]:
        alarms.append(f"{row['setting']}: {row['tok_s_median']:.1f} tok/s is not faster than the baseline's "
                      f"{baseline['tok_s_median']:.1f}")
    online = row.get("decode_accept_length")
    if acc and online is not None:
        depth = asked_depth(row["asked"], row["effective"])
        offline = expected_accept_length(acc, depth)
        if online < (1 - tolerance) * offline:
            alarms.append(f"{row['setting']}: online accept length {online:.2f} is well below the offline "
                          f"{offline:.2f} the draft promises at depth {depth}")
    return alarms


def diagnose(cfg: ExperimentConfig, rows: list[dict], offline: dict, served: dict, data: dict | None = None,
             requests: dict | None = None) -> dict[str, Any]:
    """{status, best, settings: [{setting, speedup, alarms, rewritten}], causes: ranked, missing_evidence, summary}.

    Args:
        rows: the benchmark's rows (`tasks.stages.bench.stage.setting_row`), each with what its server reported.
        served: `ServedModel.to_dict()` of what the deployed server loaded, read on its host.
        requests: how the prompts were sent (`tasks.stages.bench.stage.requests_sent`).
    """
    level = rows[0]["concurrency"] if rows else 1
    first = [r for r in rows if r["concurrency"] == level]
    baseline = next((r for r in first if not r["speculative"]), None)
    acc = offline.get("acc") or []
    settings, causes = [], []
    missing = [{"check": "served_files", "setting": ALL_SETTINGS, "reason": m} for m in served.get("missing", [])]
    for row in (r for r in first if r["speculative"]):
        speedup = row["tok_s_median"] / baseline["tok_s_median"] if baseline and baseline["tok_s_median"] else None
        alarms = alarms_for(row, baseline, acc, cfg.bench.accept_length_tolerance)
        settings.append({"setting": row["setting"], "tok_s_median": row["tok_s_median"], "speedup": speedup,
                         "accept_length": row["decode_accept_length"], "alarms": alarms,
                         "rewritten": _rewritten(row), "settings_source": row.get("settings_source")})
        for check in SETTING_FAULTS + (SETTING_EXPLANATIONS if alarms else ()):
            _collect(check(row=row, baseline=baseline, acc=acc, alarms=alarms), row["setting"], causes, missing)
    alarms = [a for s in settings for a in s["alarms"]]
    for check in SHARED_FAULTS + (SHARED_EXPLANATIONS if alarms else ()):
        _collect(check(rows=rows, served=served, requests=requests or {}, data=data, alarms=alarms), ALL_SETTINGS,
                 causes, missing)
    ranked = sorted(causes, key=lambda c: -c["score"])
    best = max(settings, key=lambda s: s["tok_s_median"] or 0, default=None)
    status = _status(best, settings, ranked)
    return {"status": status, "best": best, "settings": settings, "causes": ranked, "missing_evidence": missing,
            "summary": _summary_line(status, best, ranked)}


def _collect(found: dict | Missing | None, setting: str, causes: list[dict], missing: list[dict]) -> None:
    if isinstance(found, Missing):
        missing.append({**asdict(found), "setting": setting})
    elif found:
        causes.append({**found, "setting": setting})


def _rewritten(row: dict) -> dict[str, list]:
    """{field: [asked, runs]} for each asked value the server does not run."""
    return {k: [v, row["effective"].get(k)] for k, v in row["asked"].items()
            if v is not None and row["effective"].get(k) != v}


def _status(best: dict | None, settings: list[dict], causes: list[dict]) -> str:
    if best is None or best.get("speedup") is None:
        return "no_baseline"
    if best["speedup"] <= 1.0:
        return "slower"
    return "faster_with_alarms" if causes or any(s["alarms"] for s in settings) else "faster"


def _summary_line(status: str, best: dict | None, causes: list[dict]) -> str:
    if status == "no_baseline":
        shown = f"best {best['setting']}: " if best else ""
        return f"{shown}speedup unknown: no baseline was measured (deploy.baseline: false)"
    head = f"best {best['setting']}: {best['speedup']:.2f}x the baseline"
    if causes:
        return f"{head}; top cause: {causes[0]['summary']}"
    return head + ("" if status == "faster" else "; see the alarms")
