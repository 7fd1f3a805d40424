"""radixserve: LLM serving with a radix-tree prefix cache. Public API: LLM, SamplingParams, EngineConfig."""
from radixserve.config import EngineConfig, ServerConfig
from radixserve.sampling_params import SamplingParams

__version__ = "0.1.0"  # the one place it is written: pyproject.toml reads it from here


def __getattr__(name: str):
    # LLM pulls in torch; import it lazily so `import radixserve` stays light for router/bench.
    if name == "LLM":
        from radixserve.llm import LLM
        return LLM
    raise AttributeError(name)


__all__ = ["LLM", "SamplingParams", "EngineConfig", "ServerConfig", "__version__"]
