#!/usr/bin/env bash
# Install real SGLang 0.5.23 on a CPU-only machine, enough to import it and run its own
# argument parsing and resolution (`prepare_server_args` + `resolve_once()`, used by
# eagle3/serving/sglang_dryrun.py), its benchmark client (`python -m sglang.bench_serving`) and
# its model runner on the CPU (`SGLANG_USE_CPU_ENGINE=1`, tp 1: what eagle3/data/sglang_engine.py
# captures hidden states with), plus what eagleops itself needs on a GPU host (its data, training
# and reference-server modules), so the venv can stand in for a GPU host's Python in the tests.
#
# Usage: infra/install-sglang-cpu.sh VENV_DIR        (env: PYTHON=python3.11, default python3)
#
# The venv is separate from the project's .venv on purpose: sglang's declared dependencies
# are GPU kernels (flashinfer, sglang-kernel, deep-gemm, ...), so sglang goes in with
# --no-deps and only what its modules import at import time is added.
# torch is sglang's own pin, 2.14.1 (a CUDA build; it imports and runs on a machine without
# a GPU), with the torchvision built against it: resolution imports
# `sglang.srt.configs`, which imports `torchvision.transforms` unconditionally, and the only
# torchvision wheels on PyPI are CUDA builds whose extension needs libtorch_cuda, so a CPU
# torch (2.13.0+cpu) cannot import any of them.
#
# Idempotent: a stamp file holding the package list marks a finished install; a second run
# with the same list returns at once, a changed list reinstalls into the same venv.
# Quiet: the installers' output goes to VENV_DIR/install.log, whose tail is printed when a step fails.
set -euo pipefail

if [[ $# -ne 1 || -z "$1" ]]; then
    echo "usage: $0 VENV_DIR" >&2
    exit 2
fi
VENV_DIR=$1
PYTHON=${PYTHON:-python3}

TORCH_SPECS=("torch==2.14.1" "torchvision==0.29.1")
SGLANG_SPEC="sglang==0.5.23"
# What SGLang's argument resolution (`sglang.srt.arg_groups.pipeline`) and its benchmark
# client (`sglang.benchmark.serving`, which adds `datasets`) import at import time: the
# reference sglang-eagle3.md §6 list, with sglang's own pins where it pins (transformers,
# compressed-tensors, sentencepiece, apache-tvm-ffi, tokenizers, python-dateutil). Installed
# with their own dependencies while the constraints file holds torch and torchvision.
IMPORT_NEEDS=(
    numpy orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic
    pyzmq tqdm IPython aiohttp "transformers==5.19.0" "tokenizers==0.23.2" dill
    "compressed-tensors==0.18.0" loguru gguf "sentencepiece==0.2.1" "apache-tvm-ffi==0.1.11"
    datasets "python-dateutil<3"
    # the model runner's import-time needs (its parallel runtime, the engine entrypoints it imports)
    uvicorn fastapi uvloop setproctitle "openai==2.8.0" einops partial_json_parser httpx
    # eagleops on a GPU host: eagle3's data, training and reference-server modules
    prometheus_client matplotlib safetensors psutil
)
# SGLang's CUDA kernel package (sgl_kernel) has no CPU build on PyPI, and its memory-pool modules
# import it at import time. On a machine without AMX every op used on the CPU dispatches to its
# torch-native path, so an import stub whose every function raises is never on the compute path
# (if one were, the run would fail, not compute something else).
SGL_KERNEL_STUB='"""Import stub for the SGLang CUDA kernels on a CPU-only machine: every function raises."""


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)

    def missing(*args, **kwargs):
        raise RuntimeError(f"sgl_kernel.{name}: the SGLang CUDA kernels are not installed on this machine")

    missing.__name__ = name
    return missing
' 
STAMP_TEXT="${TORCH_SPECS[*]} $SGLANG_SPEC ${IMPORT_NEEDS[*]} sgl_kernel-stub-1"
STAMP="$VENV_DIR/.eagleops-sglang-cpu-installed"
LOG="$VENV_DIR/install.log"

# One install at a time per venv (parallel test workers, or the suite's early background install and
# a fixture): the second waits for the first, then finds the stamp and returns.
mkdir -p "$(dirname "$VENV_DIR")"
exec 9>"$VENV_DIR.lock"
flock 9

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" && -x "$VENV_DIR/bin/python" ]]; then
    exit 0
fi

fail() {  # $1: the step that failed
    echo "install-sglang-cpu: FAILED at step '$1' (venv $VENV_DIR); last lines of $LOG:" >&2
    tail -n 25 "$LOG" >&2 || true
    exit 1
}

step() {  # $1: step name, rest: command; output appended to the log
    local name=$1
    shift
    echo "== $name: $*" >>"$LOG"
    "$@" >>"$LOG" 2>&1 || fail "$name"
}

command -v "$PYTHON" >/dev/null || { echo "install-sglang-cpu: no '$PYTHON' on PATH (set PYTHON=...)" >&2; exit 1; }
mkdir -p "$VENV_DIR"
: >"$LOG"
rm -f "$STAMP"
step "create venv" "$PYTHON" -m venv "$VENV_DIR"
# The packages go in with uv, told where this machine's pip takes them from (infra/uv_pip_args.py), as
# `make install` does: the same 116 packages as pip's, in 58 s instead of 172 on a fresh 2-core machine
# (pip's CPU was mostly compiling bytecode for all of torch; a module is compiled here when first imported).
step "uv" "$VENV_DIR/bin/python" -m pip install -q --disable-pip-version-check uv==0.13.9
read -r -a UV_PIP_ARGS <<<"$("$VENV_DIR/bin/python" "$(dirname "$0")/uv_pip_args.py")"
PIP=("$VENV_DIR/bin/uv" pip install -q --python "$VENV_DIR/bin/python" "${UV_PIP_ARGS[@]}")
CONSTRAINTS="$VENV_DIR/constraints.txt"
printf '%s\n' "${TORCH_SPECS[@]}" >"$CONSTRAINTS"
step "torch and torchvision" "${PIP[@]}" "${TORCH_SPECS[@]}"
step "sglang without its CUDA dependencies" "${PIP[@]}" --no-deps "$SGLANG_SPEC"
step "sglang import-time needs" "${PIP[@]}" -c "$CONSTRAINTS" "${IMPORT_NEEDS[@]}"
SITE=$("$VENV_DIR/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
mkdir -p "$SITE/sgl_kernel"
printf '%s' "$SGL_KERNEL_STUB" >"$SITE/sgl_kernel/__init__.py"
step "import check" "$VENV_DIR/bin/python" -c \
    "import sglang.srt.server_args, sglang.srt.arg_groups.pipeline, sglang.bench_serving, sglang.benchmark.one_batch"
echo "$STAMP_TEXT" >"$STAMP"
