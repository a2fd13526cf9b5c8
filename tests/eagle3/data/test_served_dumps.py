"""eagle3.data.served_dumps on dump files written by SGLang 0.5.23's own dump code.

The answers are real: the reference server (tests/eagle3/served_traffic.py) serves the session's
tiny target, and SGLang's own `GenerateReqInput` (built from the same request bodies and
normalized by SGLang), `ConfigureLoggingReq`, `TokenizerManager.configure_logging`,
`dump_requests` and `_dump_data_to_file` write them, run once per module in the CPU SGLang venv.
The aborted answer's finish reason is SGLang's own `FINISH_ABORT().to_json()`.

Foreign-class and truncated files are made from those real dumps; the foreign payload shells out
to `touch` a marker file: the restricted unpickler must refuse it before anything runs, while the
stock unpickler runs it (checked in a subprocess, so the test fails if the payload were inert).
"""

from __future__ import annotations

import json
import os
import pickle
import pickletools
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

from eagle3.data.samples import SAMPLES_FILE, SAMPLES_META, read_samples
from eagle3.data.served_dumps import (
    ADMITTED,
    GenerateReqInputRecord,
    SGLangRecord,
    TorchDtypeRecord,
    load_dump,
    read_served_dumps,
    sample_sha256,
    write_served_samples,
)
from tests.eagle3.served_traffic import build_random_draft, post, reference_server, stopping_sampling

MAX_LENGTH = 64

SGLANG_DUMP_SCRIPT = textwrap.dedent(
    """
    # Runs in the CPU SGLang venv: SGLang's own request objects and dump code write the dump files.
    import asyncio, json, sys, types
    from sglang.srt.managers.io_struct import ConfigureLoggingReq, GenerateReqInput
    from sglang.srt.managers.schedule_batch import FINISH_ABORT
    from sglang.srt.managers.tokenizer_manager import TokenizerManager
    from sglang.srt.observability import req_time_stats
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import prepare_server_args

    folder, target, draft, entries_file, threshold = sys.argv[1:6]
    server_args = prepare_server_args(["--model-path", target, "--device", "cpu", "--speculative-algorithm",
                                       "EAGLE3", "--speculative-draft-model-path", draft])
    server_args.resolve_once()
    get_context().set_server_args(server_args)
    manager = TokenizerManager.__new__(TokenizerManager)  # the dump path only: no model, no scheduler
    manager.server_args, manager.model_path = server_args, target
    manager.served_model_name = target
    manager.init_request_logging_and_dumping()
    manager.configure_logging(ConfigureLoggingReq(dump_requests_folder=folder, dump_requests_threshold=int(threshold)))

    def state_of(obj, created, finished):
        stats = req_time_stats.APIServerReqTimeStats()
        offset = req_time_stats.global_diff_realtime_monotonic  # the dump turns monotonic times into epoch
        stats.created_time, stats.finished_time = created - offset, finished - offset
        return types.SimpleNamespace(obj=obj, time_stats=stats)

    async def main():
        for entry in json.load(open(entries_file)):
            obj = GenerateReqInput(**entry["body"])
            obj.normalize_batch_and_arguments()
            subs = [obj] if obj.is_single else [obj[i] for i in range(len(obj.rid))]
            for sub, out in zip(subs, entry["answers"]):
                if entry.get("abort"):
                    out["meta_info"]["finish_reason"] = FINISH_ABORT("Client disconnected", 400).to_json()
                manager.dump_requests(state_of(sub, entry["created"], entry["finished"]), out)
        pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.gather(*pending)

    asyncio.run(main())
    """
)


@pytest.fixture(scope="module")
def served(tiny_target_dir, tmp_path_factory, sglang_python):
    """(dump folder written by SGLang, what the reference server served, epoch t0 of the entries)."""
    root = tmp_path_factory.mktemp("served")
    draft = build_random_draft(tiny_target_dir, root / "draft")
    with reference_server(tiny_target_dir, draft) as (url, _):
        entries, expected = served_entries(url, t0=time.time() - 3600)
    entries_file = root / "entries.json"
    entries_file.write_text(json.dumps(entries))
    folder = root / "dumps"
    # one file: two dumps within a second share SGLang's file name, and the second overwrites the first
    threshold = sum(len(e["answers"]) for e in entries)
    proc = subprocess.run([str(sglang_python), "-c", SGLANG_DUMP_SCRIPT, str(folder), str(tiny_target_dir),
                           str(draft), str(entries_file), str(threshold)], capture_output=True, text=True, timeout=300,
                          cwd=root, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return folder, expected, entries


def served_entries(url: str, t0: float) -> tuple[list[dict], dict]:
    """Request bodies, the server's answers and their times; plus rid -> (prompt ids, output ids) of the
    answers that must come back as samples. One hour of traffic from t0, one entry a minute."""
    ids_a, ids_b = [5, 17, 42, 9, 11], [30, 31, 32]
    bodies = [
        {"rid": "ids-a", "input_ids": ids_a},
        {"rid": "text-ids", "text": "def main():", "return_prompt_token_ids": True},
        {"rid": "text-only", "text": "import os"},  # no ids in SGLang's dump: left out
        {"rid": "batch", "input_ids": [ids_b, [40, 41, 42, 43]]},
        {"rid": "dup", "input_ids": ids_a},  # the same answer as ids-a: a duplicate
        {"rid": "long", "input_ids": list(range(1, MAX_LENGTH + 1))},  # prompt of max_length tokens
        {"rid": "late", "input_ids": [60, 61, 62]},  # finished after the window the tests use
    ]
    entries, expected = [], {}
    for n, body in enumerate(bodies):
        prompt = {k: v for k, v in body.items() if k in ("text", "input_ids")}
        seed = 1000 if body["rid"] == "dup" else 1000 + n  # dup: ids-a's prompt and seed, so ids-a's answer
        sampling = stopping_sampling(url, prompt if "text" in prompt or not isinstance(body["input_ids"][0], list)
                                     else {"input_ids": body["input_ids"][0]}, seed=seed)
        answer = post(url, "/generate", {**body, "sampling_params": sampling})
        assert answer.status_code == 200, answer.text
        answers = answer.json() if isinstance(answer.json(), list) else [answer.json()]
        entries.append({"body": {**body, "sampling_params": sampling}, "answers": answers,
                        "created": t0 + 60 * n, "finished": t0 + 60 * n + 1})
        for i, out in enumerate(answers):
            prompt_ids = out.get("prompt_token_ids") or (body["input_ids"][i] if "batch" in body["rid"]
                                                         else body.get("input_ids"))
            expected[f"{body['rid']}_{i}" if len(answers) > 1 else body["rid"]] = (prompt_ids, out["output_ids"])
    length_cut = {"input_ids": [7, 8, 9], "sampling_params": {"temperature": 0, "max_new_tokens": 3,
                                                              "ignore_eos": True}}
    cut = post(url, "/generate", {**length_cut, "rid": "cut"}).json()
    entries.append({"body": {**length_cut, "rid": "cut"}, "answers": [cut], "created": t0 + 600, "finished": t0 + 601})
    aborted = {"rid": "aborted", "input_ids": [12, 13, 14], "sampling_params": {"temperature": 0}}
    entries.append({"body": aborted, "answers": [dict(cut, meta_info=dict(cut["meta_info"], id="aborted"))],
                    "abort": True, "created": t0 + 660, "finished": t0 + 661})
    return entries, expected


def test_sglangs_own_dumps_give_the_ids_served(served):
    folder, expected, entries = served
    files = sorted(folder.glob("*.pkl"))
    assert files, "SGLang wrote no dump"
    result = read_served_dumps(folder, max_length=MAX_LENGTH)
    assert result.files_read == [str(f) for f in files] and not result.files_skipped and not result.files_refused
    got = {s.rid: (s.prompt_ids, s.output_ids) for s in result.samples}
    kept = {"ids-a", "text-ids", "batch_0", "batch_1"}
    assert got == {rid: expected[rid] for rid in kept | {"late"}}
    for sample in result.samples:  # served settings and content address kept with each sample
        assert sample.sampling_params == next(e["body"]["sampling_params"] for e in entries
                                              if sample.rid.startswith(e["body"]["rid"]))
        assert sample.finish_reason["type"] == "stop" and sample.sha256 == sample_sha256(sample.prompt_ids,
                                                                                         sample.output_ids)
    assert next(s for s in result.samples if s.rid == "text-ids").text == "def main():"


def test_every_left_out_request_is_counted_by_reason(served):
    folder, _, entries = served
    late = next(e for e in entries if e["body"]["rid"] == "late")
    # the window [ids-a's finish, late's finish): late, the length-cut and the aborted answer fall after it
    window = read_served_dumps(folder, max_length=MAX_LENGTH, since=entries[0]["finished"], until=late["finished"])
    assert +window.excluded == Counter(out_of_window=3, no_token_ids=1, duplicate=1, too_long=1)
    assert "late" not in {s.rid for s in window.samples}
    open_ended = read_served_dumps(folder, max_length=MAX_LENGTH, since=entries[0]["finished"])
    assert +open_ended.excluded == Counter(length=1, aborted=1, no_token_ids=1, duplicate=1, too_long=1)
    # ids-a before the window: its twin "dup" is now the first of its content, so it is kept
    later = read_served_dumps(folder, max_length=MAX_LENGTH, since=entries[1]["finished"])
    assert later.excluded["out_of_window"] == 1 and later.excluded["duplicate"] == 0
    assert "dup" in {s.rid for s in later.samples} and "ids-a" not in {s.rid for s in later.samples}


def test_the_admitted_names_cover_sglangs_dumps_and_nothing_runs(served):
    folder, _, _ = served
    named = {name for f in folder.glob("*.pkl") for name in pickle_globals(f.read_bytes())}
    assert ("sglang.srt.managers.io_struct", "GenerateReqInput") in named
    assert ("sglang.srt.server_args", "_rebuild_server_args") in named
    unlisted = {n for n in named if n not in ADMITTED}
    assert unlisted == {("transformers.models.llama.configuration_llama", "LlamaConfig")}  # the model's own class
    payload = load_dump(sorted(folder.glob("*.pkl"))[0])
    assert all(type(entry[0]) is GenerateReqInputRecord for entry in payload["requests"])
    kinds = reachable_types(payload)
    assert {t for t in kinds if not issubclass(t, (SGLangRecord, TorchDtypeRecord))} <= PLAIN_TYPES
    assert {t.__name__ for t in kinds if issubclass(t, SGLangRecord)} >= {"ServerArgsRecord", "ModelConfig",
                                                                          "LlamaConfig", "GenerateReqInputRecord"}


PLAIN_TYPES = {dict, list, tuple, set, frozenset, str, bytes, int, float, bool, type(None)}


def reachable_types(value) -> set[type]:
    """The types of everything reachable from value, through containers and stand-ins' args and state."""
    seen, stack, kinds = set(), [value], set()
    while stack:
        item = stack.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        kinds.add(type(item))
        if isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, (list, tuple, set, frozenset)):
            stack.extend(item)
        elif isinstance(item, SGLangRecord):
            stack.extend([item.args, item.kwargs, item.state])
    return kinds


def pickle_globals(data: bytes) -> set[tuple[str, str]]:
    """(module, name) of every GLOBAL / STACK_GLOBAL in a pickle, following the memo for STACK_GLOBAL's strings."""
    memo, pushed, found = [], [], set()
    for op, arg, _ in pickletools.genops(data):
        if op.name == "MEMOIZE":
            memo.append(pushed[-1] if pushed else None)
        elif op.name in ("BINGET", "LONG_BINGET"):
            pushed.append(memo[arg])
        elif op.name in ("SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"):
            pushed.append(arg)
        elif op.name == "GLOBAL":
            found.add(tuple(arg.split(" ", 1)))
        elif op.name == "STACK_GLOBAL":
            found.add((pushed[-2], pushed[-1]))
            pushed.append(None)
        else:
            pushed.append(None)
    return found


class _Touch:
    """A pickle payload: unpickling it runs `touch <marker>` through os.system."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_foreign_class_refuses_its_file_by_name_without_running_it(served, tmp_path):
    folder, _, _ = served
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    good = sorted(folder.glob("*.pkl"))[0]
    (dumps / good.name).write_bytes(good.read_bytes())
    marker = tmp_path / "ran"
    evil = dumps / "9999-12-31_23-59-59.pkl"
    evil.write_bytes(pickle.dumps({"server_args": None, "config_updates": [], "resolved_config": None,
                                   "requests": [_Touch(marker)]}, protocol=4))
    lines = []
    result = read_served_dumps(dumps, max_length=MAX_LENGTH, log=lines.append)
    assert not marker.exists(), "the payload ran"
    assert lines == result.files_refused == [
        f"{evil.name}: refuses class {os.system.__module__}.system (not part of SGLang's request dump)"]
    assert result.files_read == [str(dumps / good.name)] and result.samples  # the other file is used
    # the payload is live: the stock unpickler runs it (in a child process)
    subprocess.run([sys.executable, "-c", "import pickle, sys; pickle.load(open(sys.argv[1], 'rb'))", str(evil)],
                   check=True, timeout=60)
    assert marker.exists()


def test_a_truncated_or_corrupt_dump_is_skipped_in_one_line_and_the_rest_are_used(served, tmp_path):
    folder, _, _ = served
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    real = sorted(folder.glob("*.pkl"))[0].read_bytes()
    (dumps / "2026-01-01_00-00-00.pkl").write_bytes(real)
    cut = dumps / "2026-01-01_00-00-01.pkl"
    cut.write_bytes(real[: len(real) // 2])  # what SGLang's in-place write looks like half-way
    garbage = dumps / "2026-01-01_00-00-02.pkl"
    garbage.write_bytes(b"\x80\x04not a pickle")
    lines = []
    result = read_served_dumps(dumps, max_length=MAX_LENGTH, log=lines.append)
    assert len(lines) == 2 and lines == result.files_skipped and not result.files_refused
    assert lines[0].startswith(f"{cut.name}: truncated or corrupt (") and lines[0].endswith("); skipped")
    assert lines[1].startswith(f"{garbage.name}: truncated or corrupt (")
    whole = read_served_dumps(folder, max_length=MAX_LENGTH)
    assert result.files_read == [str(dumps / "2026-01-01_00-00-00.pkl")]
    assert [s.sha256 for s in result.samples] == [s.sha256 for s in whole.samples] and whole.samples


def test_served_samples_are_written_as_the_data_stage_writes_them(served, tmp_path):
    folder, _, _ = served
    result = read_served_dumps(folder, max_length=MAX_LENGTH)
    meta = write_served_samples(result, tmp_path / "data", validation_fraction=0.5)
    samples = read_samples(tmp_path / "data" / SAMPLES_FILE)
    assert json.loads((tmp_path / "data" / SAMPLES_META).read_text()) == meta
    assert meta["source"] == "served" and meta["num_samples"] == len(samples) == len(result.samples)
    assert {s["split"] for s in samples} == {"train", "validation"}
    for sample, served_sample in zip(samples, result.samples):
        n = len(served_sample.prompt_ids)
        assert sample["input_ids"] == served_sample.prompt_ids + served_sample.output_ids
        assert sample["loss_mask"] == [0] * n + [1] * len(served_sample.output_ids)  # the answer only
        assert sample["sha256"] == served_sample.sha256 and sample["num_prompt_tokens"] == n
        assert sample["served"]["sampling_params"] == served_sample.sampling_params
    again = write_served_samples(read_served_dumps(folder, max_length=MAX_LENGTH), tmp_path / "again", 0.5)
    assert again["fingerprint"] == meta["fingerprint"] and again["sha256"] == meta["sha256"]
