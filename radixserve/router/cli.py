"""`radixserve route --worker-urls URL... [flags]`: run the cache-aware router in front of workers."""
from __future__ import annotations

import argparse
import logging
import sys

from radixserve.config import add_dataclass_args, from_args
from radixserve.drain import FLUSH_S, GracefulServer
from radixserve.http_common import SERVER_KEEP_ALIVE_S, ReadTimeoutProtocol, quiet_signals, setup_logging
from radixserve.router.config import RouterConfig

logger = logging.getLogger("radixserve.router")


def build_parser(prog: str = "radixserve route") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog, allow_abbrev=False,
        description="Route OpenAI requests to radixserve workers by prefix affinity and load, "
                    "with retries, circuit breakers, health checks and an admin API.")
    parser.add_argument("--worker-urls", nargs="*", default=[], metavar="URL",
                        help="worker base URLs (http://host:port); more can be added through "
                             "POST /admin/add_worker")
    parser.add_argument("--prefill", nargs="+", default=[], metavar="URL",
                        help="PD mode: prefill workers (--disaggregation-mode prefill); needs --decode")
    parser.add_argument("--decode", nargs="+", default=[], metavar="URL",
                        help="PD mode: decode workers (--disaggregation-mode decode); needs --prefill")
    add_dataclass_args(parser.add_argument_group("router"), RouterConfig)
    return parser


def load_tokenizer(path: str | None) -> object | None:
    if path is None:
        return None
    from radixserve.tokenizer.tokenizer import Tokenizer
    return Tokenizer.load(path)


def run(config: RouterConfig, worker_urls: list[str], prefill_urls: list[str] | None = None,
        decode_urls: list[str] | None = None) -> int:
    """Serve until SIGINT/SIGTERM, which drain first (drain.py); 1 if start-up failed."""
    import uvicorn

    from radixserve.router.app import build_app
    from radixserve.router.state import build_pd_state, build_state

    try:
        tokenizer = load_tokenizer(config.tokenizer_path)
        if prefill_urls or decode_urls:
            if not prefill_urls or not decode_urls or worker_urls:
                raise ValueError("PD mode takes --prefill and --decode URLs, and no --worker-urls")
            state = build_pd_state(config, prefill_urls, decode_urls, tokenizer)
            worker_urls = [*prefill_urls, *decode_urls]
        else:
            state = build_state(config, worker_urls, tokenizer)
    except (OSError, ValueError) as exc:
        logger.error("router start-up failed: %s: %s", type(exc).__name__, exc)
        return 1
    app = build_app(state)
    uv = uvicorn.Config(app, host=config.host, port=config.port, log_level=config.log_level,
                        access_log=config.log_level == "debug", timeout_keep_alive=SERVER_KEEP_ALIVE_S,
                        timeout_graceful_shutdown=FLUSH_S, http=ReadTimeoutProtocol.bounded(config.request_read_timeout))
    print(f"radixserve: routing ({config.policy}) over {len(worker_urls)} worker(s) on "
          f"http://{config.host}:{config.port}", flush=True)
    with quiet_signals():
        GracefulServer(uv, state.drain).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    """Returns the exit code (2 on bad flags)."""
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = from_args(RouterConfig, args)
    except ValueError as exc:
        print(f"radixserve route: error: {exc}", file=sys.stderr)
        return 2
    setup_logging(config.log_level)
    return run(config, args.worker_urls, args.prefill, args.decode)
