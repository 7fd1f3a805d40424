"""Bounded rendering of request validation errors as one InvalidRequest ."""
from __future__ import annotations

from pydantic import ValidationError

from radixserve.errors import InvalidRequest

MAX_ERROR_DETAILS = 3        # validation errors quoted in one message
MAX_ERROR_MESSAGE_CHARS = 2000


def validation_error(err: ValidationError) -> InvalidRequest:
    """One InvalidRequest (400) with a bounded message: a few errors quoted, never the input."""
    details = err.errors(include_url=False, include_input=False, include_context=False)
    return InvalidRequest(*render_details(details))


def render_details(details: list[dict]) -> tuple[str, str | None]:
    """(message, param) for a list of pydantic-style error dicts with "loc" and "msg"."""
    if not details:
        return "invalid request body", None
    parts = []
    for d in details[:MAX_ERROR_DETAILS]:
        loc = ".".join(str(x) for x in d.get("loc", ()) if x != "body")
        msg = str(d.get("msg", "invalid value"))[:200]
        parts.append(f"{loc}: {msg}" if loc else msg)
    message = "; ".join(parts)
    if len(details) > MAX_ERROR_DETAILS:
        message += f" (and {len(details) - MAX_ERROR_DETAILS} more errors)"
    first_loc = [str(x) for x in details[0].get("loc", ()) if x != "body"]
    param = ".".join(first_loc)[:200] or None
    return message[:MAX_ERROR_MESSAGE_CHARS], param
