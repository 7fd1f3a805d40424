"""Who drained a worker: POST /admin/drain's "by" and GET /admin/workers' "drained_by", on the router app in-process."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from radixserve.router.app import build_app
from radixserve.router.config import RouterConfig
from radixserve.router.state import build_state

W0, W1 = "http://w0:8000", "http://w1:8000"


def admin_calls(calls: list[tuple[str, dict]]) -> list[httpx.Response]:
    """POST each (path, body) in order to a router over W0 and W1 (no worker is contacted:
    the app's lifespan, which starts health checks, does not run), then GET /admin/workers;
    the answers, the listing last."""
    state = build_state(RouterConfig(), [W0, W1])

    async def main() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            out = [await client.post(path, json=body) for path, body in calls]
            out.append(await client.get("/admin/workers"))
        await state.http.aclose()
        return out
    return asyncio.run(main())


def owners(listing: httpx.Response) -> dict[str, tuple[bool, str | None]]:
    return {w["url"]: (w["draining"], w["drained_by"]) for w in listing.json()["workers"]}


def test_a_drain_without_by_is_the_operators_and_by_agent_is_the_agents():
    *answers, listing = admin_calls([("/admin/drain", {"url": W0}),
                                     ("/admin/drain", {"url": W1, "by": "agent"})])
    assert [a.json()["drained_by"] for a in answers] == ["operator", "agent"]
    assert owners(listing) == {W0: (True, "operator"), W1: (True, "agent")}


def test_undrain_clears_the_owner_and_an_explicit_null_is_the_operator():
    *_, listing = admin_calls([("/admin/drain", {"url": W0, "by": "agent"}),
                               ("/admin/undrain", {"url": W0}),
                               ("/admin/drain", {"url": W1, "by": None})])
    assert owners(listing) == {W0: (False, None), W1: (True, "operator")}


def test_the_operator_takes_over_the_agents_drain_and_the_agent_never_takes_over_the_operators():
    *_, listing = admin_calls([("/admin/drain", {"url": W0, "by": "agent"}),
                               ("/admin/drain", {"url": W0}),
                               ("/admin/drain", {"url": W1}),
                               ("/admin/drain", {"url": W1, "by": "agent"})])
    assert owners(listing) == {W0: (True, "operator"), W1: (True, "operator")}


@pytest.mark.parametrize("by", ["robot", "", "Agent", 1, ["agent"], {"agent": 1}])
def test_an_unknown_owner_is_a_400_about_by_and_drains_nothing(by):
    answer, listing = admin_calls([("/admin/drain", {"url": W0, "by": by})])
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == "by"
    assert error["message"] == "by must be one of operator, agent"
    assert owners(listing) == {W0: (False, None), W1: (False, None)}


def test_the_agents_undrain_of_an_operators_drain_is_a_409_and_leaves_it():
    *answers, listing = admin_calls([("/admin/drain", {"url": W0, "by": "agent"}),
                                     ("/admin/drain", {"url": W0}),     # the operator takes it over
                                     ("/admin/undrain", {"url": W0, "by": "agent"}),
                                     ("/admin/drain", {"url": W1, "by": "agent"}),
                                     ("/admin/undrain", {"url": W1, "by": "agent"}),
                                     ("/admin/undrain", {"url": W1, "by": "robot"})])
    assert [a.status_code for a in answers] == [200, 200, 409, 200, 200, 400]
    error = answers[2].json()["error"]
    assert (error["type"], error["code"], error["param"]) == ("conflict_error", "drained_by_operator", "by")
    assert owners(listing) == {W0: (True, "operator"), W1: (False, None)}


def test_a_huge_drain_body_is_a_413_naming_the_admin_limit_not_a_flag_that_does_not_change_it():
    answer, listing = admin_calls([("/admin/drain", {"url": W0, "by": "x" * 100_000})])
    assert answer.status_code == 413, answer.text
    assert answer.json()["error"]["message"] == (
        "request body is larger than 65536 bytes (the admin API's fixed limit)")
    assert owners(listing) == {W0: (False, None), W1: (False, None)}


def test_pd_listing_holds_both_sides_with_their_roles():
    """A new user's finding: in PD mode GET /admin/workers listed the prefill workers only."""
    from radixserve.router.state import build_pd_state
    state = build_pd_state(RouterConfig(), [W0], [W1])

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_app(state))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            listing = await client.get("/admin/workers")
        await state.http.aclose()
        await state.pd.decode.http.aclose()
        return listing
    listing = asyncio.run(main())
    assert [(w["url"], w["role"]) for w in listing.json()["workers"]] == [(W0, "prefill"), (W1, "decode")]
