"""--device: resolution, and a missing GPU as a one-line start-up error (exit 2), not a traceback."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from radixserve.config import EngineConfig
from radixserve.runner.device import resolve_device


def test_default_device_follows_torch():
    assert resolve_device(None).type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


def test_malformed_device_is_a_config_error():
    with pytest.raises(ValueError, match="cpu, cuda or cuda:N"):
        EngineConfig(device="gpu0")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_startup_error():
    with pytest.raises(ValueError, match="sees no CUDA GPU"):
        resolve_device("cuda")
    done = subprocess.run([sys.executable, "-m", "radixserve", "serve", "--device", "cuda", "--port", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "sees no CUDA GPU; use --device cpu" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
