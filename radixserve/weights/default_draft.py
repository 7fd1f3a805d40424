"""The default model's trained draft head (training/train_draft_head.py), shipped in the package.

`with_default_draft(config)` (`radixserve serve`, the offline LLM) turns EAGLE on the default model without
--speculative-draft-model-path into EAGLE with DEFAULT_DRAFT_HEAD and, unless set, --speculative-draft-min-prob
DEFAULT_DRAFT_MIN_PROB; anything else is unchanged. Off by default: the head does not pay yet (docs/speculative.md)."""
from __future__ import annotations

import dataclasses
import logging
import os

from radixserve.engine_config import EngineConfig
from radixserve.weights.paths import DEFAULT_MODEL_FILE, ModelPathError, resolve_model_path

logger = logging.getLogger(__name__)

DEFAULT_DRAFT_HEAD = os.path.join(os.path.dirname(__file__), "drafts",
                                  DEFAULT_MODEL_FILE.removesuffix(".gguf") + ".eagle.safetensors")
DEFAULT_DRAFT_MIN_PROB = 0.4


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
    if (not config.is_eagle or config.speculative_draft_model_path is not None
            or not serves_default_model(config.model_path) or not os.path.exists(DEFAULT_DRAFT_HEAD)):
        return config
    logger.info("EAGLE drafts with the default model's trained head %s", DEFAULT_DRAFT_HEAD)
    min_prob = config.speculative_draft_min_prob
    min_prob = DEFAULT_DRAFT_MIN_PROB if min_prob is None else min_prob
    return dataclasses.replace(config, speculative_draft_model_path=DEFAULT_DRAFT_HEAD,
                               speculative_draft_min_prob=min_prob)
