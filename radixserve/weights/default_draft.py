"""The default model's trained draft head (training/train_draft_head.py), on by default when that model is served.

`with_default_draft(config)` is what `radixserve serve` and the offline LLM call on their EngineConfig:
    --speculative-algorithm none        -> no speculation (the value leaves as None)
    unset, the default model served     -> EAGLE with DEFAULT_DRAFT_HEAD, unless the configuration refuses EAGLE
                                           (e.g. --kv-cache-dtype fp8_e4m3, --tp-size 2): then none, one log line
    anything else                       -> unchanged"""
from __future__ import annotations

import dataclasses
import logging
import os

from radixserve.engine_config import EngineConfig
from radixserve.weights.paths import DEFAULT_MODEL_FILE, ModelPathError, resolve_model_path

logger = logging.getLogger(__name__)

DEFAULT_DRAFT_HEAD = os.path.join(os.path.dirname(__file__), "drafts",
                                  DEFAULT_MODEL_FILE.removesuffix(".gguf") + ".eagle.safetensors")


def serves_default_model(model_path: str | None) -> bool:
    if model_path is None:
        return True
    try:
        default, given = resolve_model_path(None), resolve_model_path(model_path)
    except ModelPathError:
        return False
    return os.path.realpath(default) == os.path.realpath(given)


def with_default_draft(config: EngineConfig) -> EngineConfig:
    """`config` with its speculative decoding resolved as the module docstring says."""
    if config.speculative_algorithm == "none":
        return dataclasses.replace(config, speculative_algorithm=None)
    if config.speculative_algorithm is not None or not serves_default_model(config.model_path):
        return config
    if not os.path.exists(DEFAULT_DRAFT_HEAD):
        logger.info("speculative decoding off: the default draft head %s is missing", DEFAULT_DRAFT_HEAD)
        return config
    try:
        eagle = dataclasses.replace(config, speculative_algorithm="EAGLE",
                                    speculative_draft_model_path=DEFAULT_DRAFT_HEAD)
    except ValueError as e:
        logger.info("speculative decoding off (the default model's draft head needs EAGLE: %s)", e)
        return config
    logger.info("speculative decoding: EAGLE with the default model's trained draft head "
                "(--speculative-algorithm none turns it off)")
    return eagle
