"""--request-body-timeout and --request-read-timeout: finite and > 0 on the worker and the router alike."""
from __future__ import annotations

import math

import pytest

from radixserve.router.config import RouterConfig
from radixserve.server_config import ServerConfig


@pytest.mark.parametrize("config_cls", [ServerConfig, RouterConfig])
@pytest.mark.parametrize("field", ["request_body_timeout", "request_read_timeout"])
@pytest.mark.parametrize("value", [0.0, -1.0, math.inf, math.nan])
def test_a_timeout_that_never_or_always_fires_is_refused(config_cls, field, value):
    with pytest.raises(ValueError, match="must be finite and > 0"):
        config_cls(**{field: value})


@pytest.mark.parametrize("config_cls", [ServerConfig, RouterConfig])
def test_small_timeouts_are_kept(config_cls):
    config = config_cls(request_body_timeout=0.5, request_read_timeout=2.0)
    assert (config.request_body_timeout, config.request_read_timeout) == (0.5, 2.0)
