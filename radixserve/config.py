"""What every config dataclass shares: `opt` fields, the flags built from them, and shared defaults."""
from __future__ import annotations

import argparse
import dataclasses
import math
import os
import pathlib
from dataclasses import field
from typing import Any, get_type_hints


def cache_root() -> pathlib.Path:
    """$RADIXSERVE_CACHE_DIR, else $XDG_CACHE_HOME/radixserve, else ~/.cache/radixserve: every on-disk cache."""
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(os.environ.get("RADIXSERVE_CACHE_DIR") or pathlib.Path(base) / "radixserve")


def check_timeouts(body_s: float, read_s: float) -> None:
    """ValueError unless --request-body-timeout and --request-read-timeout are finite and > 0."""
    if not (0 < body_s < math.inf and 0 < read_s < math.inf):
        raise ValueError("--request-body-timeout and --request-read-timeout must be finite and > 0")


GRACEFUL_SHUTDOWN_TIMEOUT_S = 25.0   # s; under Kubernetes' default 30 s grace period (docs/drain.md)
GRACE_HELP = ("seconds that SIGTERM/SIGINT lets requests in flight finish (new ones get 503, "
              "/health says draining); then the rest end with a 503 error and the process exits")
REQUEST_BODY_TIMEOUT_S = 10.0
BODY_TIMEOUT_HELP = ("seconds a request body may stall between two reads (a Content-Length "
                     "larger than what arrives) before the request gets 408 request_timeout")
REQUEST_READ_TIMEOUT_S = 60.0
READ_TIMEOUT_HELP = ("seconds a request's headers and body may take to arrive, from the connection opening or the "
                     "previous response ending; then it gets 408 request_timeout and the connection closes")


def opt(default: Any, help: str, choices: tuple | None = None) -> Any:
    """A config field with its flag's help text and choices (add_dataclass_args reads them)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def add_dataclass_args(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add one `--field-name` flag per dataclass field, typed and documented from the field."""
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        flag = "--" + f.name.replace("_", "-")
        hint = hints[f.name]
        meta = f.metadata
        if hint is bool:
            parser.add_argument(flag, action="store_true", help=meta.get("help"))
            continue
        kind = next((t for t in (int, float) if hint is t or t in getattr(hint, "__args__", ())), str)
        text = meta.get("help")
        if "default" not in text and "unset" not in text:   # a help that explains its default keeps it
            text = f"{text} (default: {f.default})"
        choices = meta.get("choices")
        if kind is str and choices:
            kind = _any_case(choices)
        parser.add_argument(flag, type=kind, default=f.default, choices=choices, help=text)


def _any_case(choices: tuple) -> Any:
    """A flag type that spells a value as its choice does whatever its case (NGRAM, as SGLang
    writes it, is ngram); other values pass through for argparse's invalid-choice error."""
    by_lower = {str(c).lower(): c for c in choices}
    return lambda value: by_lower.get(value.lower(), value)


def from_args(cls: type, args: argparse.Namespace) -> Any:
    """Build `cls` from the parsed flags that `add_dataclass_args` added."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})
