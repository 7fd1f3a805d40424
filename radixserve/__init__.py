"""radixserve: LLM serving with a radix-tree prefix cache. Public API: LLM, SamplingParams, EngineConfig."""
import os

# Transparent huge pages for torch's CPU buffers (docs/runner.md); read at torch's first CPU
# allocation, hence before any; a value already set (0: off) is kept.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from radixserve.engine_config import EngineConfig  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402
from radixserve.server_config import ServerConfig  # noqa: E402

__version__ = "0.1.0"  # pyproject.toml reads it from here


def __getattr__(name: str):
    if name == "LLM":
        from radixserve.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "ServerConfig", "__version__"]
