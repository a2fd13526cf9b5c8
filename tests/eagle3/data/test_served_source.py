"""data.source: served -- the config's rules, the window, generate_dataset on the reference server's own
request dumps (the ids served become the samples, each left-out request counted, nothing regenerated),
the data stage's fingerprint taking new dump files, and the held-out check by ids.

One in-process reference server for the module (tests/eagle3/served_traffic.py) serves the session's
tiny target with a random draft and dumps its requests through /configure_logging, as SGLang does.
"""

from __future__ import annotations

import json
import shutil
import time
from datetime import datetime, timezone
from pathlib import Path

import pytest
from pydantic import ValidationError

import eagle3.data.generate as generate
from eagle3.config import DataConfig, ServedDumpsConfig, TargetConfig
from eagle3.data.generate import generate_dataset
from eagle3.data.samples import read_samples
from eagle3.data.served_source import listing_digest, local_listing, resolve_window
from eagle3.serving.bench_prompts import builtin_prompts, heldout_overlap, render_prompts
from tasks.config.schema import ExperimentConfig
from tasks.runner.specs import _host_listing, stage_inputs
from tasks.stages.bench.stage import bench_prompts
from tests.eagle3.served_traffic import build_random_draft, post, reference_server, stopping_sampling

MAX_LENGTH = 64


@pytest.fixture(scope="module")
def served(tiny_target_dir, tmp_path_factory):
    """(dump folder, {rid: (prompt ids, output ids, sampling)} of the clean answers, the chat prompt served)."""
    root = tmp_path_factory.mktemp("served-source")
    draft = build_random_draft(tiny_target_dir, root / "draft")
    chat = [{"role": "user", "content": "def add(a, b):"}]  # short: the prompt fits MAX_LENGTH
    [chat_ids] = render_prompts([chat], tiny_target_dir)
    with reference_server(tiny_target_dir, draft) as (url, scheduler):
        bodies = {"chat": {"input_ids": chat_ids}, "ids": {"input_ids": [5, 17, 42, 9, 11]},
                  "long": {"input_ids": list(range(1, MAX_LENGTH + 1))}, "text": {"text": "import os"}}
        sampling = {rid: stopping_sampling(url, body) for rid, body in bodies.items()}  # before dumping is on
        folder = root / "dumps"
        requests = [
            ("chat", bodies["chat"], sampling["chat"]),
            ("ids", bodies["ids"], sampling["ids"]),
            ("dup", bodies["ids"], sampling["ids"]),  # the same answer again: a duplicate
            ("cut", {"input_ids": [7, 8, 9]}, {"max_new_tokens": 3, "ignore_eos": True}),  # length
            ("text", bodies["text"], sampling["text"]),  # a text prompt without ids: no_token_ids
            ("long", bodies["long"], sampling["long"]),  # a clean answer to a prompt of max_length tokens: too_long
        ]
        resp = post(url, "/configure_logging", {"dump_requests_folder": str(folder),
                                                "dump_requests_threshold": len(requests)})
        assert resp.status_code == 200, resp.text
        answers = {}
        for rid, body, params in requests:
            out = post(url, "/generate", {"rid": rid, **body, "sampling_params": params})
            assert out.status_code == 200, out.text
            answers[rid] = (body.get("input_ids"), out.json()["output_ids"], params)
        deadline = time.monotonic() + 30
        while not list(folder.glob("*.pkl")) and time.monotonic() < deadline:
            scheduler.dumps.wait(timeout=30)
            time.sleep(0.05)
    assert len(list(folder.glob("*.pkl"))) == 1
    return folder, {rid: answers[rid] for rid in ("chat", "ids")}, chat


def served_data(folder: Path, **overrides) -> DataConfig:
    fields = {"source": "served", "served": {"dumps": str(folder)}, "max_length": MAX_LENGTH, "num_samples": 100,
              "validation_fraction": 0.0, "draft_vocab_size": 64, "hidden_states_dtype": "float32",
              # a regeneration server that does not exist: a call to it would fail the test
              "regenerate": {"backend": "sglang", "endpoint": "http://127.0.0.1:9"}}
    return DataConfig.model_validate(fields | overrides)


# --------------------------------------------------------------------------- config and window


@pytest.mark.parametrize("fields, named", [
    ({"source": "served"}, "data.served.dumps is required"),
    ({"source": "served", "served": {"dumps": "/d", "since": "2026-01-01T00:00:00Z", "newest_days": 2}},
     "data.served.since or data.served.newest_days"),
    ({"source": "served", "served": {"dumps": "/d", "since": "2026-01-02T00:00:00Z",
                                     "until": "2026-01-01T00:00:00Z"}}, "data.served.until"),
    ({"served": {"dumps": "/d"}}, "data.served is set but data.source is 'prompts'"),
    ({"source": "served", "served": {"dumps": "/d", "since": "2026-01-01T00:00:00"}}, "timezone"),
    ({"source": "served", "served": {"dumps": "/d", "newest_days": 0}}, "newest_days"),
    ({"source": "served", "served": {"dumps": "/d", "extra": 1}}, "extra"),
])
def test_bad_served_settings_fail_naming_the_field(fields, named):
    with pytest.raises(ValidationError) as err:
        DataConfig.model_validate(fields)
    assert err.value.error_count() == 1 and named in str(err.value)


def test_the_window_resolves_to_epoch_seconds_half_open():
    t = datetime(2026, 1, 2, 6, tzinfo=timezone.utc).timestamp()
    assert resolve_window(ServedDumpsConfig(), now=t) == (None, None)
    assert resolve_window(ServedDumpsConfig(newest_days=1), now=t) == (t - 86400, None)
    window = ServedDumpsConfig(since="2026-01-01T00:00:00+01:00", until="2026-01-02T00:00:00Z")
    assert resolve_window(window, now=t) == (datetime(2025, 12, 31, 23, tzinfo=timezone.utc).timestamp(),
                                             datetime(2026, 1, 2, tzinfo=timezone.utc).timestamp())
    with pytest.raises(ValueError, match="the window is empty"):  # newest_days past an until
        resolve_window(ServedDumpsConfig(newest_days=1, until="2026-01-01T00:00:00Z"), now=t)


# --------------------------------------------------------------------------- generate_dataset


@pytest.fixture(scope="module")
def dataset(served, tiny_target_dir, tmp_path_factory):
    folder, _, _ = served
    out = tmp_path_factory.mktemp("served-dataset")
    lines: list[str] = []
    patch = pytest.MonkeyPatch()
    for name in ("regenerate_local", "regenerate_http", "regenerate_sglang", "load_conversations"):
        patch.setattr(generate, name, _must_not_run(name))
    try:
        summary = generate_dataset(tiny_target_dir, TargetConfig(), served_data(folder), out, log=lines.append,
                                   open_endpoints=_must_not_run("open_endpoints"))
    finally:
        patch.undo()
    return out, summary, lines


def _must_not_run(name: str):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} called: data.source served regenerates nothing")
    return fail


def test_samples_are_the_ids_served_and_nothing_is_regenerated(served, dataset):
    _, answers, _ = served
    out, summary, _ = dataset
    samples = read_samples(out / "samples.jsonl")
    got = {s["served"]["rid"]: s for s in samples}
    assert set(got) == {"chat", "ids"}
    for rid, (prompt, output, _) in answers.items():
        assert got[rid]["input_ids"] == (prompt + output)[:MAX_LENGTH]
        assert got[rid]["loss_mask"] == ([0] * len(prompt) + [1] * len(output))[:MAX_LENGTH]
    assert summary["source"] == "served" and summary["regeneration"] == {}
    assert summary["num_samples"]["train"] == 2 and summary["hidden_states_bytes"] > 0  # shards captured from them
    assert summary["num_tokens"]["train"] == sum(len(s["input_ids"]) for s in samples)


def test_every_left_out_request_is_counted_and_the_settings_recorded(served, dataset):
    _, answers, _ = served
    _, summary, lines = dataset
    record = summary["served"]
    assert {k: v for k, v in record["excluded"].items() if v} == {"duplicate": 1, "length": 1, "no_token_ids": 1,
                                                                   "too_long": 1}
    assert summary["num_dropped"] == 4
    assert record["window"] == {"since": None, "until": None} and len(record["files_read"]) == 1
    assert record["num_output_tokens"] == sum(len(a[1]) for a in answers.values())
    expected = sorted(json.dumps(a[2], sort_keys=True) for a in answers.values())
    assert sorted(json.dumps(s["sampling_params"], sort_keys=True) for s in record["sampling_params"]
                  for _ in range(s["count"])) == expected
    assert any(line.startswith("served: read ") for line in lines)
    assert any("served: sampling settings" in line for line in lines)


def test_a_window_without_usable_samples_fails_in_one_line(served, tiny_target_dir, tmp_path):
    folder, _, _ = served
    data = served_data(folder, served={"dumps": str(folder), "until": "2000-01-01T00:00:00Z"})
    with pytest.raises(ValueError) as err:
        generate_dataset(tiny_target_dir, TargetConfig(), data, tmp_path, log=lambda line: None)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"data.served.dumps {folder}: no usable served sample")
    assert "1 files read" in message and "out_of_window 6" in message


# --------------------------------------------------------------------------- the stage's fingerprint


def test_the_data_stage_fingerprint_changes_when_a_dump_file_arrives(served, tmp_path):
    folder, _, _ = served
    copy = tmp_path / "dumps"
    shutil.copytree(folder, copy)
    cfg = ExperimentConfig.model_validate({"experiment": "served", "data": {"source": "served",
                                                                            "served": {"dumps": str(copy)}}})
    before = stage_inputs(cfg, "generate_data", {}, "v")
    assert stage_inputs(cfg, "generate_data", {}, "v") == before
    assert before["upstream"]["served_dumps"] == listing_digest(local_listing(copy))
    [first] = copy.glob("*.pkl")
    shutil.copy(first, copy / "2099-01-01_00-00-00.pkl")
    after = stage_inputs(cfg, "generate_data", {}, "v")
    assert after["config"] == before["config"] and after["upstream"]["served_dumps"] != before["upstream"][
        "served_dumps"]
    # a data host's listing (find over its executor; here the local one) digests the same as this machine's
    assert listing_digest(_host_listing(cfg, str(copy))) == after["upstream"]["served_dumps"]
    prompts = ExperimentConfig.model_validate({"experiment": "served"})
    assert "served_dumps" not in stage_inputs(prompts, "generate_data", {}, "v")["upstream"]


# --------------------------------------------------------------------------- held-out check by ids


def test_a_served_and_trained_prompt_is_found_by_its_ids(served, dataset, tiny_target_dir, tmp_path):
    _, _, chat = served
    out, _, _ = dataset
    samples = out / "samples.jsonl"
    other = builtin_prompts(3, seed=11)
    prompts = [*other, chat]
    assert heldout_overlap(prompts, samples) == []  # the text check cannot see served ids
    render = lambda ps: render_prompts(ps, tiny_target_dir)  # noqa: E731
    assert heldout_overlap(prompts, samples, render_ids=render) == [3]

    bench_file = tmp_path / "bench.jsonl"
    bench_file.write_text("".join(json.dumps({"messages": p}) + "\n" for p in prompts))
    cfg = ExperimentConfig.model_validate({"experiment": "served", "bench": {"prompts": str(bench_file),
                                                                             "num_prompts": 4}})
    with pytest.raises(ValueError, match=r"prompts \[4\] are training prompts"):
        bench_prompts(cfg, samples, tiny_target_dir)


def test_the_data_hosts_command_reads_the_dumps_where_it_runs(served, tiny_target_dir, tmp_path):
    """`python -m eagle3.data.generate` is what a data host runs, with the config uploaded as JSON
    (tasks/stages/data/host.py): the served source and its window survive the trip and the dumps are read there."""
    folder, answers, _ = served
    data = served_data(folder, served={"dumps": str(folder), "since": "2000-01-01T00:00:00+02:00"},
                       hidden_states="online")
    config = tmp_path / "host_data_config.json"
    config.write_text(json.dumps({"target": json.loads(TargetConfig().model_dump_json()),
                                  "data": json.loads(data.model_dump_json(exclude={"regenerate": {"api_key"}}))}))
    out = tmp_path / "dataset"
    assert generate.main(["--target-dir", str(tiny_target_dir), "--out-dir", str(out), "--config", str(config)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["served"]["window"]["since"] == "1999-12-31T22:00:00+00:00"
    assert summary["served"]["num_samples"] == len(answers)
