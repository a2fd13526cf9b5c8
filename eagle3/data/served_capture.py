"""A night of `data.source: served` with the capture cache (`eagle3.data.capture_cache`): which of the window's
samples are new, the replay draw of older ones, the capture of the new ones only, and the dataset that points
training at the cache.

In order, holding the cache's lock (one data stage per cache space at a time):
1. each window sample's content address (token ids + loss mask); new = not in the cache, known = cached;
2. fewer new samples than `data.served.min_new_samples`: "no new traffic" -- nothing captured, the summary says so;
3. the replay draw: `data.served.replay_fraction` of every cached sample that is not new tonight (earlier
   nights' traffic, the window's known samples included), seeded by data.seed and tonight's new samples;
4. the cache made to fit `data.served.cache_budget_gb` with tonight's capture (oldest nights evicted first,
   never a shard the replay reads);
5. samples.jsonl = the new samples + the replayed ones (their ids and mask read from the cache), the vocab;
6. the new samples captured into the cache (a night folder named by them: a killed capture resumes) and listed;
7. the dataset's hidden_states/manifest.json lists the cache's shard files (absolute paths, `rows` when only
   some of a shard's samples are trained on); `data.hidden_states: stream` lists the validation split only,
   and each train sample of samples.jsonl names its cached row (`cached`), which the stream's capture side
   copies instead of capturing again.

Nothing crosses to the orchestrator but the figures: the states stay in the cache on the data host.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from eagle3.config import DataConfig
from eagle3.data.cache_rows import read_cached_tokens
from eagle3.data.capture import FeatureExtractor
from eagle3.data.capture_cache import CachedRow, CaptureCache, Eviction, night_id, open_cache, sample_address
from eagle3.data.disk import _dump_bytes
from eagle3.data.dump import dump_hidden_states
from eagle3.data.files import LogFn, ProgressFn, atomic_write_text
from eagle3.data.samples import SAMPLES_FILE, SAMPLES_META, write_samples
from eagle3.data.shards import MANIFEST, SPLITS, plan_shards

CACHE_DIR_DEFAULT = "capture-cache"  # under the dataset folder when data.served.cache is unset (a notebook)
NIGHT_FILE = "night.json"  # in the dataset folder: the night's new samples, so a rerun after a kill resumes them


@dataclass
class NightPlan:
    """What a night trains on and captures."""

    night: str  # the capture folder's name (from the new samples' addresses)
    new: list[dict]  # window samples not in the cache, in window order
    known: int  # window samples already cached
    replay: list[tuple[str, CachedRow]]  # (address, where) of the replayed samples
    pool: int  # cached samples the replay drew from
    seed: str

    @property
    def new_tokens(self) -> int:
        return sum(len(s["input_ids"]) for s in self.new)


def uses_capture_cache(data_cfg: DataConfig) -> bool:
    """Served samples whose states are captured (offline or streamed) go through the cache."""
    return data_cfg.source == "served" and data_cfg.hidden_states != "online"


def plan_night(cache: CaptureCache, samples: list[dict], data_cfg: DataConfig,
               resumed: frozenset[str] = frozenset()) -> NightPlan:
    """Steps 1 and 3 of the module docstring; sets each sample's `address`. `resumed`: the new samples an
    earlier try of this same data stage planned (`NIGHT_FILE`): still new, though it may have listed them."""
    for sample in samples:
        sample["address"] = sample_address(sample["input_ids"], sample["loss_mask"])
    cached = cache.rows()
    new = [s for s in samples if s["address"] not in cached or s["address"] in resumed]
    night = night_id(s["address"] for s in new)
    tonight = {s["address"] for s in new}
    pool = sorted(a for a in cached if a not in tonight)
    seed = f"{data_cfg.seed}:{night}"
    chosen = random.Random(seed).sample(pool, round(data_cfg.served.replay_fraction * len(pool)))
    replay = sorted(((a, cached[a]) for a in chosen), key=lambda item: (item[1].shard, item[1].row))
    return NightPlan(night, new, len(samples) - len(new), replay, len(pool), seed)


def capture_served_night(
    samples: list[dict], meta: dict, facts: dict, key: str, data_cfg: DataConfig, out_dir: Path,
    open_engine: Callable[[], AbstractContextManager[FeatureExtractor]], build_vocab: Callable[[list[dict]], dict],
    progress: ProgressFn, log: LogFn, reserve_bytes: int = 0,
) -> tuple[list[dict], dict, dict | None, dict | None]:
    """The module docstring's steps for the window's `samples` (samples.jsonl as the served source wrote it).

    Args:
        meta: samples.meta.json's content; updated (sha256, counts) and returned with `served.cache` figures.
        facts: the target's hidden_size and hf_indices (the capture estimate).
        key: the capture key (`eagle3.data.capture_cache.capture_key`) of the target, layers, dtype, engine.
        build_vocab: the draft vocab from the final train samples -> its info.
        reserve_bytes: disk the host keeps free beside the capture (a stream's budget).
    Returns (samples, meta, vocab info, dump figures); vocab and dump are None with "no new traffic".
    """
    root = Path(data_cfg.served.cache) if data_cfg.served.cache else Path(out_dir) / CACHE_DIR_DEFAULT
    budget = int(data_cfg.served.cache_budget_gb * 1e9)
    with open_cache(root, key, log) as cache:
        plan = plan_night(cache, samples, data_cfg, _resumed_new(out_dir))
        if len(plan.new) < data_cfg.served.min_new_samples:
            return samples, _no_new_traffic(meta, plan, cache, budget, data_cfg, log), None, None
        atomic_write_text(Path(out_dir) / NIGHT_FILE, json.dumps({"night": plan.night,
                                                                  "new": [s["address"] for s in plan.new]}))
        incoming = _dump_bytes(plan.new_tokens, len(plan.new), facts["hidden_size"], len(facts["hf_indices"]),
                               data_cfg.hidden_states_dtype)
        pinned = {where.shard for _, where in plan.replay}
        evicted = cache.evict(budget, incoming, pinned, log, keep_night=plan.night)
        cache.remove_unlisted(keep_night=plan.night)
        final = _night_samples(cache, plan, data_cfg)
        meta = _write_night_samples(final, meta, out_dir)
        vocab_info = build_vocab([s for s in final if s["split"] == "train"])
        new = [s for s in final if not s.get("replayed")]
        dump = _capture_new(cache, plan, new, data_cfg, open_engine, progress, log, reserve_bytes)
        tonight = {name for name, e in cache.shards.items() if e["night"] == plan.night}
        late = cache.evict(budget, 0, pinned | tonight, log)
        dump = _write_dataset_manifest(cache, plan, final, data_cfg, out_dir, meta["sha256"], key, dump)
        meta["served"]["cache"] = _cache_record(cache, plan, budget, data_cfg, _sum(evicted, late), dump)
    atomic_write_text(Path(out_dir) / SAMPLES_META, json.dumps(meta, indent=2))
    _log_night(meta["served"]["cache"], log)
    return final, meta, vocab_info, dump


def _resumed_new(out_dir: Path) -> frozenset[str]:
    """The new samples an earlier try of this data stage (same dataset folder) planned, or none."""
    path = Path(out_dir) / NIGHT_FILE
    return frozenset(json.loads(path.read_text())["new"]) if path.is_file() else frozenset()


def _no_new_traffic(meta: dict, plan: NightPlan, cache: CaptureCache, budget: int, data_cfg: DataConfig,
                    log: LogFn) -> dict:
    reason = (f"no new traffic: {len(plan.new)} new samples in the window (data.served.min_new_samples "
              f"{data_cfg.served.min_new_samples}), {plan.known} already captured by earlier nights; nothing "
              "captured, nothing to train")
    log(reason)
    meta["served"]["cache"] = _cache_record(cache, plan, budget, data_cfg, Eviction(), None) | {"replayed_samples": 0}
    return meta | {"no_new_traffic": reason}


def _night_samples(cache: CaptureCache, plan: NightPlan, data_cfg: DataConfig) -> list[dict]:
    """The new samples (cached rows named once known: `cached`) and the replayed ones, ids 0..N-1.

    The new samples' rows are where `dump_hidden_states` will put them: `plan_shards`' order, so each train
    sample can name its row in the cache before the capture (the stream's capture side reads it)."""
    new = [dict(s) for s in plan.new]
    night_dir = cache.night_dir(plan.night)
    tokens = read_cached_tokens([(cache.path(where.shard), where.row) for _, where in plan.replay])
    replayed = [{"split": where.split, "messages": [], "input_ids": ids, "loss_mask": mask, "address": address,
                 "num_prompt_tokens": mask.index(1) if 1 in mask else len(mask), "replayed": True,
                 "cached": {"file": str(cache.path(where.shard)), "row": where.row}}
                for (address, where), (ids, mask) in zip(plan.replay, tokens, strict=True)]
    final = new + replayed
    for n, sample in enumerate(final):
        sample["id"] = n
    for name, members in plan_shards(new, data_cfg.shard_size, SPLITS):
        for row, sample in enumerate(members):
            sample["cached"] = {"file": str(night_dir / name), "row": row}
    return final


def _write_night_samples(final: list[dict], meta: dict, out_dir: Path) -> dict:
    """samples.jsonl rewritten with the night's samples; the meta's sha256 and counts follow."""
    if not any(s["split"] == "train" for s in final):
        raise ValueError(f"data.served: tonight's {len(final)} samples (new + replayed) are all in the validation "
                         "split; raise data.served.replay_fraction, widen the window or lower data.validation_fraction")
    sha = write_samples(final, Path(out_dir) / SAMPLES_FILE)
    return meta | {"sha256": sha, "num_conversations": len(final)}


def _capture_new(cache: CaptureCache, plan: NightPlan, new: list[dict], data_cfg: DataConfig,
                 open_engine: Callable[[], AbstractContextManager[FeatureExtractor]], progress: ProgressFn,
                 log: LogFn, reserve_bytes: int) -> dict | None:
    """The new samples' states into the night's cache folder, then listed in the index; None when none are new."""
    if not new:
        return None
    night_dir = cache.night_dir(plan.night)
    fingerprint = hashlib.sha256(json.dumps([cache.key, plan.night, data_cfg.shard_size]).encode()).hexdigest()
    with open_engine() as extractor:
        dump = dump_hidden_states(extractor, new, night_dir, data_cfg, fingerprint, progress, log, splits=SPLITS,
                                  reserve_bytes=reserve_bytes)
    manifest = json.loads((night_dir / MANIFEST).read_text())
    members = dict(plan_shards(new, data_cfg.shard_size, SPLITS))
    cache.register(plan.night, manifest, members, time.time(), _header(manifest))
    return dump


def _header(manifest: dict) -> dict:
    return {k: v for k, v in manifest.items() if k not in ("shards", "complete")}


def _write_dataset_manifest(cache: CaptureCache, plan: NightPlan, final: list[dict], data_cfg: DataConfig,
                            out_dir: Path, samples_sha: str, key: str, dump: dict | None) -> dict:
    """hidden_states/manifest.json of the dataset: the cache's shards and rows tonight trains on."""
    streamed = data_cfg.hidden_states == "stream"
    splits = ("validation",) if streamed else SPLITS
    rows: dict[str, list[int]] = {}
    for sample in final:
        if sample["split"] in splits:
            rows.setdefault(sample["cached"]["file"], []).append(sample["cached"]["row"])
    by_path = {str(cache.path(name)): entry for name, entry in cache.shards.items()}
    shards = [_manifest_entry(path, by_path[path], used) for path, used in rows.items()]
    payload = [samples_sha, key, data_cfg.shard_size] + (["stream"] if streamed else [])
    header = cache.header() or {}
    manifest = {**header, "splits": list(splits), "max_length": data_cfg.max_length,
                "fingerprint": hashlib.sha256(json.dumps(payload).encode()).hexdigest(),
                "num_samples": {sp: sum(s["split"] == sp for s in final) for sp in SPLITS},
                "num_tokens": {sp: sum(len(s["input_ids"]) for s in final if s["split"] == sp) for sp in SPLITS},
                "capture_cache": str(cache.directory), "complete": True, "shards": shards}
    directory = Path(out_dir) / "hidden_states"
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / MANIFEST, json.dumps(manifest, indent=2))
    total = sum(e["bytes"] for e in shards)
    dump = dump or {"estimate_bytes": 0, "bytes_written": 0, "shards_reused": 0, "engine": header.get("engine")}
    return dump | {"bytes_total": total, "shards": len(shards)}


def _manifest_entry(path: str, entry: dict, rows: list[int]) -> dict:
    """A dataset manifest's shard entry for a cache shard; `rows` only when some of its samples are left out."""
    used = sorted(rows)
    listed = {"file": path, "split": entry["split"], "num_samples": len(used),
              "num_tokens": sum(entry["samples"][r][1] for r in used), "sha256": entry["sha256"],
              "bytes": entry["bytes"]}
    return listed if len(used) == len(entry["samples"]) else listed | {"rows": used}


def _sum(*evictions: Eviction) -> Eviction:
    return Eviction(sum(e.shards for e in evictions), sum(e.samples for e in evictions),
                    sum(e.bytes for e in evictions))


def _cache_record(cache: CaptureCache, plan: NightPlan, budget: int, data_cfg: DataConfig, evicted: Eviction,
                  dump: dict | None) -> dict:
    """What the data summary and the stage's MLflow run record of the cache tonight."""
    size = cache.total_bytes()
    return {
        "dir": str(cache.directory), "night": plan.night,
        "new_samples": len(plan.new), "known_samples": plan.known, "replayed_samples": len(plan.replay),
        "replay_pool": plan.pool, "replay_fraction": data_cfg.served.replay_fraction, "replay_seed": plan.seed,
        "min_new_samples": data_cfg.served.min_new_samples,
        "tokens_captured": plan.new_tokens if dump is not None else 0,
        "bytes_captured": dump["bytes_written"] if dump else 0,
        "shards_resumed": dump.get("shards_reused", 0) if dump else 0,
        "bytes": size, "budget_bytes": budget, "over_budget": size > budget,
        "shards": len(cache.shards), "samples": sum(len(e["samples"]) for e in cache.shards.values()),
        "evicted_shards": evicted.shards, "evicted_samples": evicted.samples, "evicted_bytes": evicted.bytes,
        "dropped": list(cache.dropped),
    }


def _log_night(record: dict, log: LogFn) -> None:
    log(f"capture cache: {record['new_samples']} new samples captured ({record['tokens_captured']} tokens, "
        f"{record['bytes_captured'] / 1e9:.3f} GB), {record['known_samples']} known; replayed "
        f"{record['replayed_samples']} of {record['replay_pool']} earlier samples (replay_fraction "
        f"{record['replay_fraction']}, seed {record['replay_seed']}); cache {record['bytes'] / 1e9:.3f} GB of "
        f"{record['budget_bytes'] / 1e9:.3f} GB, {record['evicted_shards']} shards evicted")
    if record["over_budget"]:
        log(f"capture cache: over data.served.cache_budget_gb: tonight's training reads "
            f"{record['bytes'] / 1e9:.3f} GB of it; lower data.served.replay_fraction or raise the budget")
