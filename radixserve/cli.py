"""Command line: `radixserve serve|route|fleet|agent|bench|chat` (serve: one worker, HTTP + engine process)."""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any, NoReturn

from radixserve import __version__
from radixserve.config import add_dataclass_args, from_args
from radixserve.engine_config import EngineConfig
from radixserve.server_config import ServerConfig


class OneLineErrorParser(argparse.ArgumentParser):
    """Usage errors are one line on stderr and exit code 2, not the whole usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def add_serve_command(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="run an OpenAI-compatible server",
        description="Serve one model over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /health).")
    server = parser.add_argument_group("server")
    add_dataclass_args(server, ServerConfig)
    engine = parser.add_argument_group("engine")
    add_dataclass_args(engine, EngineConfig)
    parser.set_defaults(func=run_serve)


def build_runner(config: EngineConfig) -> Any:
    """EngineFactory's runner factory, in the engine process (only it imports torch); starts this node's TP ranks."""
    from radixserve.runner.tp import load_runner

    return load_runner(config)


def run_serve(args: argparse.Namespace) -> int:
    """`radixserve serve`: flags, model path and port are checked before loading. Returns 2 for a
    bad flag or model path, 1 for an unbindable port or a failed start-up, else serve()'s code."""
    from radixserve.http_common import PortUnavailable, bind_socket
    from radixserve.weights.checkpoint_config import check_checkpoint
    from radixserve.weights.default_draft import with_default_draft
    from radixserve.weights.paths import ModelPathError, resolve_model_path

    try:
        server_config = from_args(ServerConfig, args)
        engine_config = from_args(EngineConfig, args)
        model_path = resolve_model_path(engine_config.model_path, need_tokenizer=True)
        engine_config = with_default_draft(engine_config)
        check_checkpoint(engine_config, model_path)
        if server_config.warmup_prompts is not None:
            from radixserve.server.warmup import read_prompts
            read_prompts(server_config.warmup_prompts)   # a bad file fails now, not after loading
    except (ValueError, ModelPathError) as exc:
        return _fail(exc, 2)
    try:
        sock = bind_socket(server_config.host, server_config.port)
    except PortUnavailable as exc:
        return _fail(f"{exc} (choose another with --host / --port)", 1)
    with sock:
        if engine_config.node_rank > 0:   # this machine's ranks only; /health and /live for its probes
            from radixserve.runner.tp import serve_node
            from radixserve.server.node_health import node_health
            # node 0 ends the group after its drain (a lost node 0 ends it too): SIGTERM here would cut that drain
            signal.signal(signal.SIGTERM, lambda *_: logging.getLogger("radixserve").warning(
                "SIGTERM ignored: node %d's ranks stop when node 0 ends the group", engine_config.node_rank))
            with node_health(sock):
                return serve_node(engine_config)
        if engine_config.device not in (None, "cpu"):
            try:
                from radixserve.runner.device import resolve_device
                resolve_device(engine_config.device)
            except ValueError as exc:
                return _fail(exc, 2)
        logging.basicConfig(level=server_config.log_level.upper(),
                            format="%(asctime)s %(levelname)s %(name)s: %(message)s")
        from radixserve.compose import EngineFactory
        from radixserve.server.app import serve
        factory = EngineFactory(build_runner, server_config.enable_fault_injection)
        try:
            return asyncio.run(serve(engine_config, server_config, factory, model_path, sock))
        except KeyboardInterrupt:
            return 0
        except Exception as exc:
            log = logging.getLogger("radixserve")
            log.debug("serve failed", exc_info=True)
            log.error("%s: %s (run with --log-level debug for the traceback)", type(exc).__name__, exc)
            return 1


def _fail(error: object, code: int) -> int:
    print(f"radixserve serve: error: {error}", file=sys.stderr)
    return code


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="radixserve",
                                     description="LLM serving with a radix-tree prefix cache.")
    parser.add_argument("--version", action="version", version=f"radixserve {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                       parser_class=OneLineErrorParser)
    add_serve_command(subparsers)
    subparsers.add_parser("bench", help="benchmark a server: run, sweep, compare (see bench --help)",
                          add_help=False)
    for name, text in SUBCOMMANDS_HELP.items():
        subparsers.add_parser(name, help=text, add_help=False)
    return parser


SUBCOMMANDS = {"bench": "radixserve.bench.cli", "route": "radixserve.router.cli",
               "fleet": "radixserve.router.fleet", "agent": "radixserve.agent.cli",
               "chat": "radixserve.chat.cli"}
SUBCOMMANDS_HELP = {"route": "cache-aware router in front of workers (see route --help)",
                    "fleet": "start N workers and a router on this machine (see fleet --help)",
                    "agent": "ops agent that watches a fleet and acts (see agent --help)",
                    "chat": "chat in the terminal with a server or a local model (see chat --help)"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] and argv[0] in SUBCOMMANDS:
        import importlib
        return importlib.import_module(SUBCOMMANDS[argv[0]]).main(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


def entry() -> NoReturn:
    """The `radixserve` script; after `serve` or `route` it skips interpreter finalization."""
    argv = sys.argv[1:]
    code = main(argv)
    if argv[:1] in (["serve"], ["route"]):
        from radixserve.engine.loop import end_process_now
        end_process_now(code)
    sys.exit(code)


if __name__ == "__main__":
    entry()
