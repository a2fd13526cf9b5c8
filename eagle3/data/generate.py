"""The data stage: prompts -> target responses -> chat tokens + loss mask -> draft vocab ->
target hidden states (offline shards) or nothing (online). `generate_dataset` is the entry the
Prefect task wraps. With `data.source: served` the samples come from SGLang request dumps instead
(`eagle3.data.served_source`: no prompts file, no regeneration); vocab and hidden states follow as usual.

Owns the dataset directory: `samples.jsonl` (`eagle3.data.samples`), `failed.jsonl`
(`eagle3.data.server_pool`), `vocab/` (the draft vocabulary, `eagle3.draft.vocab`) and
`hidden_states/` (offline: `eagle3.data.shards`). Every part is keyed by a fingerprint of what
decides it, so a rerun reuses what matches and resumes what was cut.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

if __name__ == "__main__":  # the command's imports without garbage collection (see the end of the file)
    gc.disable()

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from eagle3.config import DataConfig, RegenerateConfig, TargetConfig  # noqa: E402
from eagle3.data.capture import aux_ids_to_hf_indices, default_aux_layer_ids  # noqa: E402
from eagle3.data.chat import Message, chat_template_sha256, turn_stop_ids  # noqa: E402
from eagle3.data.dump import dump_hidden_states  # noqa: E402
from eagle3.data.engines import open_capture_engine  # noqa: E402
from eagle3.data.files import LogFn, ProgressFn, atomic_write_text, emit_event, file_sha256  # noqa: E402
from eagle3.data.prompts import load_conversations, prompt_part  # noqa: E402
from eagle3.data.regeneration import (  # noqa: E402
    RegenerationLog,
    regenerate_http,
    regenerate_local,
    regenerate_sglang,
    regeneration_settings,
)
from eagle3.data.samples import (  # noqa: E402
    FAILED_FILE,
    SAMPLES_FILE,
    SAMPLES_FORMAT,
    SAMPLES_META,
    build_samples,
    read_samples,
    write_samples,
)
from eagle3.data.capture_cache import capture_key  # noqa: E402
from eagle3.data.served_capture import capture_served_night, uses_capture_cache  # noqa: E402
from eagle3.data.served_source import prepare_served_samples  # noqa: E402
from eagle3.data.server_pool import FailureLog  # noqa: E402
from eagle3.data.target import load_engine_target  # noqa: E402
from eagle3.data.tiny_target import cpu_threads, heldout_corpus  # noqa: E402
from eagle3.draft.vocab import build_or_load_draft_vocab  # noqa: E402
from eagle3.environment import hidden_state_bytes as estimate_hidden_state_bytes  # noqa: E402

# Starts the regeneration servers on entry, stops them on exit; yields their base URLs.
OpenEndpoints = Callable[[], contextlib.AbstractContextManager[list[str]]]


def _noop_progress(stage: str, done: int, total: int) -> None:
    return None


def _target_identity(target_dir: Path) -> str:
    """Hash of the target's config and weight files (names and sizes) plus its tokenizer files."""
    h = hashlib.sha256((target_dir / "config.json").read_bytes())
    for path in sorted(target_dir.glob("*.safetensors")) + sorted(target_dir.glob("tokenizer*.json")):
        h.update(f"{path.name}:{path.stat().st_size}".encode())
    return h.hexdigest()


def _prompts_identity(data_cfg: DataConfig) -> str:
    if data_cfg.prompts == "builtin":
        return "builtin:" + hashlib.sha256("\n".join(f.relpath for f in heldout_corpus()).encode()).hexdigest()
    return "file:" + file_sha256(Path(data_cfg.prompts))


def samples_fingerprint(target_dir: Path, data_cfg: DataConfig) -> str:
    """What decides samples.jsonl: target, prompts, sizes, split, regeneration settings."""
    rcfg = regeneration_settings(data_cfg.regenerate)
    # Where the target is served does not decide its answers (its identity is in "target").
    for unrelated in ("concurrency", "retries", "timeout_s", "batch_size", "backoff_s", "api_key_set", "endpoints",
                      "deploy", "max_failed_fraction"):
        rcfg.pop(unrelated)
    payload = {
        "format": SAMPLES_FORMAT,
        "target": _target_identity(target_dir),
        "prompts": _prompts_identity(data_cfg),
        "data": data_cfg.model_dump(include={"num_samples", "max_length", "validation_fraction", "seed"}),
        "regenerate": rcfg,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _generation_eos(target_dir: Path) -> int | list[int] | None:
    path = target_dir / "generation_config.json"
    return json.loads(path.read_text()).get("eos_token_id") if path.is_file() else None


def _final_conversations(
    conversations: list[list[Message]], data_cfg: DataConfig, load_model: Callable, tokenizer,
    stop_ids: list[int], out_dir: Path, fingerprint: str, progress: ProgressFn, log: LogFn,
    open_endpoints: OpenEndpoints | None = None,
) -> tuple[list[list[Message]], dict[int, list[int]], list[int]]:
    """Conversations with the target's answers (regeneration on) or as given (off), the target's
    generated token ids per returned conversation where the backend returns them (local, sglang),
    and the indices of the prompts that failed for good (left out of the conversations)."""
    rcfg = data_cfg.regenerate
    if not rcfg.enabled:
        for n, c in enumerate(conversations):
            if c[-1]["role"] != "assistant":
                raise ValueError(f"data.regenerate.enabled is false but conversation {n} has no final assistant answer")
        return conversations, {}, []
    prompts = [prompt_part(c, f"conversation {n}") for n, c in enumerate(conversations)]
    record = RegenerationLog(out_dir / f".regenerated-{fingerprint[:16]}.jsonl")
    if record.done:
        log(f"regenerate: resuming, {len(record.done)}/{len(prompts)} answers already done")
    failures = FailureLog(None)
    try:
        if rcfg.backend == "local":
            model = load_model()
            regenerate_local(
                model, tokenizer, prompts, rcfg, data_cfg.max_length, stop_ids, record, progress, data_cfg.seed
            )
        elif len(record.done) < len(prompts):
            failures = FailureLog(out_dir / FAILED_FILE)  # what failed in an earlier pass is asked again
            with _servers(rcfg, open_endpoints) as urls:
                log(f"regenerate: {len(prompts) - len(record.done)} prompts through {len(urls)} server(s), "
                    f"{rcfg.concurrency} in flight each")
                if rcfg.backend == "sglang":
                    regenerate_sglang(prompts, tokenizer, rcfg, data_cfg.max_length, stop_ids, record, progress, log,
                                      urls, failures)
                else:
                    regenerate_http(prompts, rcfg, record, progress, log, urls, failures)
    finally:
        record.close()
    answered = [i for i in range(len(prompts)) if i in record.done]
    final = [prompts[i] + [{"role": "assistant", "content": record.done[i]}] for i in answered]
    answer_ids = {n: record.token_ids[i] for n, i in enumerate(answered) if i in record.token_ids}
    return final, answer_ids, failures.indices


def _servers(rcfg: RegenerateConfig, open_endpoints: OpenEndpoints | None) -> contextlib.AbstractContextManager:
    """The named servers, or the ones `open_endpoints` starts (and stops on exit)."""
    if rcfg.server_urls:
        return contextlib.nullcontext(rcfg.server_urls)
    if open_endpoints is None:
        raise ValueError("data.regenerate.deploy: the servers are started by the data stage (tasks.stages.data); "
                         "called directly, generate_dataset needs open_endpoints or data.regenerate.endpoints")
    return open_endpoints()


def reusable_samples_meta(target_dir: Path, data_cfg: DataConfig, out_dir: Path) -> dict | None:
    """samples.meta.json of `out_dir` when its samples.jsonl is intact and was made from this target,
    these prompts and settings (so no prompt is left to answer), else None (always for data.source: served:
    its dumps are read again, new files may have come)."""
    if data_cfg.source == "served":
        return None
    meta_path, samples_path = Path(out_dir) / SAMPLES_META, Path(out_dir) / SAMPLES_FILE
    if not (meta_path.is_file() and samples_path.is_file()):
        return None
    meta = json.loads(meta_path.read_text())
    fresh = meta.get("fingerprint") == samples_fingerprint(target_dir, data_cfg)
    return meta if fresh and meta.get("sha256") == file_sha256(samples_path) else None


def _prepare_samples(
    target_dir: Path, data_cfg: DataConfig, tokenizer, stop_ids: list[int], load_model: Callable,
    out_dir: Path, progress: ProgressFn, log: LogFn, open_endpoints: OpenEndpoints | None = None,
) -> tuple[list[dict], dict]:
    """samples.jsonl from a previous identical run, or prompts -> answers -> tokens -> split (or served dumps)."""
    if data_cfg.source == "served":
        return prepare_served_samples(data_cfg, out_dir, progress, log)
    fingerprint = samples_fingerprint(target_dir, data_cfg)
    meta_path, samples_path = out_dir / SAMPLES_META, out_dir / SAMPLES_FILE
    meta = reusable_samples_meta(target_dir, data_cfg, out_dir)
    if meta is not None:
        log(f"data: reusing {samples_path} (same target, prompts and settings)")
        return read_samples(samples_path), meta
    progress("prompts", 0, 1)
    conversations = load_conversations(data_cfg, log)
    progress("prompts", 1, 1)
    final, answer_ids, failed = _final_conversations(
        conversations, data_cfg, load_model, tokenizer, stop_ids, out_dir, fingerprint, progress, log, open_endpoints
    )
    if failed:
        log(f"regenerate: {len(failed)} prompt(s) failed after their retries and are left out: {out_dir / FAILED_FILE}")
    samples, dropped = build_samples(tokenizer, final, data_cfg, stop_ids, progress, answer_ids)
    if not any(s["split"] == "train" for s in samples):
        raise ValueError(f"no usable training sample: all {len(final)} conversations had no assistant token "
                         f"within data.max_length={data_cfg.max_length}")
    meta = {"fingerprint": fingerprint, "sha256": write_samples(samples, samples_path), "dropped": dropped,
            "num_conversations": len(final), "failed": failed}
    atomic_write_text(meta_path, json.dumps(meta, indent=2))
    (out_dir / f".regenerated-{fingerprint[:16]}.jsonl").unlink(missing_ok=True)
    return samples, meta


def _dump_fingerprint(samples_sha: str, aux_ids: list[int], target_dir: Path, target_cfg: TargetConfig,
                      data_cfg: DataConfig) -> str:
    """What decides the shards' content: samples, layers, target, engine, dtype, shard size."""
    payload = [samples_sha, aux_ids, _target_identity(target_dir), data_cfg.hidden_states_dtype, data_cfg.shard_size,
               target_cfg.engine]
    if data_cfg.hidden_states == "stream":  # the validation split only: never the shards of an offline dump
        payload.append("stream")
    return hashlib.sha256(json.dumps(payload).encode()).hexdigest()


def _token_stats(samples: list[dict]) -> dict:
    tokens = {sp: sum(len(s["input_ids"]) for s in samples if s["split"] == sp) for sp in ("train", "validation")}
    assistant = sum(sum(s["loss_mask"]) for s in samples)
    total = sum(tokens.values())
    return {
        "num_samples": {sp: sum(s["split"] == sp for s in samples) for sp in ("train", "validation")},
        "num_tokens": tokens,
        "num_assistant_tokens": assistant,
        "loss_mask_fraction": assistant / total if total else 0.0,
    }


def _target_facts(target_dir: Path, target_cfg: TargetConfig, data_cfg: DataConfig) -> dict:
    """Architecture, sizes and resolved layer ids from config.json; rejects impossible settings."""
    config = json.loads((target_dir / "config.json").read_text())
    text = config.get("text_config", config)
    facts = {
        "architecture": config["architectures"][0],
        "num_hidden_layers": text["num_hidden_layers"],
        "hidden_size": text["hidden_size"],
        "vocab_size": text["vocab_size"],
    }
    context = text.get("max_position_embeddings", data_cfg.max_length)
    if data_cfg.max_length > context:
        raise ValueError(
            f"data.max_length={data_cfg.max_length} exceeds the target context (max_position_embeddings={context})"
        )
    if data_cfg.draft_vocab_size > facts["vocab_size"]:
        raise ValueError(
            f"data.draft_vocab_size={data_cfg.draft_vocab_size} exceeds the target vocab ({facts['vocab_size']})"
        )
    arch, layers = facts["architecture"], facts["num_hidden_layers"]
    facts["hf_indices"] = aux_ids_to_hf_indices(arch, target_cfg.aux_layer_ids, layers)
    facts["aux_layer_ids"] = target_cfg.aux_layer_ids or default_aux_layer_ids(arch, layers)
    return facts


def _log_disk_bound(facts: dict, data_cfg: DataConfig, log: LogFn) -> None:
    """Upper bound of the dump before any work (every sample at max_length); the exact need
    is known, and checked against free space, once the samples are tokenized."""
    k, dtype = len(facts["hf_indices"]), data_cfg.hidden_states_dtype
    tokens = data_cfg.num_samples * data_cfg.max_length
    bound = estimate_hidden_state_bytes(tokens, facts["hidden_size"], k, dtype=dtype)
    total = (f"{bound / 1e9:.3f} GB = {data_cfg.num_samples} samples x {data_cfg.max_length} tokens x "
             f"{bound // tokens} B ({k} aux + last state, H={facts['hidden_size']}, {dtype})")
    if data_cfg.hidden_states == "stream":
        log(f"hidden states: streamed within data.stream.disk_budget_gb = {data_cfg.stream.disk_budget_gb} GB (plus "
            f"the validation split's shards), not the whole dataset's at most {total}; each epoch is captured again")
    else:
        log(f"hidden states: at most {total}")


def _summary(samples, meta, facts, dump, data_cfg: DataConfig, tokenizer, vocab_info, out_dir: Path) -> dict:
    """The JSON-able result of generate_dataset (no secrets)."""
    dump = dump or {"bytes_total": 0, "bytes_written": 0, "estimate_bytes": 0, "shards_reused": 0}
    idle = meta.get("no_new_traffic")  # served: too few new samples, nothing captured and nothing to train
    return {
        **_token_stats(samples),
        "num_dropped": meta["dropped"],
        "num_failed": len(meta.get("failed", [])),
        **{k: facts[k] for k in ("architecture", "hidden_size", "aux_layer_ids", "hf_indices")},
        "hidden_states": data_cfg.hidden_states,
        "hidden_states_dtype": data_cfg.hidden_states_dtype,
        "hidden_states_bytes": dump["bytes_total"],
        "bytes_written": dump["bytes_written"],
        "hidden_states_estimate_bytes": dump["estimate_bytes"],
        "shards_reused": dump["shards_reused"],
        "capture_engine": dump.get("engine"),
        "chat_template_sha256": chat_template_sha256(tokenizer),
        "source": data_cfg.source,
        # served answers were not regenerated: their sampling settings are in served["sampling_params"]
        "regeneration": regeneration_settings(data_cfg.regenerate) if data_cfg.source == "prompts" else {},
        "served": meta.get("served"),
        "no_new_traffic": idle,
        "vocab": vocab_info or {},
        "paths": {
            "samples": str(out_dir / SAMPLES_FILE),
            "vocab": str(out_dir / "vocab") if not idle else None,
            "hidden_states": None if data_cfg.hidden_states == "online" or idle else str(out_dir / "hidden_states"),
            "failed": str(out_dir / FAILED_FILE) if meta.get("failed") else None,
        },
    }


def generate_dataset(
    target_dir: Path,
    target_cfg: TargetConfig,
    data_cfg: DataConfig,
    out_dir: Path,
    on_progress: ProgressFn | None = None,
    log: LogFn = print,
    open_endpoints: OpenEndpoints | None = None,
) -> dict:
    """Prompts -> regenerated answers -> samples.jsonl -> vocab/ -> hidden_states/ (offline).

    Args:
        target_dir: HF dir of the target (the tiny target's build dir, or target.model_path).
        target_cfg: aux layer ids and dtype of the target.
        data_cfg: prompts, regeneration, sizes, storage mode.
        out_dir: dataset directory (created; reruns resume or reuse what matches).
        on_progress: (stage, done, total) with stages prompts, regenerate, tokenize,
            vocab, hidden_states.
        log: one-line messages (never contains the API key).
        open_endpoints: starts the target's servers for data.regenerate.deploy (called only when
            prompts are left to answer) and stops them when its context exits.
    Returns:
        JSON-able summary: counts, tokens, layer ids, bytes, template hash, settings, paths.
    """
    started = time.perf_counter()
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    progress = on_progress or _noop_progress
    out_dir.mkdir(parents=True, exist_ok=True)
    facts = _target_facts(target_dir, target_cfg, data_cfg)
    if data_cfg.hidden_states != "online":
        _log_disk_bound(facts, data_cfg, log)
    tokenizer = AutoTokenizer.from_pretrained(target_dir, trust_remote_code=target_cfg.trust_remote_code)
    stop_ids = turn_stop_ids(tokenizer, _generation_eos(target_dir))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded: dict = {}

    def load_model():  # only when needed: http/sglang regeneration + online or engine sglang never loads it
        if target_cfg.engine == "sglang":
            raise ValueError("target.engine sglang: the target's weights are never loaded in transformers "
                             "(data.regenerate.backend local and data.hidden_states online need them)")
        if "model" not in loaded:
            loaded["model"] = load_engine_target(target_dir, target_cfg)
        return loaded["model"][0]

    def open_engine() -> contextlib.AbstractContextManager:  # the capture engine, for the shards only
        return open_capture_engine(target_dir, target_cfg, data_cfg, facts["aux_layer_ids"], loaded.get("model"))

    # CPU: as many threads as there are idle cores (oversubscribed OpenMP is 30x slower here).
    with cpu_threads(log=log) if device == "cpu" else contextlib.nullcontext():
        samples, meta = _prepare_samples(target_dir, data_cfg, tokenizer, stop_ids, load_model, out_dir, progress, log,
                                         open_endpoints)
        if uses_capture_cache(data_cfg):  # served: only the samples no earlier night captured, plus the replay
            key = capture_key(_target_identity(target_dir), facts["aux_layer_ids"], data_cfg.hidden_states_dtype,
                              target_cfg.engine)
            samples, meta, vocab_info, dump = capture_served_night(
                samples, meta, facts, key, data_cfg, out_dir, open_engine,
                lambda train: _build_vocab(train, facts, data_cfg, out_dir, progress), progress, log,
                reserve_bytes=stream_reserve_bytes(data_cfg))
        else:
            vocab_info, dump = _vocab_and_states(
                samples, meta, facts, open_engine, target_dir, target_cfg, data_cfg, out_dir, progress, log
            )
    summary = _summary(samples, meta, facts, dump, data_cfg, tokenizer, vocab_info, out_dir)
    return summary | {"wall_s": time.perf_counter() - started}


def _vocab_and_states(samples, meta, facts, open_engine, target_dir, target_cfg, data_cfg, out_dir, progress, log):
    """Draft vocab from the train split, then the shards: every split (offline), the validation split (stream:
    training's side captures the train split while it runs), none (online)."""
    vocab_info = _build_vocab([s for s in samples if s["split"] == "train"], facts, data_cfg, out_dir, progress)
    if data_cfg.hidden_states == "online":
        return vocab_info, None
    fingerprint = _dump_fingerprint(meta["sha256"], facts["aux_layer_ids"], target_dir, target_cfg, data_cfg)
    splits = ("train", "validation") if data_cfg.hidden_states == "offline" else ("validation",)
    reserve = stream_reserve_bytes(data_cfg)
    with open_engine() as extractor:
        dump = dump_hidden_states(extractor, samples, out_dir / "hidden_states", data_cfg, fingerprint, progress,
                                  log, splits=splits, reserve_bytes=reserve)
    return vocab_info, dump


def _build_vocab(train: list[dict], facts: dict, data_cfg: DataConfig, out_dir: Path, progress: ProgressFn) -> dict:
    """The draft vocabulary (top data.draft_vocab_size assistant tokens of the train split) in out_dir/vocab."""
    progress("vocab", 0, 1)
    _, vocab_info = build_or_load_draft_vocab(
        [s["input_ids"] for s in train], [s["loss_mask"] for s in train], data_cfg.draft_vocab_size,
        facts["vocab_size"], out_dir / "vocab",
    )
    progress("vocab", 1, 1)
    return vocab_info


def stream_reserve_bytes(data_cfg: DataConfig) -> int:
    """Disk the streamed train shards will take on this host (data.stream.disk_budget_gb), checked here with
    the validation shards' need; 0 unless streaming."""
    return int(data_cfg.stream.disk_budget_gb * 1e9) if data_cfg.hidden_states == "stream" else 0


# --------------------------------------------------------------------------- command line (the data host's entry)

SUMMARY_FILE = "summary.json"
API_KEY_ENV = "EAGLEOPS_REGENERATE_API_KEY"  # the regeneration key travels in the environment, never in argv


def _configs(path: Path) -> tuple[TargetConfig, DataConfig]:
    raw = json.loads(path.read_text())
    data = raw["data"]
    if os.environ.get(API_KEY_ENV):
        data["regenerate"]["api_key"] = os.environ[API_KEY_ENV]
    return TargetConfig.model_validate(raw["target"]), DataConfig.model_validate(data)


def main(argv: list[str] | None = None) -> int:
    """`python -m eagle3.data.generate --target-dir T --out-dir O --config C.json [--endpoint URL ...]
    [--samples-only | --plan]`: the data stage where the target is (data.host). Progress, log lines and the
    outcome are JSON lines on stdout; the summary is also written to O/summary.json."""
    import argparse

    parser = argparse.ArgumentParser(prog="eagle3.data.generate", description=main.__doc__)
    parser.add_argument("--target-dir", required=True)
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--config", required=True, help="JSON with the target and data config sections")
    parser.add_argument("--endpoint", action="append", default=[], help="a regeneration server's base URL")
    parser.add_argument("--samples-only", action="store_true", help="stop after samples and vocab (no capture)")
    parser.add_argument("--plan", action="store_true",
                        help="only check the settings against the target and report whether the samples are done")
    args = parser.parse_args(argv)
    target_cfg, data_cfg = _configs(Path(args.config))
    if args.plan:  # settings the target cannot take fail here, before any server is started for them
        _target_facts(Path(args.target_dir), target_cfg, data_cfg)
        ready = reusable_samples_meta(Path(args.target_dir), data_cfg, Path(args.out_dir)) is not None
        emit_event("done", samples_ready=ready)
        return 0
    if args.samples_only:
        data_cfg = data_cfg.model_copy(update={"hidden_states": "online"})
    urls = list(args.endpoint)
    try:
        summary = generate_dataset(
            Path(args.target_dir), target_cfg, data_cfg, Path(args.out_dir),
            on_progress=lambda stage, done, total: emit_event("progress", stage=stage, done=done, total=total),
            log=lambda message: emit_event("log", message=message),
            open_endpoints=(lambda: contextlib.nullcontext(urls)) if urls else None,
        )
    except (ValueError, OSError, RuntimeError) as exc:
        emit_event("error", message=f"{type(exc).__name__}: {exc}")
        raise
    atomic_write_text(Path(args.out_dir) / SUMMARY_FILE, json.dumps(summary, indent=2))
    emit_event("done", summary=SUMMARY_FILE)
    return 0


if __name__ == "__main__":
    # torch and transformers loaded (~a million long-lived objects, walked over and over by the collector while
    # they loaded: ~0.8 s of each job's start): frozen, so no later collection walks them again.
    gc.freeze()
    gc.enable()
    sys.exit(main())
