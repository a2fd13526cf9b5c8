"""The verdict of a benchmark, and when speculation disappoints, its probable causes ranked with evidence.

An alarm is raised for a speculative setting that is not faster than the baseline, or whose
online accept length falls well below what the draft's offline figures promise at the depth
the config asked for (`bench.accept_length_tolerance`). Each cause check looks at one kind of
evidence and scores how well it explains the gap:

- settings rewritten by the server (the seed's 16 draft tokens run as 2);
- hidden-state layers (or their order) differing between training and serving (the seed's
  [embed, L3, L31] vs [L3, L31, L59]);
- draft-vocabulary coverage of what the target actually generates;
- chat template or tokenization mismatch between training data and serving (including answers
  re-tokenized from text instead of the target's own ids);
- acceptance by draft position falling off faster than in training;
- cost: a verify step costing more target steps than it yields tokens.
The first three are faults, reported whatever the figures (a toy target may tolerate a wrong
layer set that a real one does not); the others explain a disappointing figure and are looked
for only under an alarm. A healthy run gets no causes at all.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from eagle3.data.capture import sglang_layers_to_capture
from eagle3.export import TRAINING_RECORD, describe_hf_indices
from tasks.config import ExperimentConfig


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


# ------------------------------------------------------------------ causes


def cause_settings_rewritten(row: dict, **_) -> dict | None:
    changed = {k: (v, row["effective"].get(k)) for k, v in row["asked"].items()
               if v is not None and row["effective"].get(k) != v}
    if not changed:
        return None
    parts = [f"asked {k} {a}, the server runs {e}" for k, (a, e) in changed.items()]
    why = "topk 1 forces num_draft_tokens = num_steps + 1" if row["effective"].get("eagle_topk") == 1 else \
        "SGLang's own resolution changed it"
    return {"cause": "settings_rewritten", "score": 0.95,
            "summary": f"the server rewrote the speculative settings: {'; '.join(parts)} ({why})",
            "evidence": {"asked": row["asked"], "effective": row["effective"]}}


def cause_layer_mismatch(draft_dir: Path, target_config: dict, **_) -> dict | None:
    record_file, config_file = Path(draft_dir) / TRAINING_RECORD, Path(draft_dir) / "config.json"
    if not record_file.is_file() or not target_config:
        return None
    record = json.loads(record_file.read_text())
    ids = json.loads(config_file.read_text()).get("eagle_config", {}).get("eagle_aux_hidden_state_layer_ids")
    arch, layers = target_config.get("architectures", [""])[0], target_config.get("num_hidden_layers")
    fed = sglang_layers_to_capture(arch, list(ids) if ids is not None else None, layers)
    trained = list(record.get("hf_indices", []))
    if fed == trained:
        return None
    same_set = sorted(fed) == sorted(trained)
    return {"cause": "layer_mismatch", "score": 1.0,
            "summary": f"the draft was trained on {describe_hf_indices(trained)} but the server feeds it "
                       f"{describe_hf_indices(fed)}" + (" (same layers, other order)" if same_set else ""),
            "evidence": {"trained_hf_indices": trained, "served_hf_indices": fed, "eagle_config_ids": ids}}


def cause_vocab_coverage(rows: list[dict], draft_dir: Path, **_) -> dict | None:
    baseline = next((r for r in rows if not r["speculative"]), None)
    hot = _draft_vocab(draft_dir)
    if baseline is None or hot is None:
        return None
    tokens = [t for ids in baseline.get("output_ids") or [] if ids for t in ids]
    if not tokens:
        return None
    coverage = sum(t in hot for t in tokens) / len(tokens)
    if coverage >= 0.95:
        return None
    return {"cause": "vocab_coverage", "score": round(min(0.9, (1 - coverage) * 2), 3),
            "summary": f"{100 * (1 - coverage):.1f}% of the target's output tokens are outside the draft's "
                       f"{len(hot)}-token vocabulary (the draft can never propose them)",
            "evidence": {"coverage": coverage, "draft_vocab_size": len(hot), "tokens": len(tokens)}}


def _draft_vocab(draft_dir: Path) -> set[int] | None:
    weights = Path(draft_dir) / "model.safetensors"
    if not weights.is_file():
        return None
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        if "d2t" not in f.keys():
            return None
        d2t = f.get_tensor("d2t")
    return {int(i) + int(off) for i, off in enumerate(d2t.tolist())}


def cause_template(draft_dir: Path, deployed: dict, data: dict, served_template_sha: str | None, **_) -> dict | None:
    record_file = Path(draft_dir) / TRAINING_RECORD
    record = json.loads(record_file.read_text()) if record_file.is_file() else {}
    trained_sha = record.get("chat_template_sha256")
    problems = []
    if trained_sha and served_template_sha and trained_sha != served_template_sha:
        problems.append(f"chat template differs: training {trained_sha[:12]}, serving {served_template_sha[:12]}")
    regen = (data or {}).get("regeneration", {})
    if regen.get("backend") == "http" and not regen.get("keeps_token_ids"):
        problems.append("training answers came back as text and were re-tokenized, so the draft trained on token "
                        "streams the target does not emit")
    if not problems:
        return None
    return {"cause": "template_or_tokenization", "score": 0.6, "summary": "; ".join(problems),
            "evidence": {"training_template_sha256": trained_sha, "serving_template_sha256": served_template_sha,
                         "regeneration": regen}}


def cause_position_falloff(row: dict, acc: list[float], **_) -> dict | None:
    online = row.get("accepted_by_position") or []
    if not online or not acc:
        return None
    gaps = [(k, on, acc[k]) for k, on in enumerate(online) if k < len(acc) and acc[k] and on < 0.6 * acc[k]]
    if not gaps:
        return None
    k, on, off = gaps[0]
    return {"cause": "position_falloff", "score": 0.5,
            "summary": f"acceptance falls off from draft position {k + 1}: {on:.2f} online vs {off:.2f} in training",
            "evidence": {"online_by_position": online, "training_acc": acc[:len(online)]}}


def cause_cost(row: dict, baseline: dict | None, **_) -> dict | None:
    if baseline is None or not row.get("verify_s") or not baseline.get("itl_p50_s"):
        return None
    step, verify = baseline["itl_p50_s"], row["verify_s"]
    tokens = row.get("decode_accept_length") or 1.0
    bound = tokens * step / verify
    if bound >= 1.05:
        return None
    return {"cause": "cost", "score": 0.7 if bound < 1 else 0.4,
            "summary": f"a verify step costs {verify / step:.2f} target steps and yields {tokens:.2f} tokens: at most "
                       f"{bound:.2f}x; more draft tokens cannot pay, fewer steps or a cheaper draft can",
            "evidence": {"target_step_s": step, "verify_step_s": verify, "tokens_per_verify": tokens}}


# Faults are wrong whatever the figures say (a toy target may hide them): always reported.
FAULTS = (cause_settings_rewritten, cause_layer_mismatch, cause_template)
# Explanations of a disappointing figure: looked for only under an alarm.
EXPLANATIONS = (cause_vocab_coverage, cause_position_falloff, cause_cost)


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


def diagnose(cfg: ExperimentConfig, rows: list[dict], offline: dict, deployed: dict, draft_dir: Path,
             target_config: dict, data: dict | None = None, served_template_sha: str | None = None) -> dict[str, Any]:
    """{status, best, settings: [{setting, speedup, alarms}], causes: ranked, evidence each}."""
    level = rows[0]["concurrency"] if rows else 1
    first = [r for r in rows if r["concurrency"] == level]
    baseline = next((r for r in first if not r["speculative"]), None)
    acc = offline.get("acc") or []
    settings, causes = [], {}
    for row in (r for r in first if r["speculative"]):
        speedup = row["tok_s_median"] / baseline["tok_s_median"] if baseline and baseline["tok_s_median"] else None
        alarms = alarms_for(row, baseline, acc, cfg.bench.accept_length_tolerance)
        settings.append({"setting": row["setting"], "tok_s_median": row["tok_s_median"], "speedup": speedup,
                         "accept_length": row["decode_accept_length"], "alarms": alarms})
        for check in FAULTS + (EXPLANATIONS if alarms else ()):
            found = check(row=row, rows=rows, baseline=baseline, acc=acc, draft_dir=draft_dir,
                          target_config=target_config, deployed=deployed, data=data,
                          served_template_sha=served_template_sha)
            if found and found["score"] > causes.get(found["cause"], {}).get("score", -1):
                causes[found["cause"]] = {**found, "setting": row["setting"]}
    ranked = sorted(causes.values(), key=lambda c: -c["score"])
    best = max(settings, key=lambda s: s["tok_s_median"] or 0, default=None)
    status = _status(best, settings, ranked)
    return {"status": status, "best": best, "settings": settings, "causes": ranked,
            "summary": _summary_line(status, best, ranked)}


def _status(best: dict | None, settings: list[dict], causes: list[dict]) -> str:
    if best is None or best.get("speedup") is None:
        return "no_baseline"
    if best["speedup"] <= 1.0:
        return "slower"
    return "faster_with_alarms" if causes or any(s["alarms"] for s in settings) else "faster"


def _summary_line(status: str, best: dict | None, causes: list[dict]) -> str:
    if status == "no_baseline":
        return "no baseline was measured: no speedup to report"
    head = f"best {best['setting']}: {best['speedup']:.2f}x the baseline"
    if causes:
        return f"{head}; top cause: {causes[0]['summary']}"
    return head + ("" if status == "faster" else "; see the alarms")
