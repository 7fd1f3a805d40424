"""radixserve: LLM serving with a radix-tree prefix cache. Public API: LLM, SamplingParams, EngineConfig."""
import os

# Transparent huge pages for torch's large CPU buffers (weights, packed weights, the KV pool): a
# decode step streams every weight, and with 4 KiB pages that costs TLB misses and stops the
# hardware prefetcher at every page boundary (measured in docs/runner.md). torch reads this at
# its first CPU allocation, hence here, before radixserve allocates anything; a value already
# set (0 turns it off) is kept. Where the kernel has THP off, torch's madvise is a no-op.
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

from radixserve.config import EngineConfig, ServerConfig  # noqa: E402
from radixserve.sampling_params import SamplingParams  # noqa: E402

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so `import radixserve` stays light for router/bench.
    if name == "LLM":
        from radixserve.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "ServerConfig", "__version__"]
