"""target.engine sglang at tp 2 on the CPU: the followers' path (`_Followers`, `_follow`) that Kimi runs at TP 8.

SGLang 0.5.23 runs tensor parallelism on CPUs itself (its Xeon path): `--device cpu` makes every
group gloo (`srt/platforms/cpu.py: get_torch_distributed_backend_str`), the all-reduce falls back
from its shared-memory kernel (sgl-kernel's CPU build + AMX; this venv has an import stub) to
`torch.distributed.all_reduce` (`parallel_state.py: GroupCoordinator.all_reduce`, `is_shm_available`,
`cpu_has_amx_support`), and each rank's cores come
from `SGLANG_CPU_OMP_THREADS_BIND` (`srt/utils/numa_utils.py: init_threads_binding`; "0|1" here,
one core per rank). The one thing a CPU host does not have that this venv has is a NCCL library (its
torch is a CUDA build): eagle3.data.sglang_engine points SGLang's own `SGLANG_NCCL_SO_PATH` at none on
`--device cpu`, so `PyNcclCommunicator` disables itself as on a Xeon host. No test-only switch.

Two targets, heads and experts dividing by 2: a random Llama (4 query, 2 KV heads, H 64, 7 layers;
the tiny target's single KV head would make SGLang's CPU TP pad it, `adjust_config_with_unaligned_cpu_tp`,
which a GPU TP run does not do) and the random DeepSeek-V3 of test_sglang_engine.py, Kimi-K2.5's text
model shape (MLA, 4 heads, MoE with 4 routed experts).

Measured (2-core box, fp32, one thread per rank), max |tp 2 - tp 1|: Llama aux 5.2e-8, final 1.0e-6;
DeepSeek-V3 aux 3.6e-7, final 1.4e-6 (states up to 0.2-0.9 aux, 2.9-3.4 final). The tolerance,
1e-5: the row-parallel layers (o_proj, down_proj, the experts' down projection) sum two partial
products in an all-reduce where tp 1 sums them inside one matmul, a different fp32 summation order
(~1e-7 relative per layer); a missed all-reduce or a shard on the wrong rank is off by the states' own size.
Module time: ~65 s run alone on 2 cores (each tp 1 vs tp 2 test ~20 s: three SGLang processes start),
spread test by test over the workers under `make test` (tests/conftest.py, SPREAD_MODULES).
"""

from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest
import torch

from tests.eagle3.data.test_sglang_engine import tiny_deepseek_v3

REPO = Path(__file__).resolve().parents[3]
# three batches: the broadcast loop runs more than once, with different batch shapes (ids < 128: both vocabs)
BATCHES = [[[5, 17, 33, 90, 12, 7, 8], [40, 41, 42, 43]], [[3] * 9], [[101, 17, 5], [127, 0, 1, 2, 3], [64] * 6]]
ATOL = 1e-5
HANG_GUARD_S = 240  # a capture that hangs instead of failing is ended here (the bug this module guards against)

# Runs in the SGLang venv. Spawned followers import this file again as __mp_main__: hence the main() guard.
CAPTURE = textwrap.dedent(
    """
    import json, os, sys, torch
    from eagle3.data.sglang_engine import SGLangCaptureSettings, SGLangFeatureExtractor

    def main():
        target, out, tp, batches = sys.argv[1], sys.argv[2], int(sys.argv[3]), json.loads(sys.argv[4])
        extractor = SGLangFeatureExtractor(SGLangCaptureSettings(target, None, tp=tp, device="cpu",
                                                                 max_batch_tokens=256))
        pids = extractor.follower_pids
        captured = [extractor.capture_rows(rows) for rows in batches]
        extractor.close()
        gone = [not os.path.exists(f"/proc/{pid}") for pid in pids]  # exited and reaped by close()
        torch.save({"aux": torch.cat([aux for aux, _ in captured]), "last": torch.cat([last for _, last in captured]),
                    "follower_pids": pids, "gone_after_close": gone}, out)

    if __name__ == "__main__":
        main()
    """
)

# A follower dies while rank 0 waits on it inside a batch: SIGSTOP holds it where it waits for the next
# batch, so rank 0's broadcast goes out and its forward blocks in the first all-reduce; SIGKILL then ends
# the follower under that wait.
KILLED = textwrap.dedent(
    """
    import json, os, signal, sys, threading
    from eagle3.data.sglang_engine import SGLangCaptureSettings, SGLangFeatureExtractor

    def main():
        target, out, batches = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
        extractor = SGLangFeatureExtractor(SGLangCaptureSettings(target, None, tp=2, device="cpu",
                                                                 max_batch_tokens=256))
        [pid] = extractor.follower_pids
        extractor.capture_rows(batches[0])
        os.kill(pid, signal.SIGSTOP)
        threading.Timer(1.0, os.kill, (pid, signal.SIGKILL)).start()
        try:
            extractor.capture_rows(batches[1])
            error = None
        except RuntimeError as err:
            error = str(err)
        extractor.close()
        json.dump({"error": error, "follower_pids": [pid], "gone": not os.path.exists(f"/proc/{pid}")},
                  open(out, "w"))

    if __name__ == "__main__":
        main()
    """
)

# A follower dies while rank 0 loads: rank 0 then waits in the process-group rendezvous, a C++ wait that
# no dead peer ends (as an NCCL collective on a GPU): the watch thread ends rank 0's process after the grace.
LOAD_KILLED = textwrap.dedent(
    """
    import multiprocessing, os, signal, sys, threading, time
    from eagle3.data.sglang_engine import SGLangCaptureSettings, SGLangFeatureExtractor

    def kill_the_follower(pid_file):
        while not multiprocessing.active_children():
            time.sleep(0.05)
        [follower] = multiprocessing.active_children()
        open(pid_file, "w").write(str(follower.pid))
        while "sglang.benchmark.one_batch" not in sys.modules:  # rank 0 is past its first check, in its own load
            time.sleep(0.05)
        os.kill(follower.pid, signal.SIGKILL)

    def main():
        target, pid_file = sys.argv[1], sys.argv[2]
        threading.Thread(target=kill_the_follower, args=(pid_file,), daemon=True).start()
        SGLangFeatureExtractor(SGLangCaptureSettings(target, None, tp=2, device="cpu", max_batch_tokens=256),
                               stuck_grace_s=3)
        print("the engine started without its follower")

    if __name__ == "__main__":
        main()
    """
)


def tiny_llama_tp2(path: Path, tokenizer_from: Path) -> Path:
    """A random 7-layer Llama, 4 query and 2 KV heads (both divide by tp 2), H 64, the tiny target's tokenizer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=7,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (path / name).write_bytes((tokenizer_from / name).read_bytes())
    return path


@pytest.fixture(scope="module")
def tp2_target(tiny_target_dir, tmp_path_factory) -> Path:
    return tiny_llama_tp2(tmp_path_factory.mktemp("llama-tp2"), tiny_target_dir)


@pytest.fixture(scope="module")
def deepseek_target(tiny_target_dir, tmp_path_factory) -> Path:
    """Kimi-K2.5's text model shape (DeepSeek-V3: MLA, MoE), 4 heads, 4 routed experts: split over 2 ranks."""
    target = tiny_deepseek_v3(tmp_path_factory.mktemp("dsv3-tp2") / "dsv3")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (target / name).write_bytes((tiny_target_dir / name).read_bytes())
    return target


def start_in_sglang(sglang_python: Path, script: str, argv: list[str], tmp_path: Path) -> subprocess.Popen:
    path = tmp_path / f"script-{len(list(tmp_path.glob('script-*')))}.py"
    path.write_text(script)
    # one core per rank (SGLang's own CPU binding switch; it binds only with sgl-kernel's CPU build, here it
    # is logged and the ranks' threads come from OMP_NUM_THREADS)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SGLANG_CPU_OMP_THREADS_BIND": "0|1"}
    return subprocess.Popen([str(sglang_python), str(path), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=tmp_path)


def finish(proc: subprocess.Popen, ok: bool = True) -> str:
    """The script's stderr once it ended (within the hang guard); `ok`: it must have exited 0."""
    try:
        _, stderr = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        pytest.fail(f"the capture hung (ended after {HANG_GUARD_S} s): {stderr[-3000:]}")
    assert (proc.returncode == 0) == ok, f"exit {proc.returncode}: {stderr[-4000:]}"
    return stderr


def assert_gone(pids: list[int]) -> None:
    """No process of the run is left: the followers were reaped (their pid is free again)."""
    left = [pid for pid in pids if Path(f"/proc/{pid}").exists()]
    assert not left, f"follower processes left behind: {left}"


@pytest.mark.parametrize("model", ["llama", "deepseek_v3"])
def test_tp2_captures_what_tp1_captures(sglang_python, model, request, tmp_path):
    target = request.getfixturevalue({"llama": "tp2_target", "deepseek_v3": "deepseek_target"}[model])
    # tp 1 and tp 2 in two processes at once (SGLang's parallel runtime is once per process); 3 processes, 2 cores
    out = {tp: tmp_path / f"tp{tp}.pt" for tp in (1, 2)}
    procs = {tp: start_in_sglang(sglang_python, CAPTURE, [str(target), str(out[tp]), str(tp), json.dumps(BATCHES)],
                                 tmp_path) for tp in (1, 2)}
    for proc in procs.values():
        finish(proc)
    tp1, tp2 = (torch.load(out[tp]) for tp in (1, 2))
    tokens = sum(len(row) for rows in BATCHES for row in rows)
    print(f"{model}: max |tp 2 - tp 1| aux {(tp2['aux'] - tp1['aux']).abs().max():.2e}, "
          f"final {(tp2['last'] - tp1['last']).abs().max():.2e}")
    assert tp1["aux"].shape == tp2["aux"].shape == (tokens, 3 * 64)
    assert tp1["last"].shape == tp2["last"].shape == (tokens, 64)
    torch.testing.assert_close(tp2["aux"], tp1["aux"], atol=ATOL, rtol=0)
    torch.testing.assert_close(tp2["last"], tp1["last"], atol=ATOL, rtol=0)
    assert tp1["follower_pids"] == [] and len(tp2["follower_pids"]) == 1
    assert tp2["gone_after_close"] == [True]
    assert_gone(tp2["follower_pids"])


def test_a_follower_killed_mid_capture_fails_it_in_one_line(sglang_python, tp2_target, tmp_path):
    out = tmp_path / "killed.json"
    finish(start_in_sglang(sglang_python, KILLED, [str(tp2_target), str(out), json.dumps(BATCHES)], tmp_path))
    result = json.loads(out.read_text())
    [pid] = result["follower_pids"]
    assert result["error"] == (f"SGLang capture: TP rank 1 (pid {pid}) was killed by SIGKILL; the capture stopped "
                               "and the other ranks were ended")
    assert result["gone"]
    assert_gone([pid])


def test_a_follower_dead_during_the_load_ends_rank_0_in_one_line(sglang_python, tp2_target, tmp_path):
    pid_file = tmp_path / "follower.pid"
    stderr = finish(start_in_sglang(sglang_python, LOAD_KILLED, [str(tp2_target), str(pid_file)], tmp_path), ok=False)
    pid = int(pid_file.read_text())
    assert stderr.strip().splitlines()[-1] == (
        f"SGLang capture: TP rank 1 (pid {pid}) was killed by SIGKILL; rank 0 still waited on it 3 s later "
        "(a rendezvous or collective a dead rank never joins), so this process ends")
    assert_gone([pid])
