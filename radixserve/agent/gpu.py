"""GPU health readings through NVML (`nvidia-ml-py`), imported only when present; absent -> skipped with a note."""
from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("radixserve.agent")


def read_nvml() -> tuple[list[dict] | None, str]:
    """Per-GPU readings (AIBrix diagnose inputs): index, name,
    volatile uncorrected ECC errors, retired pages pending, PCIe link width now and max,
    temperature (C). Returns (readings, note); readings is None when NVML is not installed
    or finds no GPU, and the note says which."""
    try:
        import pynvml  # type: ignore[import-not-found]
    except ImportError:
        return None, "GPU checks skipped: nvidia-ml-py (pynvml) is not installed"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return None, f"GPU checks skipped: NVML did not start ({exc})"
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            return None, "GPU checks skipped: no GPU"
        return [_read_one(pynvml, i) for i in range(count)], f"{count} GPU(s) read through NVML"
    finally:
        pynvml.nvmlShutdown()


def _read_one(nvml: Any, index: int) -> dict:
    handle = nvml.nvmlDeviceGetHandleByIndex(index)
    reading: dict[str, Any] = {"index": index, "name": str(nvml.nvmlDeviceGetName(handle))}
    probes = {
        "ecc_uncorrected": lambda: nvml.nvmlDeviceGetTotalEccErrors(
            handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC),
        "retired_pages_pending": lambda: int(nvml.nvmlDeviceGetRetiredPagesPendingStatus(handle)),
        "pcie_width": lambda: nvml.nvmlDeviceGetCurrPcieLinkWidth(handle),
        "pcie_width_max": lambda: nvml.nvmlDeviceGetMaxPcieLinkWidth(handle),
        "temperature_c": lambda: nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU),
    }
    for key, read in probes.items():
        try:
            reading[key] = read()
        except nvml.NVMLError as exc:  # not supported on this GPU: recorded as unknown
            logger.debug("NVML %s unavailable on GPU %d: %s", key, index, exc)
            reading[key] = None
    return reading
