"""`radixserve agent --router URL [flags]`: run the ops agent (sweep loop plus /metrics and /status)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from radixserve.agent.config import AgentConfig, LadderConfig, RuleConfig
from radixserve.config import add_dataclass_args, from_args
from radixserve.http_common import setup_logging

logger = logging.getLogger("radixserve.agent")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="radixserve agent",
        description="Watch a fleet through its router and workers; drain, restart or isolate "
                    "sick workers after confirmation; log every decision (docs/ops_agent.md).")
    parser.add_argument("--router", required=True, help="the router's base URL (http://host:port)")
    add_dataclass_args(parser.add_argument_group("agent"), AgentConfig)
    add_dataclass_args(parser.add_argument_group("rules (findings)"), RuleConfig)
    add_dataclass_args(parser.add_argument_group("ladder (decisions)"), LadderConfig)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parse flags and run until SIGINT/SIGTERM; returns the exit code (2 on bad flags)."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        cfg, rule_cfg, ladder_cfg = (from_args(c, args)
                                     for c in (AgentConfig, RuleConfig, LadderConfig))
    except ValueError as exc:
        parser.error(str(exc))
    if cfg.supervise and not cfg.fleet_manifest:
        parser.error("--supervise needs --fleet-manifest (the restart recipe of each worker)")
    setup_logging(cfg.log_level)
    import uvicorn

    from radixserve.agent.agent import Agent
    from radixserve.agent.app import build_app

    agent = Agent(args.router, cfg, rule_cfg, ladder_cfg)
    server = uvicorn.Server(uvicorn.Config(build_app(agent), host=cfg.host, port=cfg.port,
                                           log_level="warning"))
    mode = "dry run (decides and logs, never acts)" if cfg.dry_run else (
        "supervising (restarts from the fleet manifest)" if cfg.supervise else "acting (no restarts)")
    logger.info("watching router %s every %.1f s, %s; /status on http://%s:%d",
                args.router, cfg.sweep_interval_s, mode, cfg.host, cfg.port)
    try:
        asyncio.run(server.serve())
    except KeyboardInterrupt:
        pass
    logger.info("agent stopped")
    return 0
