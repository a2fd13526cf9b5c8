"""The reference server's `/configure_logging` and request dumps over real HTTP: SGLang's request
fields, a 400 for a bad request, dumps every `threshold` finished requests in SGLang's file names
and payload shape, read back by eagleops' reader with the ids served, and loaded by SGLang
0.5.23's own classes with the stock unpickler.

One in-process server for the module (tests/eagle3/served_traffic.py) on the session's tiny
target with a random draft.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from transformers import AutoTokenizer

from eagle3.data.served_dumps import load_dump, read_served_dumps
from tests.eagle3.served_traffic import build_random_draft, post, reference_server, stopping_sampling

DUMP_NAME = re.compile(r"\d{4}-\d{2}-\d{2}_\d{2}-\d{2}-\d{2}(_\d+)?\.pkl")


@pytest.fixture(scope="module")
def server(tiny_target_dir, tmp_path_factory):
    draft = build_random_draft(tiny_target_dir, tmp_path_factory.mktemp("draft"))
    with reference_server(tiny_target_dir, draft) as (url, scheduler):
        yield url, scheduler


def _chat_ids(tokenizer, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def dumps_in(folder: Path, count: int, scheduler, timeout: float = 30) -> list[Path]:
    """The folder's dump files once `count` are there (written in the background)."""
    deadline = time.monotonic() + timeout
    while True:
        scheduler.dumps.wait(timeout=timeout)
        files = sorted(folder.glob("*.pkl"))
        if len(files) >= count or time.monotonic() > deadline:
            return files
        time.sleep(0.05)


@pytest.mark.parametrize("body, expected", [
    ({"dump_requests_threshold": 0}, "dump_requests_threshold"),
    ({"dump_requests_threshold": "often"}, "dump_requests_threshold"),
    ({"dump_requests_exclude_meta_keys": "hidden_states"}, "dump_requests_exclude_meta_keys"),
    ({"log_level": "loud"}, "log_level: unknown level 'loud'"),
])
def test_a_bad_configure_logging_request_is_a_400_naming_the_field(server, body, expected):
    url, scheduler = server
    resp = post(url, "/configure_logging", body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["object"] == "error" and expected in resp.json()["message"]
    assert not scheduler.dumps.enabled


def test_a_dump_folder_that_cannot_be_created_is_a_400(server, tmp_path):
    url, scheduler = server
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    resp = post(url, "/configure_logging", {"dump_requests_folder": str(blocker / "dumps")})
    assert resp.status_code == 400 and "dump_requests_folder: cannot create" in resp.json()["message"]
    assert httpx.get(url + "/configure_logging", timeout=30).status_code == 400  # GET with no body, as SGLang
    assert not scheduler.dumps.enabled


def test_dumps_hold_every_endpoint_with_the_ids_served(server, tmp_path, tiny_target_dir):
    url, scheduler = server
    ids_body = {"rid": "ids-1", "input_ids": [5, 17, 42, 9, 11]}
    text_body = {"rid": "text-1", "text": "def main():", "return_prompt_token_ids": True}
    sampling = {b["rid"]: stopping_sampling(url, b) for b in (ids_body, text_body)}  # before dumping is on
    folder = tmp_path / "dumps"
    resp = post(url, "/configure_logging", {"dump_requests_folder": str(folder), "dump_requests_threshold": 2,
                                            "log_requests": False, "crash_dump_folder": None, "ignored_key": 1})
    assert resp.status_code == 200 and resp.content == b""

    answers = {b["rid"]: post(url, "/generate", {**b, "sampling_params": sampling[b["rid"]]}).json()
               for b in (ids_body, text_body)}
    messages = [{"role": "user", "content": "hello"}]
    chat = post(url, "/v1/chat/completions", {"messages": messages, "max_tokens": 4, "temperature": 0}).json()
    completion = post(url, "/v1/completions", {"prompt": "import os", "max_tokens": 4, "temperature": 0}).json()
    files = dumps_in(folder, 2, scheduler)
    post(url, "/configure_logging", {"dump_requests_folder": ""})  # off again for the other tests

    assert len(files) == 2 and all(DUMP_NAME.fullmatch(f.name) for f in files), files
    payload = load_dump(files[0])
    assert list(payload) == ["server_args", "config_updates", "resolved_config", "requests"]
    assert isinstance(payload["server_args"], dict) and payload["server_args"]["model_path"] == str(tiny_target_dir)
    entries = {obj.fields()["rid"]: (obj.fields(), out) for f in files for obj, out, _, _ in load_dump(f)["requests"]}
    assert set(entries) == {"ids-1", "text-1", chat["id"], completion["id"]}

    result = read_served_dumps(folder, max_length=256)
    got = {s.rid: (s.prompt_ids, s.output_ids) for s in result.samples}
    assert got["ids-1"] == (ids_body["input_ids"], answers["ids-1"]["output_ids"])
    assert got["text-1"] == (answers["text-1"]["prompt_token_ids"], answers["text-1"]["output_ids"])
    assert answers["text-1"]["prompt_token_ids"] and entries["text-1"][0]["input_ids"] is None

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    chat_obj, chat_out = entries[chat["id"]]
    assert chat_obj["input_ids"] == _chat_ids(tokenizer, messages) and chat_obj["text"] is None
    assert chat_out["text"] == chat["choices"][0]["message"]["content"]
    assert len(chat_out["output_ids"]) == chat["usage"]["completion_tokens"]
    completion_obj, _ = entries[completion["id"]]
    assert completion_obj["text"] == "import os" and completion_obj["input_ids"] is None
    # a length-cut answer is left out as such; a clean text completion for lack of ids (SGLang dumps none either)
    chat_reason = "length" if chat["choices"][0]["finish_reason"] == "length" else None
    completion_reason = "length" if completion["choices"][0]["finish_reason"] == "length" else "no_token_ids"
    expected = Counter(r for r in (chat_reason, completion_reason) if r)
    assert +result.excluded == expected
    if chat_reason is None:
        assert got[chat["id"]] == (chat_obj["input_ids"], chat_out["output_ids"])


def test_dumps_load_with_sglangs_own_classes_and_stock_unpickler(server, tmp_path, sglang_python):
    url, scheduler = server
    body = {"input_ids": [7, 8, 9, 10], "rid": "stock-1"}
    sampling = stopping_sampling(url, body)
    folder = tmp_path / "dumps"
    on = post(url, "/configure_logging", {"dump_requests_folder": str(folder), "dump_requests_threshold": 1})
    assert on.status_code == 200
    out = post(url, "/generate", {**body, "sampling_params": sampling}).json()
    files = dumps_in(folder, 1, scheduler)
    post(url, "/configure_logging", {"dump_requests_folder": ""})
    script = (
        "import json, pickle, sys\n"
        "from sglang.srt.managers.io_struct import GenerateReqInput\n"
        "data = pickle.load(open(sys.argv[1], 'rb'))\n"
        "obj, out, created, finished = data['requests'][0]\n"
        "assert type(obj) is GenerateReqInput, type(obj)\n"
        "print(json.dumps({'rid': obj.rid, 'input_ids': obj.input_ids, 'sampling_params': obj.sampling_params,\n"
        "                  'return_hidden_states': obj.return_hidden_states, 'output_ids': out['output_ids'],\n"
        "                  'finish_reason': out['meta_info']['finish_reason'], 'keys': sorted(data)}))\n"
    )
    proc = subprocess.run([str(sglang_python), "-c", script, str(files[0])], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert loaded["rid"] == "stock-1" and loaded["input_ids"] == body["input_ids"]
    assert loaded["output_ids"] == out["output_ids"] and loaded["finish_reason"]["type"] == "stop"
    assert loaded["return_hidden_states"] is False  # a field we do not write keeps SGLang's class default
    assert loaded["keys"] == ["config_updates", "requests", "resolved_config", "server_args"]


def test_health_checks_are_not_dumped_and_an_empty_folder_stops_dumping(server, tmp_path):
    url, scheduler = server
    folder = tmp_path / "dumps"
    on = post(url, "/configure_logging", {"dump_requests_folder": str(folder), "dump_requests_threshold": 1})
    assert on.status_code == 200
    assert httpx.get(url + "/health_generate", timeout=30).status_code == 200
    assert post(url, "/configure_logging", {"dump_requests_folder": ""}).is_success
    assert post(url, "/generate", {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 2}}).is_success
    scheduler.dumps.wait(timeout=30)
    assert list(folder.glob("*.pkl")) == []
