"""Environment checks: can this machine run the stages the experiment asks for?

Two halves, so the same checks run locally and (later) on a GPU host over SSH:
`gather_facts()` probes the machine (Python, torch, CUDA driver/runtime, GPUs, nvcc
toolkits, flash-attn, sglang, cores, RAM, disk) into a JSON-able `Facts`;
`evaluate(facts, needs)` turns facts plus what the experiment needs into ok/warn/fail
checks with one-line reasons. `python -m eagle3.environment --path DIR` prints the facts as
JSON, which is how a remote host is probed.

The flash-attn build recipe encodes a lesson: its CUDA extension compiles with one nvcc job
per MAX_JOBS, each taking several GB of RAM; MAX_JOBS=128 exhausted memory on the machine
that taught us, ~20 was right there. MAX_JOBS is therefore derived from free RAM, not cores.
"""

from __future__ import annotations

import argparse
import glob
import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

Status = Literal["ok", "warn", "fail"]
GIB = 1024**3
# RAM one nvcc job of the flash-attn build takes at peak (sm80+sm90 kernels), in GiB.
FLASH_ATTN_GIB_PER_JOB = 5
SUPPORTED_PYTHON = ((3, 10), (3, 13))  # [min, max)
VERIFIED_SGLANG = "0.5.23"


@dataclass
class Gpu:
    name: str
    memory_mib: int
    compute_capability: str


@dataclass
class Toolkit:
    home: str
    nvcc_version: str | None  # "12.4"


@dataclass
class Facts:
    """What the machine has; every field JSON-able so it can travel from a remote host."""

    hostname: str
    python_version: str
    torch_version: str | None
    torch_cuda: str | None  # CUDA runtime torch was built against; None = CPU build
    cuda_available: bool
    driver_version: str | None
    driver_cuda: str | None  # highest CUDA the driver supports (nvidia-smi header)
    gpus: list[Gpu] = field(default_factory=list)
    toolkits: list[Toolkit] = field(default_factory=list)
    cuda_home_env: str | None = None
    flash_attn_version: str | None = None
    sglang_version: str | None = None
    cpu_count: int = 1
    mem_available_bytes: int = 0
    disk_path: str = "."
    disk_free_bytes: int = 0

    @classmethod
    def from_dict(cls, data: dict) -> Facts:
        data = dict(data)
        data["gpus"] = [Gpu(**g) for g in data.get("gpus", [])]
        data["toolkits"] = [Toolkit(**t) for t in data.get("toolkits", [])]
        return cls(**data)


@dataclass
class Needs:
    """What the experiment asks of this machine."""

    gpu: bool  # a CUDA GPU is required (bf16 training, multi-device, real target)
    flash_attn: bool  # flash-attn is needed (GPU training of large drafts)
    sglang: bool  # sglang must be importable here (serving on this machine)
    disk_bytes: int  # what the data stage will write (offline hidden states), 0 if nothing big


@dataclass
class Check:
    name: str
    status: Status
    reason: str
    details: dict = field(default_factory=dict)


# --------------------------------------------------------------------------- probing


def gather_facts(disk_path: str | Path = ".") -> Facts:
    """Probe this machine. Never raises for a missing tool: absence is a fact."""
    torch_version, torch_cuda, cuda_available = _torch_facts()
    driver_version, driver_cuda, gpus = _nvidia_smi_facts()
    disk_path = _existing_parent(Path(disk_path))
    return Facts(
        hostname=platform.node(),
        python_version=platform.python_version(),
        torch_version=torch_version,
        torch_cuda=torch_cuda,
        cuda_available=cuda_available,
        driver_version=driver_version,
        driver_cuda=driver_cuda,
        gpus=gpus,
        toolkits=_find_toolkits(),
        cuda_home_env=os.environ.get("CUDA_HOME"),
        flash_attn_version=_package_version("flash_attn", "flash-attn"),
        sglang_version=_package_version("sglang", "sglang"),
        cpu_count=os.cpu_count() or 1,
        mem_available_bytes=_mem_available(),
        disk_path=str(disk_path),
        disk_free_bytes=shutil.disk_usage(disk_path).free,
    )


def _torch_facts() -> tuple[str | None, str | None, bool]:
    if importlib.util.find_spec("torch") is None:
        return None, None, False
    import torch

    return torch.__version__, torch.version.cuda, bool(torch.cuda.is_available())


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    if shutil.which(cmd[0]) is None and not Path(cmd[0]).is_file():
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def _nvidia_smi_facts() -> tuple[str | None, str | None, list[Gpu]]:
    header = _run(["nvidia-smi"])
    if header is None:
        return None, None, []
    driver = re.search(r"Driver Version:\s*([\d.]+)", header)
    cuda = re.search(r"CUDA Version:\s*([\d.]+)", header)
    rows = _run(["nvidia-smi", "--query-gpu=name,memory.total,compute_cap", "--format=csv,noheader,nounits"]) or ""
    return (driver.group(1) if driver else None, cuda.group(1) if cuda else None, parse_gpu_rows(rows))


def parse_gpu_rows(text: str) -> list[Gpu]:
    """`NVIDIA H200, 143771, 9.0` lines -> Gpu records."""
    gpus = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 3 and parts[1].isdigit():
            gpus.append(Gpu(name=parts[0], memory_mib=int(parts[1]), compute_capability=parts[2]))
    return gpus


def parse_nvcc_version(text: str) -> str | None:
    """`Cuda compilation tools, release 12.4, V12.4.131` -> "12.4"."""
    found = re.search(r"release (\d+\.\d+)", text or "")
    return found.group(1) if found else None


def _find_toolkits() -> list[Toolkit]:
    homes = {os.environ.get("CUDA_HOME"), *glob.glob("/usr/local/cuda*")}
    nvcc_on_path = shutil.which("nvcc")
    if nvcc_on_path:
        homes.add(str(Path(nvcc_on_path).resolve().parent.parent))
    toolkits = []
    for home in sorted(h for h in homes if h and Path(h, "bin", "nvcc").exists()):
        real = str(Path(home).resolve())
        if any(str(Path(t.home).resolve()) == real for t in toolkits):
            continue
        toolkits.append(Toolkit(home=home, nvcc_version=parse_nvcc_version(_run([f"{home}/bin/nvcc", "--version"]))))
    return toolkits


def _package_version(module: str, dist: str) -> str | None:
    if importlib.util.find_spec(module) is None:
        return None
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def _mem_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _existing_parent(path: Path) -> Path:
    path = path.resolve()
    while not path.exists():
        path = path.parent
    return path


# --------------------------------------------------------------------------- evaluation


def evaluate(facts: Facts, needs: Needs) -> list[Check]:
    """Every check, in report order."""
    return [
        check_python(facts),
        check_torch(facts, needs),
        check_driver(facts, needs),
        check_gpus(facts, needs),
        check_nvcc(facts, needs),
        check_flash_attn(facts, needs),
        check_sglang(facts, needs),
        check_resources(facts),
        check_disk(facts, needs),
    ]


def overall_status(checks: list[Check]) -> Status:
    statuses = {c.status for c in checks}
    return "fail" if "fail" in statuses else "warn" if "warn" in statuses else "ok"


def check_python(facts: Facts) -> Check:
    version = tuple(int(p) for p in facts.python_version.split(".")[:2])
    low, high = SUPPORTED_PYTHON
    if low <= version < high:
        return Check("python", "ok", f"Python {facts.python_version}")
    return Check("python", "fail", f"Python {facts.python_version} is outside the supported >=3.10,<3.13")


def check_torch(facts: Facts, needs: Needs) -> Check:
    details = {"torch": facts.torch_version, "torch_cuda": facts.torch_cuda}
    if facts.torch_version is None:
        return Check("torch", "fail", "torch is not installed", details)
    if needs.gpu and facts.torch_cuda is None:
        return Check("torch", "fail", f"torch {facts.torch_version} is a CPU build but the run needs CUDA", details)
    build = f"CUDA {facts.torch_cuda} build" if facts.torch_cuda else "CPU build"
    return Check("torch", "ok", f"torch {facts.torch_version} ({build})", details)


def check_driver(facts: Facts, needs: Needs) -> Check:
    details = {"driver": facts.driver_version, "driver_cuda": facts.driver_cuda, "runtime": facts.torch_cuda}
    if facts.driver_version is None:
        status: Status = "fail" if needs.gpu else "ok"
        return Check("cuda_driver", status, "no NVIDIA driver (nvidia-smi not found)", details)
    if facts.torch_cuda and facts.driver_cuda and _version(facts.torch_cuda) > _version(facts.driver_cuda):
        return Check(
            "cuda_driver",
            "fail",
            f"torch needs CUDA {facts.torch_cuda} but driver {facts.driver_version} supports up to "
            f"{facts.driver_cuda}: upgrade the driver or install a torch built for CUDA <= {facts.driver_cuda}",
            details,
        )
    if facts.torch_cuda and not facts.cuda_available:
        return Check("cuda_driver", "fail", "driver present but torch.cuda.is_available() is False", details)
    return Check("cuda_driver", "ok", f"driver {facts.driver_version} (CUDA <= {facts.driver_cuda})", details)


def check_gpus(facts: Facts, needs: Needs) -> Check:
    details = {"gpus": [asdict(g) for g in facts.gpus]}
    if not facts.gpus:
        return Check("gpus", "fail" if needs.gpu else "ok", "no GPU" + (" but the run needs one" if needs.gpu else " (CPU run)"), details)
    kinds = sorted({f"{g.name} {g.memory_mib // 1024} GiB sm{g.compute_capability}" for g in facts.gpus})
    return Check("gpus", "ok", f"{len(facts.gpus)} x {', '.join(kinds)}", details)


def check_nvcc(facts: Facts, needs: Needs) -> Check:
    home = choose_cuda_home(facts)
    details = {"toolkits": [asdict(t) for t in facts.toolkits], "chosen_cuda_home": home}
    if not facts.toolkits:
        status: Status = "warn" if needs.flash_attn and facts.flash_attn_version is None else "ok"
        return Check("nvcc", status, "no CUDA toolkit (nvcc) found; only needed to build flash-attn", details)
    chosen = next(t for t in facts.toolkits if t.home == home)
    if facts.torch_cuda and chosen.nvcc_version:
        if chosen.nvcc_version.split(".")[0] != facts.torch_cuda.split(".")[0]:
            return Check(
                "nvcc",
                "warn" if facts.flash_attn_version else "fail" if needs.flash_attn else "warn",
                f"nvcc {chosen.nvcc_version} at {home} and torch's CUDA {facts.torch_cuda} differ in major "
                "version: CUDA extensions (flash-attn) will not build against this torch",
                details,
            )
        if chosen.nvcc_version != facts.torch_cuda:
            return Check("nvcc", "warn", f"nvcc {chosen.nvcc_version} vs torch CUDA {facts.torch_cuda} (minor differs; usually fine)", details)
    return Check("nvcc", "ok", f"nvcc {chosen.nvcc_version} at {home}", details)


def choose_cuda_home(facts: Facts) -> str | None:
    """The toolkit to build CUDA extensions with: exact match to torch's CUDA, else same major, newest."""
    if not facts.toolkits:
        return None
    if facts.torch_cuda:
        for toolkit in facts.toolkits:
            if toolkit.nvcc_version == facts.torch_cuda:
                return toolkit.home
        major = facts.torch_cuda.split(".")[0]
        same_major = [t for t in facts.toolkits if t.nvcc_version and t.nvcc_version.split(".")[0] == major]
        if same_major:
            return max(same_major, key=lambda t: _version(t.nvcc_version or "0")).home
    if facts.cuda_home_env and any(t.home == facts.cuda_home_env for t in facts.toolkits):
        return facts.cuda_home_env
    return max(facts.toolkits, key=lambda t: _version(t.nvcc_version or "0")).home


def flash_attn_max_jobs(facts: Facts) -> int:
    """Parallel nvcc jobs the flash-attn build can afford: bounded by free RAM, then by cores."""
    by_memory = facts.mem_available_bytes // (FLASH_ATTN_GIB_PER_JOB * GIB)
    return int(max(1, min(facts.cpu_count, by_memory)))


def flash_attn_recipe(facts: Facts) -> str:
    home = choose_cuda_home(facts) or "/usr/local/cuda"
    return (
        f"CUDA_HOME={home} PATH={home}/bin:$PATH MAX_JOBS={flash_attn_max_jobs(facts)} "
        "pip install flash-attn --no-build-isolation"
    )


def check_flash_attn(facts: Facts, needs: Needs) -> Check:
    details = {"version": facts.flash_attn_version, "recipe": flash_attn_recipe(facts), "max_jobs": flash_attn_max_jobs(facts)}
    if facts.flash_attn_version:
        return Check("flash_attn", "ok", f"flash-attn {facts.flash_attn_version} importable", details)
    if not needs.flash_attn:
        return Check("flash_attn", "ok", "not installed; not needed for this run", details)
    return Check("flash_attn", "warn", f"not installed; build with: {details['recipe']}", details)


def check_sglang(facts: Facts, needs: Needs) -> Check:
    details = {"version": facts.sglang_version, "verified": VERIFIED_SGLANG}
    if facts.sglang_version is None:
        if needs.sglang:
            return Check("sglang", "fail", "sglang is not installed but this machine serves the draft", details)
        return Check("sglang", "ok", "not installed here (only the serving host needs it)", details)
    if facts.sglang_version != VERIFIED_SGLANG:
        return Check(
            "sglang",
            "warn",
            f"sglang {facts.sglang_version}: eagleops' effective-setting rules were verified on {VERIFIED_SGLANG}",
            details,
        )
    return Check("sglang", "ok", f"sglang {facts.sglang_version}", details)


def check_resources(facts: Facts) -> Check:
    details = {"cpu_count": facts.cpu_count, "mem_available_gib": round(facts.mem_available_bytes / GIB, 1)}
    return Check("cpu_memory", "ok", f"{facts.cpu_count} cores, {details['mem_available_gib']} GiB RAM available", details)


def check_disk(facts: Facts, needs: Needs) -> Check:
    free, need = facts.disk_free_bytes, needs.disk_bytes
    details = {"path": facts.disk_path, "free_bytes": free, "needed_bytes": need}
    text = f"{_gib(free)} free at {facts.disk_path}, data stage needs {_gib(need)}"
    if need > free:
        return Check("disk", "fail", text, details)
    if need * 1.2 > free:
        return Check("disk", "warn", text + " (less than 20% headroom)", details)
    return Check("disk", "ok", text, details)


def hidden_state_bytes(num_tokens: int, hidden_size: int, num_aux: int = 3, dtype_bytes: int = 2,
                       dtype: str | None = None) -> int:
    """Offline dump size: tokens x (num_aux aux states + 1 last state) x H x bytes.

    `dtype` (a `data.hidden_states_dtype` name) overrides dtype_bytes: "float8_e4m3" stores the
    aux states in 1 B per value plus a 4 B scale per `fp8_scale_block(H)` values, the last state
    in bf16 (eagle3/data/state_codec.py).
    Example: 1M tokens of an H=4096 target, 3 aux, bf16 -> 1e6 * 4 * 4096 * 2 = 32.8 GB; float8_e4m3
    -> 1e6 * (3 * (4096 + 32 * 4) + 4096 * 2) = 20.9 GB.
    """
    if dtype == "float8_e4m3":
        scales = hidden_size // fp8_scale_block(hidden_size)
        return num_tokens * (num_aux * (hidden_size + 4 * scales) + 2 * hidden_size)
    if dtype is not None:
        dtype_bytes = HIDDEN_STATE_DTYPE_BYTES[dtype]
    return num_tokens * (num_aux + 1) * hidden_size * dtype_bytes


# bytes per stored value of each `data.hidden_states_dtype` (float8_e4m3: the aux states; see hidden_state_bytes)
HIDDEN_STATE_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3": 1}
FP8_SCALE_BLOCK = 128  # values per fp8 scale (DeepSeek-V3's 1 x 128 activation tiles)


def fp8_scale_block(hidden_size: int) -> int:
    """Values per fp8 scale for a target of width H: FP8_SCALE_BLOCK when it divides H, else their gcd."""
    import math

    return math.gcd(hidden_size, FP8_SCALE_BLOCK)


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", text)[:3])


def _gib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / 1024**2:.1f} MiB"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Print this machine's environment facts as JSON.")
    parser.add_argument("--path", default=".", help="directory whose free disk space is reported")
    args = parser.parse_args(argv)
    json.dump(asdict(gather_facts(args.path)), sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
