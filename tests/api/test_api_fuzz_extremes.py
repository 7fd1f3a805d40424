"""Fuzz of both generation routes with well-formed bodies full of extreme numbers (issue 11):
no 5xx, no open request, running request or page left behind, and the server alive."""
from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.test_api_fuzz import check_response

BIG = [2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30]
EXTREME_INT = st.sampled_from(BIG + [-x for x in BIG]) | st.integers(-3, 70)
TINY_FLOATS = [1e-300, 1e-45, 1e-38, 1.1754943508222875e-38, 1e-6, 1e-5]
EXTREME_FLOAT = (st.sampled_from(TINY_FLOATS + [0.0, 1.0, 2.0, 100.0, 1e6, 1e300, -1e-300, -2.0])
                 | st.floats(-3, 3, allow_nan=False))
SAMPLING = {
    "temperature": EXTREME_FLOAT, "top_p": EXTREME_FLOAT, "min_p": EXTREME_FLOAT,
    "repetition_penalty": EXTREME_FLOAT, "frequency_penalty": EXTREME_FLOAT,
    "presence_penalty": EXTREME_FLOAT, "top_k": EXTREME_INT, "seed": EXTREME_INT,
    "n": st.sampled_from([1, 2, 3, 2**63, 2**64, -1]), "min_tokens": EXTREME_INT,
    "stop_token_ids": st.lists(EXTREME_INT, max_size=3), "stream": st.booleans(),
    "ignore_eos": st.booleans(), "stop": st.sampled_from([None, "a", ["\n", "the"]]),
}
MAX_TOKENS = st.integers(0, 6) | st.sampled_from(BIG + [-1])
PROMPT = (st.text(max_size=30) | st.lists(EXTREME_INT, min_size=1, max_size=8)
          | st.lists(st.integers(0, 49151), min_size=1, max_size=8))
COMPLETION = st.fixed_dictionaries({"prompt": PROMPT, "max_tokens": MAX_TOKENS}, optional={
    **SAMPLING, "logprobs": EXTREME_INT, "echo": st.booleans()})
CHAT = st.fixed_dictionaries({
    "messages": st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system"]),
                                                "content": st.text(max_size=30)}),
                         min_size=1, max_size=2),
    "max_tokens": MAX_TOKENS,
}, optional={**SAMPLING, "logprobs": st.booleans(), "top_logprobs": EXTREME_INT,
             "max_completion_tokens": MAX_TOKENS})
ROUTES = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
IDLE_WAIT_S = 30.0   # aborts of streamed requests are asynchronous; generous on a loaded CI box


def wait_idle(server) -> None:
    """Poll until the engine runs and queues nothing (bounded, so a leak still fails)."""
    deadline = time.monotonic() + IDLE_WAIT_S
    while time.monotonic() < deadline:
        info = server.get("/get_server_info").json()
        if info["num_open_requests"] == 0 and info["engine"]["num_running"] == 0 \
                and info["engine"]["num_waiting"] == 0:
            return
        time.sleep(0.1)


@pytest.mark.parametrize("route", sorted(ROUTES))
def test_extreme_numbers_never_5xx_nor_leak(tiny_server, route):
    statuses: dict[int, int] = {}

    @settings(max_examples=60, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(body=ROUTES[route])
    def run(body: dict) -> None:
        body = {"model": tiny_server.model, **body}
        r = tiny_server.post(route, json=body, timeout=60)
        check_response(r, repr(body).encode())
        statuses[r.status_code] = statuses.get(r.status_code, 0) + 1

    run()
    assert statuses.get(200, 0) > 0 and statuses.get(400, 0) > 0, statuses  # both paths exercised
    wait_idle(tiny_server)
    assert tiny_server.get("/get_server_info").json()["num_open_requests"] == 0
    tiny_server.assert_no_leak()
    tiny_server.assert_alive()
