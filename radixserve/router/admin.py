"""Router admin API (/admin/*): list, add, remove, drain, undrain and weigh workers; tune the policy."""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response

from radixserve.errors import InvalidRequest, RadixServeError
from radixserve.http_common import bearer_key_check, read_body
from radixserve.router.state import RouterState
from radixserve.router.validate import finite_number, json_object, worker_url
from radixserve.router.worker import AGENT, DRAIN_OWNERS, OPERATOR, check_weight

logger = logging.getLogger(__name__)

MAX_ADMIN_BODY_BYTES = 64 << 10
POLICY_PARAMS = ("cache_threshold", "balance_abs_threshold", "balance_rel_threshold")


class WorkerNotFound(RadixServeError):
    """HTTP 404."""

    status = 404
    type = "not_found_error"
    code = "worker_not_found"


class DrainedByOperator(RadixServeError):
    """HTTP 409: the agent's undrain of a worker the operator drained."""

    status = 409
    type = "conflict_error"
    code = "drained_by_operator"


def admin_key_check(admin_api_key: str | None) -> Callable[[Request], Any]:
    """`Authorization: Bearer <admin_api_key>` or Unauthorized (401); no key allows all."""
    return bearer_key_check(admin_api_key, "admin key")


async def _body(request: Request) -> dict:
    return json_object(await read_body(request, MAX_ADMIN_BODY_BYTES, "the admin API's fixed limit"),
                       "body")


def _url(body: dict) -> str:
    try:
        return worker_url(body.get("url"))
    except ValueError as exc:
        raise InvalidRequest(str(exc), param="url") from None


def _drained_by(body: dict) -> str:
    """POST /admin/drain's "by": one of DRAIN_OWNERS, the operator when absent or null; else 400."""
    by = body.get("by")
    if by is None:
        return OPERATOR
    if not isinstance(by, str) or by not in DRAIN_OWNERS:
        raise InvalidRequest(f"by must be one of {', '.join(DRAIN_OWNERS)}", param="by")
    return by


def _number(body: dict, name: str) -> float:
    try:
        return finite_number(body.get(name), name)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=name) from None


def validate_policy_params(body: dict) -> dict[str, float]:
    """The policy parameters in `body`; InvalidRequest (400) for unknown or out-of-range ones."""
    unknown = set(body) - set(POLICY_PARAMS)
    if unknown or not body:
        raise InvalidRequest(f"give one or more of {', '.join(POLICY_PARAMS)}"
                             + (f"; unknown: {', '.join(sorted(unknown))}" if unknown else ""))
    params = {name: _number(body, name) for name in body}
    if not 0.0 <= params.get("cache_threshold", 0.0) <= 1.0:
        raise InvalidRequest("cache_threshold must be in [0, 1]", param="cache_threshold")
    if params.get("balance_abs_threshold", 0.0) < 0:
        raise InvalidRequest("balance_abs_threshold must be >= 0", param="balance_abs_threshold")
    if params.get("balance_rel_threshold", 1.0) < 1.0:
        raise InvalidRequest("balance_rel_threshold must be >= 1", param="balance_rel_threshold")
    return params


def build_admin_router(state: RouterState) -> APIRouter:
    admin = APIRouter(prefix="/admin", dependencies=[Depends(admin_key_check(
        state.config.admin_api_key))])
    _membership_routes(admin, state)
    _worker_routes(admin, state)
    _policy_routes(admin, state)
    return admin


def _worker_of(state: RouterState, body: dict) -> Any:
    url = _url(body)
    worker = state.registry.get(url)
    if worker is None:
        raise WorkerNotFound(f"no worker {url}", param="url")
    return worker


def _listing(state: RouterState, worker: Any) -> Response:
    return JSONResponse(worker.to_json(state.registry.clock()))


def _membership_routes(admin: APIRouter, state: RouterState) -> None:
    pending: set[asyncio.Task] = set()

    @admin.get("/workers")
    async def list_workers() -> Response:
        """Every worker; in PD mode the prefill workers then the decode ones, each with its "role"."""
        now = state.registry.clock()
        if state.pd is None:
            return JSONResponse({"workers": [w.to_json(now) for w in state.registry.list()]})
        sides = (("prefill", state.registry), ("decode", state.pd.decode.registry))
        return JSONResponse({"workers": [{**w.to_json(now), "role": role} for role, reg in sides for w in reg.list()]})

    @admin.post("/add_worker")
    async def add_worker(request: Request) -> Response:
        body = await _body(request)
        url = _url(body)
        try:
            weight = check_weight(body.get("weight", 1.0))
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="weight") from None
        if state.registry.get(url) is not None:
            raise InvalidRequest(f"worker {url} is already registered", param="url")
        worker = state.add_worker(url, weight, healthy=False)
        task = asyncio.create_task(state.monitor.check(worker))  # traffic once it passes
        pending.add(task)
        task.add_done_callback(pending.discard)
        logger.info("admin: added worker %s (weight %s)", url, weight)
        return _listing(state, worker)

    @admin.post("/remove_worker")
    async def remove_worker(request: Request) -> Response:
        worker = _worker_of(state, await _body(request))
        state.remove_worker(worker.url)
        logger.info("admin: removed worker %s (%d in flight finish)", worker.url, worker.in_flight)
        return JSONResponse({"removed": worker.url, "in_flight": worker.in_flight})


def _worker_routes(admin: APIRouter, state: RouterState) -> None:
    @admin.post("/drain")
    async def drain(request: Request) -> Response:
        body = await _body(request)
        worker = _worker_of(state, body)
        worker.drain(_drained_by(body))
        logger.info("admin: draining %s by the %s (%d in flight)", worker.url, worker.drained_by,
                    worker.in_flight)
        return _listing(state, worker)

    @admin.post("/undrain")
    async def undrain(request: Request) -> Response:
        body = await _body(request)
        worker = _worker_of(state, body)
        if _drained_by(body) == AGENT and worker.drained_by == OPERATOR:
            raise DrainedByOperator(f"{worker.url} was drained by the operator; the agent leaves it",
                                    param="by")
        worker.undrain()
        logger.info("admin: undrained %s", worker.url)
        return _listing(state, worker)

    @admin.post("/set_weight")
    async def set_weight(request: Request) -> Response:
        body = await _body(request)
        worker = _worker_of(state, body)
        try:
            worker.weight = check_weight(body.get("weight"))
        except ValueError as exc:
            raise InvalidRequest(str(exc), param="weight") from None
        logger.info("admin: weight of %s set to %s", worker.url, worker.weight)
        return _listing(state, worker)


def _policy_routes(admin: APIRouter, state: RouterState) -> None:
    @admin.post("/set_policy_params")
    async def set_policy_params(request: Request) -> Response:
        params = validate_policy_params(await _body(request))
        logger.info("admin: policy parameters %s", params)
        return JSONResponse(state.set_policy_params(params))

    @admin.get("/policy")
    async def policy() -> Response:
        return JSONResponse(state.policy_params())
