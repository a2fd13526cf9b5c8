"""Environment checks on synthetic facts (the machines that taught us) and on this machine."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict, replace

from eagle3.environment import (
    GIB,
    Facts,
    Gpu,
    Needs,
    Toolkit,
    choose_cuda_home,
    evaluate,
    flash_attn_max_jobs,
    gather_facts,
    hidden_state_bytes,
    overall_status,
    parse_gpu_rows,
    parse_nvcc_version,
)

GPU_BOX = Facts(
    hostname="gpu-node-01",
    python_version="3.11.9",
    torch_version="2.9.1+cu128",
    torch_cuda="12.8",
    cuda_available=True,
    driver_version="570.86.15",
    driver_cuda="12.8",
    gpus=[Gpu("NVIDIA H200", 143771, "9.0")] * 8,
    toolkits=[Toolkit("/usr/local/cuda-12.1", "12.1"), Toolkit("/usr/local/cuda-12.8", "12.8"), Toolkit("/usr/local/cuda-11.8", "11.8")],
    cuda_home_env="/usr/local/cuda-11.8",
    flash_attn_version=None,
    sglang_version="0.5.23",
    cpu_count=128,
    mem_available_bytes=100 * GIB,
    disk_path="/scratch",
    disk_free_bytes=2000 * GIB,
)
GPU_NEEDS = Needs(gpu=True, flash_attn=True, sglang=True, disk_bytes=10 * GIB)


def by_name(checks):
    return {c.name: c for c in checks}


def test_max_jobs_follows_free_memory_not_cores():
    # 128 cores and 100 GiB free: 128 jobs would exhaust memory; 5 GiB per job gives 20.
    assert flash_attn_max_jobs(GPU_BOX) == 20
    assert flash_attn_max_jobs(replace(GPU_BOX, cpu_count=8)) == 8
    assert flash_attn_max_jobs(replace(GPU_BOX, mem_available_bytes=3 * GIB)) == 1


def test_cuda_home_matches_torch_runtime_over_cuda_home_env():
    assert choose_cuda_home(GPU_BOX) == "/usr/local/cuda-12.8"
    no_exact = replace(GPU_BOX, toolkits=[Toolkit("/usr/local/cuda-12.1", "12.1"), Toolkit("/usr/local/cuda-12.4", "12.4"), Toolkit("/opt/cuda-11.8", "11.8")])
    assert choose_cuda_home(no_exact) == "/usr/local/cuda-12.4"


def test_gpu_box_without_flash_attn_warns_with_a_build_recipe():
    checks = by_name(evaluate(GPU_BOX, GPU_NEEDS))
    assert checks["flash_attn"].status == "warn"
    assert "CUDA_HOME=/usr/local/cuda-12.8" in checks["flash_attn"].reason
    assert "MAX_JOBS=20" in checks["flash_attn"].reason
    assert checks["gpus"].reason == "8 x NVIDIA H200 140 GiB sm9.0"
    assert overall_status(evaluate(GPU_BOX, GPU_NEEDS)) == "warn"


def test_driver_older_than_torch_runtime_fails():
    old_driver = replace(GPU_BOX, driver_cuda="12.2")
    check = by_name(evaluate(old_driver, GPU_NEEDS))["cuda_driver"]
    assert check.status == "fail" and "supports up to 12.2" in check.reason


def test_nvcc_major_mismatch_fails_when_flash_attn_must_be_built():
    only_11 = replace(GPU_BOX, toolkits=[Toolkit("/usr/local/cuda-11.8", "11.8")])
    assert by_name(evaluate(only_11, GPU_NEEDS))["nvcc"].status == "fail"
    minor = replace(GPU_BOX, toolkits=[Toolkit("/usr/local/cuda-12.4", "12.4")])
    assert by_name(evaluate(minor, GPU_NEEDS))["nvcc"].status == "warn"


def test_cpu_build_fails_a_gpu_run_and_passes_a_cpu_run():
    cpu = replace(GPU_BOX, torch_version="2.13.0+cpu", torch_cuda=None, cuda_available=False, driver_version=None, driver_cuda=None, gpus=[], toolkits=[])
    assert by_name(evaluate(cpu, GPU_NEEDS))["torch"].status == "fail"
    assert by_name(evaluate(cpu, GPU_NEEDS))["gpus"].status == "fail"
    cpu_needs = Needs(gpu=False, flash_attn=False, sglang=False, disk_bytes=0)
    assert overall_status(evaluate(cpu, cpu_needs)) == "ok"


def test_disk_and_sglang_version():
    full = replace(GPU_BOX, disk_free_bytes=5 * GIB)
    assert by_name(evaluate(full, GPU_NEEDS))["disk"].status == "fail"
    tight = replace(GPU_BOX, disk_free_bytes=11 * GIB)
    assert by_name(evaluate(tight, GPU_NEEDS))["disk"].status == "warn"
    assert by_name(evaluate(replace(GPU_BOX, sglang_version="0.5.9"), GPU_NEEDS))["sglang"].status == "warn"
    assert by_name(evaluate(replace(GPU_BOX, sglang_version=None), GPU_NEEDS))["sglang"].status == "fail"
    assert by_name(evaluate(replace(GPU_BOX, python_version="3.9.18"), GPU_NEEDS))["python"].status == "fail"


def test_hidden_state_estimate_matches_the_formula():
    # Llama-3.1-8B: 3 aux + last state, H 4096, bf16 -> 32 KiB per token.
    assert hidden_state_bytes(1, 4096) == 32 * 1024
    assert hidden_state_bytes(100_000 * 2048, 4096) == 100_000 * 2048 * 32 * 1024


def test_parsers():
    assert parse_nvcc_version("Cuda compilation tools, release 12.4, V12.4.131") == "12.4"
    assert parse_nvcc_version("garbage") is None
    assert parse_gpu_rows("NVIDIA H200, 143771, 9.0\nNVIDIA H200, 143771, 9.0\n") == [Gpu("NVIDIA H200", 143771, "9.0")] * 2


def test_this_machine_round_trips_as_json(tmp_path):
    facts = gather_facts(tmp_path)
    assert Facts.from_dict(json.loads(json.dumps(asdict(facts)))) == facts
    out = subprocess.run([sys.executable, "-m", "eagle3.environment", "--path", str(tmp_path)], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["python_version"] == facts.python_version
