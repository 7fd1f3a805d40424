"""`radixserve chat`: a terminal chat that streams replies from a server (--url) or a model in this process.

Each line is a user turn; replies stream to stdout, notices and errors to stderr. `/reset` forgets
the conversation (not --system), `/exit` (or Ctrl-D) leaves; Ctrl-C during a reply stops it."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TextIO

from radixserve.chat.backends import ChatBackend, ChatError, HttpBackend, LocalBackend, Turn

PROG = "radixserve chat"
PROMPT = "> "
COMMANDS_HELP = "commands: /reset (forget the conversation), /exit (leave)"


def build_parser() -> argparse.ArgumentParser:
    """Parser of `chat`: where replies come from (--url or --model-path) and how they are sampled."""
    parser = argparse.ArgumentParser(
        prog=PROG, allow_abbrev=False,
        description="Chat in the terminal, replies streamed as they are generated: with a running "
                    "server or router (--url) or with a model loaded in this process (--model-path, "
                    "default: the embedded SmolLM2-135M-Instruct). Each line read is a user turn, "
                    "also when stdin is piped. " + COMMANDS_HELP + "; Ctrl-D or Ctrl-C at the "
                    "prompt leaves, Ctrl-C during a reply stops it.")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--url", help="base URL of a radixserve server or router "
                                      "(e.g. http://127.0.0.1:30000)")
    source.add_argument("--model-path", help="load this HF folder or .gguf file in-process "
                                             "(without --url; default: the embedded model)")
    parser.add_argument("--api-key", help="the server's --api-key (sent as a Bearer token)")
    parser.add_argument("--model", help="model id to ask the server for (default: the first "
                                        "one /v1/models lists)")
    parser.add_argument("--system", help="system prompt, first in every conversation")
    parser.add_argument("--temperature", type=float, default=0.7,
                        help="sampling temperature, 0 = greedy (default: 0.7)")
    parser.add_argument("--max-tokens", type=int, default=512,
                        help="most tokens per reply (default: 512)")
    return parser


class ChatSession:
    """The conversation and read-reply loop over one backend; a failed or stopped turn leaves the history unchanged."""

    def __init__(self, backend: ChatBackend, system: str | None, temperature: float,
                 max_tokens: int, out: TextIO, err: TextIO):
        self.backend, self.out, self.err = backend, out, err
        self.system, self.temperature, self.max_tokens = system, temperature, max_tokens
        self.history: list[dict] = []
        self.failed = False

    def run(self, read_line: Callable[[], str]) -> int:
        """Turns from `read_line` (EOFError at the end) until /exit; 1 when any turn failed, else 0."""
        while True:
            try:
                line = read_line().strip()
            except (EOFError, KeyboardInterrupt):
                return int(self.failed)
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    return int(self.failed)
                continue
            self.reply(line)

    def command(self, line: str) -> bool:
        name = line.split()[0]
        if name in ("/exit", "/quit"):
            return False
        if name == "/reset":
            self.history.clear()
            self.err.write("(conversation cleared)\n")
        else:
            self.err.write(f"unknown command {name}; {COMMANDS_HELP}\n")
        return True

    def messages(self, user_text: str) -> list[dict]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, *self.history, {"role": "user", "content": user_text}]

    def reply(self, user_text: str) -> None:
        """Stream one reply to `out`; on success add the turn to the history."""
        turn = Turn(self.messages(user_text), self.temperature, self.max_tokens)
        stream = self.backend.stream(turn)
        parts: list[str] = []
        try:
            for text in stream:
                parts.append(text)
                self.out.write(text)
                self.out.flush()
        except KeyboardInterrupt:
            stream.close()   # stops the generation
            self.out.write("\n")
            self.err.write("(reply stopped; this turn is not kept)\n")
            return
        except ChatError as exc:
            if parts:
                self.out.write("\n")
            self.err.write(f"{PROG}: error: {exc}\n")
            self.failed = True
            return
        self.out.write("\n")
        self.out.flush()
        self.history += [{"role": "user", "content": user_text},
                         {"role": "assistant", "content": "".join(parts)}]


def interactive_reader(err: TextIO) -> Callable[[], str]:
    """input() with a prompt and line editing (readline where available)."""
    try:
        import readline  # noqa: F401  (imported for its side effect on input())
    except ImportError:
        err.write("(no readline: line editing is off)\n")

    def read() -> str:
        try:
            return input(PROMPT)
        except (EOFError, KeyboardInterrupt):
            err.write("\n")
            raise
    return read


def piped_reader(stream: TextIO) -> Callable[[], str]:
    def read() -> str:
        line = stream.readline()
        if not line:
            raise EOFError
        return line.rstrip("\n")
    return read


def open_backend(args: argparse.Namespace) -> ChatBackend:
    """The backend the flags name; raises ChatError or ModelPathError (a FileNotFoundError)."""
    if args.url:
        return HttpBackend(args.url, args.api_key, args.model)
    sys.stderr.write(f"loading {args.model_path or 'the embedded default model'} ...\n")
    return LocalBackend(args.model_path)


def main(argv: list[str] | None = None) -> int:
    """Returns 0, 1 when the source cannot be opened or a turn failed, 2 for bad flags."""
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.max_tokens < 1 or args.temperature < 0:
        parser.error("--max-tokens must be >= 1 and --temperature >= 0")
    if not args.url and (args.api_key or args.model):
        parser.error("--api-key and --model go with --url (a local model is --model-path)")
    try:
        backend = open_backend(args)
    except (ChatError, FileNotFoundError) as exc:
        sys.stderr.write(f"{PROG}: error: {exc}\n")
        return 1
    except KeyboardInterrupt:
        return 1
    interactive = sys.stdin.isatty()
    read = interactive_reader(sys.stderr) if interactive else piped_reader(sys.stdin)
    if interactive:
        sys.stderr.write(f"{COMMANDS_HELP}; Ctrl-C stops a reply, Ctrl-D leaves\n")
    session = ChatSession(backend, args.system, args.temperature, args.max_tokens,
                          sys.stdout, sys.stderr)
    try:
        return session.run(read)
    finally:
        backend.close()
