#!/usr/bin/env bash
# GPU check on one H200: CUDA parity tests, runner throughput, then the whole engine (offline API
# and `radixserve serve` against CPU fp32, and the bench sweep); one JSON of results, $OUT/check.json.
#
# NOT YET RUN ON A GPU. Written on a CPU-only machine, where the same tests pass under the
# Triton interpreter and throughput.py passes its `--device cpu --tiny` smoke run. Expect the
# first GPU run to find things (kernel compile limits, tolerances); each stage below has its
# own time limit and log, so one failing stage still leaves the others' results.
#
# Machine: python3 3.12 with torch 2.11, triton 3.6, transformers and pytest already installed;
# no fastapi/uvicorn/pyzmq/msgspec/gguf/pydantic/prometheus-client. Run from anywhere:
#     bash benchmarks/gpu/check.sh            # about 8-10 minutes (stage limits add up to 10)
#     bash benchmarks/gpu/check.sh --device cpu   # dry run of stages 4-5 on CPU (no GPU stages)
# Logs and throughput.json go to $OUT when set, else benchmarks/gpu/out/.
#
# Stages:
#   1. tests/model/test_triton_backend.py: triton vs the torch backend per layer on the same
#      cache, and vs transformers (CPU, fp32) end to end; fp32, bf16, FP8 KV; on cuda.
#   2. tests/model/test_runner.py: its runners default to cuda when a GPU is present, and the
#      auto backend there is triton: the full transformers-parity suite (fp32; bf16 test too).
#   3. benchmarks/gpu/throughput.py: 1B and 8B shapes, bf16, torch and triton backends.
#   4. benchmarks/gpu/engine_check.py: the offline API (default, torch, triton backends, n-gram
#      speculation, host tier, small KV pool; bf16 and FP8 KV reported) against CPU fp32.
#   5. benchmarks/gpu/serve_check.py: `radixserve serve` on cuda against a CPU worker over HTTP
#      (bench --check-output), then `radixserve bench sweep`. Needs the wheels below.
#
# Wheels to carry: stages 1-4 need none (they import torch, triton, numpy,
# safetensors, transformers and pytest, all there). For the rest of the test suite (server,
# API, GGUF tests) and stage 5, carry in .whl/ these cp312 manylinux x86_64 / py3-none-any wheels, the
# versions this project's environment has:
#   fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.13.4 pydantic-core==2.46.4
#   annotated-types==0.7.0 typing-inspection==0.4.2 pyzmq==27.3.0 msgspec==0.23.0 gguf==0.19.0
#   pytest-asyncio==1.5.0 openai==3.57.0 jiter==0.19.0 distro==1.9.0
set -u -o pipefail
cd "$(dirname "$0")/../.."
device=cuda
[ "${1:-}" = "--device" ] && device=${2:?--device needs cpu or cuda}
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
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
    python3 -c "import sys, torch, triton, transformers; print(sys.version.split()[0], 'torch', torch.__version__,
'triton', triton.__version__, 'transformers', transformers.__version__); assert torch.cuda.is_available()" || exit 1
fi

status=0
stage() {  # stage NAME SECONDS CMD...: run with a time limit, log to $OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    echo "== $name (limit ${limit}s): $*"
    local start=$SECONDS
    OUT=$parts timeout "$limit" "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc=$rc in $((SECONDS - start))s"
    stages+=("$name=$rc")
    [ "$rc" -eq 0 ] || status=1
}
stages=()
parts=$(mktemp -d)   # the stages' own JSON and server logs; $OUT keeps the stage logs and check.json (8 files at most)
if [ "$device" = cuda ]; then
    stage triton_tests 150 python3 -m pytest -q -p no:cacheprovider tests/model/test_triton_backend.py
    stage runner_tests 120 python3 -m pytest -q -p no:cacheprovider tests/model/test_runner.py
    stage throughput 180 python3 benchmarks/gpu/throughput.py
    engine_checks=default,torch,triton,ngram,host_tier,small_pool,bf16,fp8_kv
else
    engine_checks=default,torch,ngram,host_tier,small_pool   # triton's interpreter is slow on CPU
fi
model=$(mktemp -d)/tiny
stage engine_check 120 python3 benchmarks/gpu/engine_check.py --device "$device" --model-dir "$model" \
    --checks "$engine_checks"
stage serve_check 150 python3 benchmarks/gpu/serve_check.py --device "$device" --model-dir "$model"
python3 - "$parts" "$OUT" "${stages[@]}" <<'PY'
import json, pathlib, sys
parts, out, stages = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3:]
result = {"stages": dict(s.split("=") for s in stages)}
for name in ("throughput", "engine_check", "serve_check"):
    path = parts / f"{name}.json"
    if path.is_file():
        result[name] = json.loads(path.read_text())
(out / "check.json").write_text(json.dumps(result, indent=1) + "\n")
print("check.json:", result["stages"])
PY
echo "== check.sh: $([ $status -eq 0 ] && echo all stages passed || echo some stage FAILED)"
exit $status
