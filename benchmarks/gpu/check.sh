#!/usr/bin/env bash
# GPU check of the triton attention backend on one H200: CUDA parity tests, then runner throughput.
#
# NOT YET RUN ON A GPU. Written on a CPU-only machine, where the same tests pass under the
# Triton interpreter and throughput.py passes its `--device cpu --tiny` smoke run. Expect the
# first GPU run to find things (kernel compile limits, tolerances); each stage below has its
# own time limit and log, so one failing stage still leaves the others' results.
#
# Machine: python3 3.12 with torch 2.11, triton 3.6, transformers and pytest already installed;
# no fastapi/uvicorn/pyzmq/msgspec/gguf/pydantic/prometheus-client. Run from anywhere:
#     bash benchmarks/gpu/check.sh            # about 6-8 minutes (stage limits add up to 7.5)
# Logs and throughput.json go to $OUT when set, else benchmarks/gpu/out/.
#
# Stages:
#   1. tests/model/test_triton_backend.py: triton vs the torch backend per layer on the same
#      cache, and vs transformers (CPU, fp32) end to end; fp32, bf16, FP8 KV; on cuda.
#   2. tests/model/test_runner.py: its runners default to cuda when a GPU is present, and the
#      auto backend there is triton: the full transformers-parity suite (fp32; bf16 test too).
#   3. benchmarks/gpu/throughput.py: 1B and 8B shapes, bf16, torch and triton backends.
#
# Wheels to carry: none of these stages needs one (they import torch, triton, numpy,
# safetensors, transformers and pytest, all there). For the rest of the test suite (server,
# API, GGUF tests), carry in .whl/ these cp312 manylinux x86_64 / py3-none-any wheels, the
# versions this project's environment has:
#   fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4
#   annotated-types==0.7.0 typing-inspection==0.4.2 pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0
#   pytest-asyncio==1.5.0 openai==3.57.0 jiter==0.19.0 distro==1.9.0
set -u -o pipefail
cd "$(dirname "$0")/../.."
export OUT=${OUT:-$PWD/benchmarks/gpu/out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
unset TRITON_INTERPRET
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD || exit 1
else
    export PYTHONPATH=$PWD
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__); assert torch.cuda.is_available()" || exit 1

status=0
stage() {  # stage NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $((SECONDS - start))s"
    [ "$rc" -eq 0 ] || status=1
}
stage triton_tests 150 python3 -m pytest -q -p no:cacheprovider tests/model/test_triton_backend.py
stage runner_tests 120 python3 -m pytest -q -p no:cacheprovider tests/model/test_runner.py
stage throughput 180 python3 benchmarks/gpu/throughput.py
echo "== check.sh: $([ $status -eq 0 ] && echo all stages passed || echo some stage FAILED)"
exit $status
