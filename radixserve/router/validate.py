"""Checks of what clients and operators hand the router: JSON bodies, worker URLs, finite numbers."""
from __future__ import annotations

import ipaddress
import json
import math
import re
from typing import Any
from urllib.parse import urlsplit

import httpx

from radixserve.errors import InvalidRequest

DEFAULT_PORTS = {"http": 80, "https": 443}
# a DNS name or an IPv4 address; underscores allowed (container service names)
LABEL = r"[a-z0-9_]([a-z0-9_-]*[a-z0-9_])?"
HOST_NAME = re.compile(rf"{LABEL}(\.{LABEL})*")
JSON_KINDS = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


def json_object(raw: bytes, what: str = "request body") -> dict:
    """`raw` parsed; raises InvalidRequest (400), its message about the body (never an exception's
    name), unless it is UTF-8 JSON whose top level is an object within the recursion limit."""
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the {what} is not valid UTF-8: byte 0x{raw[exc.start]:02x} at "
                             f"offset {exc.start}") from None
    except json.JSONDecodeError as exc:
        if not raw.strip():
            raise InvalidRequest(f"the {what} is empty; send a JSON object") from None
        raise InvalidRequest(f"the {what} is not valid JSON: {exc.msg} at line {exc.lineno} "
                             f"column {exc.colno}") from None
    except RecursionError:
        raise InvalidRequest(f"the {what} is not valid JSON: nested too deeply") from None
    if not isinstance(body, dict):
        kind = JSON_KINDS.get(type(body), "a number")
        raise InvalidRequest(f"the {what} must be a JSON object, not {kind}")
    return body


def finite_number(value: Any, name: str) -> float:
    """Raises ValueError unless `value` is a non-bool number whose float is finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be a finite number (this one is too large)") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be a finite number")
    return number


def worker_url(url: Any) -> str:
    """Canonical `scheme://host:port` (http/https, lower-case, port always written, IPv6 in brackets). Raises ValueError
    on a bad host or port, a path but "/", a query, a fragment, user info, whitespace or control characters."""
    if not isinstance(url, str):
        raise ValueError("worker url must be a string like http://host:port")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise ValueError(f"worker url {url!r} contains whitespace or control characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"worker url {url!r} is malformed: {exc}") from None
    scheme = parts.scheme.lower()
    if scheme not in DEFAULT_PORTS:
        raise ValueError(f"worker url {url!r} must start with http:// or https://")
    if "@" in parts.netloc or "?" in url or "#" in url or parts.path not in ("", "/"):
        raise ValueError(f"worker url {url!r} must be scheme://host[:port] only "
                         "(no user info, path, query or fragment)")
    host = _host(parts.hostname or "", url)
    if port == 0:
        raise ValueError(f"worker url {url!r} has port 0")
    canonical = f"{scheme}://{host}:{port or DEFAULT_PORTS[scheme]}"
    try:
        httpx.URL(canonical)
    except httpx.InvalidURL as exc:
        raise ValueError(f"worker url {url!r} is not usable: {exc}") from None
    return canonical


def _host(host: str, url: str) -> str:
    if ":" in host:
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ValueError(f"worker url {url!r} has a bad IPv6 address") from None
        return f"[{host}]"
    if not HOST_NAME.fullmatch(host):
        raise ValueError(f"worker url {url!r} has no valid host")
    return host
