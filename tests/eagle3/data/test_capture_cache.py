"""The capture cache of served nights (eagle3.data.capture_cache, eagle3.data.served_capture): content
addresses, hits and misses, the replay draw, "no new traffic", eviction by age within the budget, a damaged
shard never trusted, another target's layers never a hit -- through generate_dataset on dump files written
here (tests/eagle3/served_nights.py), with every expected count taken from what was written."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch

from eagle3.config import DataConfig, StreamConfig, TargetConfig
from eagle3.data.cache_rows import shard_from_cache
from eagle3.data.capture_cache import capture_key, open_cache, sample_address
from eagle3.data.datasets import HiddenStateDataset
from eagle3.data.dump import capture_shard
from eagle3.data.engines import open_capture_engine
from eagle3.data.generate import generate_dataset
from eagle3.data.samples import read_samples
from tests.eagle3.served_nights import day_of_traffic, tokens_of, write_dump

MAX_LENGTH = 32
DAY1, DAY2 = day_of_traffic(1, 12), day_of_traffic(2, 6)


def served_data(dumps: Path, cache: Path, **served) -> DataConfig:
    return DataConfig.model_validate({
        "source": "served", "served": {"dumps": str(dumps), "cache": str(cache), **served}, "max_length": MAX_LENGTH,
        "validation_fraction": 0.2, "draft_vocab_size": 64, "hidden_states_dtype": "float32", "shard_size": 4})


def night(tiny_target_dir: Path, data: DataConfig, out: Path, target: TargetConfig | None = None) -> dict:
    lines: list[str] = []
    summary = generate_dataset(tiny_target_dir, target or TargetConfig(), data, out, log=lines.append)
    return summary | {"lines": lines}


@pytest.fixture(scope="module")
def nights(tiny_target_dir, tmp_path_factory):
    """Night 1 on day 1's dump; night 2 once day 2's dump came (replay 0.5); night 3 with nothing new."""
    root = tmp_path_factory.mktemp("served-nights")
    dumps, cache = root / "dumps", root / "cache"
    write_dump(dumps, "day1", DAY1)
    first = night(tiny_target_dir, served_data(dumps, cache), root / "night1")
    write_dump(dumps, "day2", DAY2)
    second = night(tiny_target_dir, served_data(dumps, cache, replay_fraction=0.5), root / "night2")
    third = night(tiny_target_dir, served_data(dumps, cache, replay_fraction=0.5), root / "night3")
    return root, first, second, third


def test_the_address_is_the_ids_and_mask_and_the_key_what_decides_the_states():
    assert sample_address([1, 2, 3], [0, 1, 1]) == sample_address([1, 2, 3], [0, 1, 1])
    assert sample_address([1, 2, 3], [0, 1, 1]) != sample_address([1, 2, 3], [0, 0, 1])
    assert sample_address([1, 2, 3], [0, 1, 1]) != sample_address([1, 2, 4], [0, 1, 1])
    key = capture_key("t", [1, 3], "bfloat16", "hf")
    assert len({key, capture_key("u", [1, 3], "bfloat16", "hf"), capture_key("t", [1, 4], "bfloat16", "hf"),
                capture_key("t", [1, 3], "float32", "hf"), capture_key("t", [1, 3], "bfloat16", "sglang")}) == 5


def test_a_second_night_captures_only_the_new_days_samples(nights):
    _, first, second, _ = nights
    one, two = first["served"]["cache"], second["served"]["cache"]
    assert (one["new_samples"], one["known_samples"], one["replayed_samples"]) == (len(DAY1), 0, 0)
    assert one["tokens_captured"] == tokens_of(DAY1, MAX_LENGTH)
    assert (two["new_samples"], two["known_samples"]) == (len(DAY2), len(DAY1))
    assert two["tokens_captured"] == tokens_of(DAY2, MAX_LENGTH)  # counted from the dumps written, not the cache
    assert two["samples"] == len(DAY1) + len(DAY2) and two["evicted_shards"] == 0
    assert second["no_new_traffic"] is None


def test_the_replay_fraction_of_older_samples_is_trained_on_seeded_and_recorded(nights):
    root, _, second, _ = nights
    record = second["served"]["cache"]
    assert record["replay_pool"] == len(DAY1) and record["replayed_samples"] == round(0.5 * len(DAY1))
    assert record["replay_seed"].startswith("0:")
    samples = read_samples(root / "night2" / "samples.jsonl")
    replayed = [s for s in samples if s.get("replayed")]
    day1 = {sample_address(*ids_and_mask(p, o)) for p, o in DAY1}
    assert len(replayed) == record["replayed_samples"] and {s["address"] for s in replayed} <= day1
    assert len(samples) == len(DAY2) + len(replayed)
    # training reads exactly the night's samples, the replayed ones from night 1's shards in the cache
    data = HiddenStateDataset(root / "night2", "train")
    train = [s for s in samples if s["split"] == "train"]
    assert sorted(tuple(data[i]["input_ids"].tolist()) for i in range(len(data))) == \
        sorted(tuple(s["input_ids"]) for s in train)
    old = HiddenStateDataset(root / "night1", "train")
    old_states = {tuple(old[i]["input_ids"].tolist()): old[i]["aux_hidden_states"] for i in range(len(old))}
    for i in range(len(data)):
        ids = tuple(data[i]["input_ids"].tolist())
        if ids in old_states:
            assert torch.equal(data[i]["aux_hidden_states"], old_states[ids])


def ids_and_mask(prompt: list[int], output: list[int]) -> tuple[list[int], list[int]]:
    return (prompt + output)[:MAX_LENGTH], ([0] * len(prompt) + [1] * len(output))[:MAX_LENGTH]


def test_a_night_without_new_samples_records_no_new_traffic_and_captures_nothing(nights):
    root, _, second, third = nights
    assert third["no_new_traffic"].startswith("no new traffic: 0 new samples")
    assert third["served"]["cache"]["tokens_captured"] == 0 and third["served"]["cache"]["new_samples"] == 0
    assert third["paths"]["hidden_states"] is None and third["paths"]["vocab"] is None
    assert not (root / "night3" / "hidden_states").exists()
    assert sum("no new traffic" in line for line in third["lines"]) == 1
    assert third["served"]["cache"]["samples"] == second["served"]["cache"]["samples"]


def test_other_aux_layers_are_another_space_and_capture_everything(nights, tiny_target_dir):
    root, *_ = nights
    data = served_data(root / "dumps", root / "cache")
    other = night(tiny_target_dir, data, root / "other-layers", TargetConfig(aux_layer_ids=[1, 3, 5]))
    assert other["served"]["cache"]["new_samples"] == len(DAY1) + len(DAY2)
    assert other["served"]["cache"]["dir"] != nights[1]["served"]["cache"]["dir"]


def test_a_damaged_or_half_written_shard_is_never_trusted(tiny_target_dir, tmp_path):
    dumps, cache = tmp_path / "dumps", tmp_path / "cache"
    write_dump(dumps, "day1", DAY1)
    first = night(tiny_target_dir, served_data(dumps, cache), tmp_path / "n1")
    space = Path(first["served"]["cache"]["dir"])
    index = json.loads((space / "index.json").read_text())["shards"]
    victim = sorted(index)[0]
    with (space / victim).open("r+b") as fh:  # cut short, as a disk error would
        fh.truncate((space / victim).stat().st_size - 8)
    (space / "nights" / "killed").mkdir()  # a capture a kill cut short: never listed
    (space / "nights" / "killed" / ".train-00000.safetensors.tmp").write_bytes(b"partial")
    again = night(tiny_target_dir, served_data(dumps, cache), tmp_path / "n2")
    record = again["served"]["cache"]
    assert record["dropped"] and victim in record["dropped"][0]
    assert record["new_samples"] == len(index[victim]["samples"])  # only the damaged shard's samples again
    assert not (space / "nights" / "killed").exists()


def test_the_budget_evicts_the_oldest_nights_first_never_what_tonight_reads(tiny_target_dir, tmp_path):
    dumps, cache = tmp_path / "dumps", tmp_path / "cache"
    write_dump(dumps, "day1", DAY1)
    first = night(tiny_target_dir, served_data(dumps, cache), tmp_path / "n1")
    one_night = first["served"]["cache"]["bytes"]
    write_dump(dumps, "day2", DAY2)
    budget = (one_night * 1.2) / 1e9  # room for about one night: night 1's shards must go for night 2's
    second = night(tiny_target_dir, served_data(dumps, cache, cache_budget_gb=budget), tmp_path / "n2")
    record = second["served"]["cache"]
    assert record["new_samples"] == len(DAY2) and record["evicted_shards"] > 0
    assert record["bytes"] <= record["budget_bytes"] and not record["over_budget"]
    with open_cache(cache, _key(first), print) as opened:
        shards_of = Counter(e["night"] for e in opened.shards.values())
    # the evicted shards are all night 1's (the oldest), night 2's are all kept
    assert shards_of[first["served"]["cache"]["night"]] == first["served"]["cache"]["shards"] - record["evicted_shards"]
    assert shards_of[record["night"]] == record["shards"] - shards_of[first["served"]["cache"]["night"]] > 0
    # a replay pins what it reads: nothing it needs is evicted even over the budget
    write_dump(dumps, "day3", day_of_traffic(3, 4))
    third = night(tiny_target_dir, served_data(dumps, cache, cache_budget_gb=budget / 4, replay_fraction=1.0),
                  tmp_path / "n3")
    assert third["served"]["cache"]["replayed_samples"] == third["served"]["cache"]["replay_pool"] > 0
    assert len(HiddenStateDataset(tmp_path / "n3", "train")) == sum(third["num_samples"].values()) - \
        third["num_samples"]["validation"]


def _key(summary: dict) -> str:
    return json.loads((Path(summary["served"]["cache"]["dir"]) / "space.json").read_text())["key"]


def test_a_streamed_night_names_cached_rows_and_the_stream_copies_what_a_capture_gives(tiny_target_dir, tmp_path):
    """data.hidden_states: stream on served traffic: the night's new samples are captured once into the cache,
    the dataset lists the validation split only, and each train sample names its cached row, from which the
    stream's capture side copies a shard (no forward) equal to what capturing it again gives."""
    dumps, cache = tmp_path / "dumps", tmp_path / "cache"
    write_dump(dumps, "day1", DAY1)
    data = served_data(dumps, cache).model_copy(update={"hidden_states": "stream",
                                                       "stream": StreamConfig(disk_budget_gb=1.0)})
    summary = night(tiny_target_dir, data, tmp_path / "n1")
    assert summary["served"]["cache"]["tokens_captured"] == tokens_of(DAY1, MAX_LENGTH)
    manifest = json.loads((tmp_path / "n1" / "hidden_states" / "manifest.json").read_text())
    assert manifest["splits"] == ["validation"]
    train = read_samples(tmp_path / "n1" / "samples.jsonl", "train")
    assert train and all(Path(s["cached"]["file"]).is_file() for s in train)
    copied = shard_from_cache(train)
    with open_capture_engine(tiny_target_dir, TargetConfig(), data, summary["aux_layer_ids"]) as extractor:
        captured = capture_shard(extractor, train, 4, torch.float32)
    assert list(copied) == list(captured)
    for key in captured:
        assert torch.equal(copied[key], captured[key]), key
