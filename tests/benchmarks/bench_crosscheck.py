"""SGLang's own benchmark client against our reference server: figures from a client nobody here wrote.

    .venv/bin/python tests/benchmarks/bench_crosscheck.py [--sglang-python VENV/bin/python]
        [--target DIR --draft DIR] [--spec 3/1/4] [--num-prompts 8] [--output-len 64]

Starts `python -m eagle3.serve` on 127.0.0.1 (the target and EAGLE-3 draft given, or a tiny
random Llama target with its BPE tokenizer and a random draft built like tests/eagle3/serving/test_serve_http.py
does), writes a local ShareGPT-format JSON of builtin held-out chat prompts (SGLang's own
sharegpt/random datasets download ShareGPT from the Hub, which is not reachable here), and runs
`python -m sglang.benchmark.serving --backend sglang` from the CPU SGLang venv
(infra/install-sglang-cpu.sh) against it, offline (`--model`/`--tokenizer` = the local target
dir, HF_HUB_OFFLINE=1). Prints the exact command and bench_serving's output tok/s, TTFT, ITL and
accept length (read back from its --output-file). Not collected by pytest; figures go in
tests/benchmarks/NOTES_crosscheck.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from eagle3.data.prompts import builtin_conversations  # noqa: E402

DEFAULT_SGLANG_PYTHON = Path.home() / ".cache" / "eagleops" / "sglang-cpu-venv" / "bin" / "python"
SERVER_START_TIMEOUT_S = 180
CORPUS_MODULES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py")
REPORTED = ("completed", "duration", "total_output_tokens", "output_throughput", "mean_ttft_ms", "median_ttft_ms",
            "mean_itl_ms", "median_itl_ms", "mean_tpot_ms", "mean_e2e_latency_ms", "accept_length")


def build_tiny_model_dirs(root: Path) -> tuple[Path, Path]:
    """Random tiny Llama target (trained BPE tokenizer + chat template) and a random EAGLE-3 draft."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from eagle3.data.tiny_target import CorpusFile, stop_token_ids, train_tokenizer
    from eagle3.draft.model import DraftModelConfig, Eagle3DraftModel
    from eagle3.export import export_sglang

    stdlib = Path(json.__file__).parents[1]
    tokenizer = train_tokenizer([CorpusFile(m, (stdlib / m).read_text()) for m in CORPUS_MODULES], vocab_size=320)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_token_ids(tokenizer),
                      pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True)
    target_dir, draft_dir = root / "target", root / "draft"
    LlamaForCausalLM(cfg).save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir, save_jinja_files=False)
    GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=stop_token_ids(tokenizer),
                     pad_token_id=tokenizer.pad_token_id).save_pretrained(target_dir)
    dcfg = DraftModelConfig.from_target_config(cfg.to_dict(), draft_vocab_size=len(tokenizer), aux_layer_ids=[0, 1, 2])
    export_sglang(Eagle3DraftModel(dcfg), json.loads((target_dir / "config.json").read_text()), draft_dir,
                  dtype="float32")
    return target_dir, draft_dir


def write_sharegpt(path: Path, n: int, seed: int) -> Path:
    """ShareGPT layout bench_serving reads: [{"conversations": [{"from": "human"|"gpt", "value": ...}]}]."""
    rows = []
    for messages in builtin_conversations(n, seed):
        user = next(m["content"] for m in messages if m["role"] == "user")
        answer = next(m["content"] for m in messages if m["role"] == "assistant")
        rows.append({"id": f"eagleops-{len(rows)}",
                     "conversations": [{"from": "human", "value": user}, {"from": "gpt", "value": answer}]})
    path.write_text(json.dumps(rows))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: Path, draft: Path, spec: str, port: int, log: Path) -> subprocess.Popen:
    argv = [sys.executable, "-m", "eagle3.serve", "--model-path", str(target), "--host", "127.0.0.1",
            "--port", str(port), "--device", "cpu", "--max-running-requests", "4"]
    if spec != "none":
        steps, topk, draft_tokens = spec.split("/")
        argv += ["--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft),
                 "--speculative-num-steps", steps, "--speculative-eagle-topk", topk,
                 "--speculative-num-draft-tokens", draft_tokens]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    deadline = time.time() + SERVER_START_TIMEOUT_S
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"eagle3.serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise RuntimeError(f"eagle3.serve not healthy after {SERVER_START_TIMEOUT_S} s:\n{log.read_text()[-3000:]}")


def stop_server(proc: subprocess.Popen) -> None:
    """SIGTERM the server's process group, SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=5)


def bench_serving_argv(sglang_python: Path, port: int, target: Path, dataset: Path, result: Path,
                       num_prompts: int, output_len: int, seed: int, chat_template: bool) -> list[str]:
    """The bench_serving command line; every flag here is needed to run it offline and measured."""
    return [str(sglang_python), "-m", "sglang.benchmark.serving", "--backend", "sglang",
            "--host", "127.0.0.1", "--port", str(port),
            "--model", str(target), "--tokenizer", str(target),  # no /v1/models or Hub lookup for the tokenizer
            "--dataset-name", "sharegpt", "--dataset-path", str(dataset),
            "--num-prompts", str(num_prompts), "--sharegpt-output-len", str(output_len),
            "--max-concurrency", "1", "--request-rate", "inf", "--seed", str(seed),
            "--flush-cache",  # after the warmup request: the server's accept-length counters restart
            "--disable-tqdm", "--output-file", str(result),
            *(["--apply-chat-template"] if chat_template else [])]


def run_bench_serving(argv: list[str], log: Path, timeout_s: int) -> dict:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": ""}
    with open(log, "w") as out:
        proc = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"bench_serving exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
    result_file = Path(argv[argv.index("--output-file") + 1])
    lines = [ln for ln in result_file.read_text().splitlines() if ln.strip()]
    if not lines:
        raise RuntimeError(f"bench_serving wrote no result to {result_file}:\n{log.read_text()[-3000:]}")
    return json.loads(lines[-1])


def _num(value) -> str:
    return "-" if value is None else f"{value:.2f}"


def run_our_client(port: int, target: Path, dataset: Path, output_len: int, chat_template: bool) -> dict:
    """eagleops' own client on the same server and conversations: tok/s, TTFT, ITL, accept length."""
    import statistics

    from eagle3.serving.bench_prompts import render_prompts
    from eagle3.serving.sglang_client import SGLangClient, run_benchmark

    conversations = [[{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"]}
                      for t in c["conversations"][:1]] for c in json.loads(dataset.read_text())]
    if chat_template:
        prompts = render_prompts(conversations, target)
    else:  # bench_serving without --apply-chat-template sends the raw first turn
        prompts = [c[0]["content"] for c in conversations]
    with SGLangClient(f"http://127.0.0.1:{port}") as client:
        result = run_benchmark(client, prompts, warmup_runs=1, timed_runs=3, concurrency=1,
                               max_new_tokens=output_len, endpoint="generate", ignore_eos=True)
    requests = [r for run in result.runs for r in run.requests]
    itl = [x for r in requests for x in r.itl_s]
    return {"output_tok_s": result.summary()["output_tok_per_s"]["median"],
            "mean_ttft_ms": 1000 * statistics.fmean(r.ttft_s for r in requests),
            "mean_itl_ms": 1000 * statistics.fmean(itl) if itl else None,
            "accept_length": result.decode_accept_length}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sglang-python", type=Path, default=DEFAULT_SGLANG_PYTHON,
                   help="python of a venv with sglang (infra/install-sglang-cpu.sh)")
    p.add_argument("--target", type=Path, default=None, help="HF target dir (default: a tiny random one)")
    p.add_argument("--draft", type=Path, default=None, help="SGLang-format EAGLE-3 draft dir (with --target)")
    p.add_argument("--spec", default="3/1/4", help="steps/topk/draft tokens for the server, or 'none' (plain)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="bench_serving wraps each prompt in the target's chat template (as the draft was trained)")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--output-len", type=int, default=64, help="--sharegpt-output-len (>= 4)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--work", type=Path, default=None, help="keep dataset, logs and result here")
    p.add_argument("--json", type=Path, default=None, help="also write the summary here")
    args = p.parse_args(argv)
    if (args.target is None) != (args.draft is None):
        p.error("give --target and --draft together, or neither for the tiny random pair")
    if not args.sglang_python.is_file():
        p.error(f"--sglang-python {args.sglang_python}: not found (run infra/install-sglang-cpu.sh VENV first)")
    work = args.work or Path(tempfile.mkdtemp(prefix="eagleops-crosscheck-"))
    work.mkdir(parents=True, exist_ok=True)
    target, draft = (args.target, args.draft) if args.target else build_tiny_model_dirs(work / "models")
    # Exactly num_prompts conversations: bench_serving then sends all of them, and so does our client.
    dataset = write_sharegpt(work / "sharegpt.json", args.num_prompts, args.seed)
    port = free_port()
    server = start_server(target, draft, args.spec, port, work / "server.log")
    try:
        bench = bench_serving_argv(args.sglang_python, port, target, dataset, work / "bench_result.jsonl",
                                   args.num_prompts, args.output_len, args.seed, args.apply_chat_template)
        print("$", shlex.join(bench), flush=True)
        result = run_bench_serving(bench, work / "bench_serving.log", timeout_s=1800)
        ours = run_our_client(port, target, dataset, args.output_len, args.apply_chat_template)
    finally:
        stop_server(server)
    summary = {"command": shlex.join(bench), "spec": args.spec, "target": str(target), "draft": str(draft),
               **{k: result.get(k) for k in REPORTED},
               "server_accept_length": (result.get("server_info") or {}).get("internal_states", [{}])[0]
               .get("avg_spec_accept_length")}
    summary["ours"] = ours
    for key, value in summary.items():
        print(f"{key:>24}: {value:.2f}" if isinstance(value, float) else f"{key:>24}: {value}")
    print(f"\n{'':>24}  {'bench_serving':>14}  {'eagleops':>10}")
    for label, theirs, mine in (("output tok/s", result.get("output_throughput"), ours["output_tok_s"]),
                                ("mean TTFT ms", result.get("mean_ttft_ms"), ours["mean_ttft_ms"]),
                                ("mean ITL ms", result.get("mean_itl_ms"), ours["mean_itl_ms"]),
                                ("accept length", result.get("accept_length"), ours["accept_length"])):
        print(f"{label:>24}  {_num(theirs):>14}  {_num(mine):>10}")
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
