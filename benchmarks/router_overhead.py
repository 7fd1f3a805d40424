"""What `radixserve route` adds to one request, with the engine taken out: a stub worker answers at once.

    PYTHONPATH=. python benchmarks/router_overhead.py [--requests 400] [--stream] [--chat] [-- extra route flags]

The stub worker (this file, run as a subprocess with `--stub PORT`) is a bare asyncio HTTP/1.1 server: /health
and /get_server_info answer what the router's monitor reads, POST /v1/completions (/v1/chat/completions with
--chat) returns a fixed 1-token completion (or an SSE stream with --stream). `--router-prefix CMD` runs the
router under CMD (e.g. "py-spy record -o FILE --format raw --"). Requests are sequential over one kept-alive client
connection, alternating direct-to-stub and through-router, so drift hits both alike. Prints p50 / p99 of each
and of the router's added latency per pair (router minus direct), in ms, the router's CPU per request (ms,
without --router-prefix) and the 1-minute load average.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx

from radixserve.bench.launch import free_ports, wait_healthy

COMPLETION = json.dumps({
    "id": "cmpl-stub", "object": "text_completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "text": " Paris", "logprobs": None, "finish_reason": "length",
                 "token_ids": [7042]}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}).encode()
STREAM = (b'data: {"id":"cmpl-stub","object":"text_completion","created":0,"model":"stub","choices":[{"index":0,'
          b'"text":" Paris","logprobs":null,"finish_reason":"length","token_ids":[7042]}]}\n\n'
          b"data: [DONE]\n\n")
CHAT = json.dumps({
    "id": "chatcmpl-stub", "object": "chat.completion", "created": 0, "model": "stub",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": " Paris"}, "logprobs": None,
                 "finish_reason": "length", "token_ids": [7042]}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5}}).encode()
CHAT_STREAM = b"".join(b"data: " + json.dumps({
    "id": "chatcmpl-stub", "object": "chat.completion.chunk", "created": 0, "model": "stub",
    "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish, **ids}]},
    separators=(",", ":")).encode() + b"\n\n" for delta, finish, ids in (
        ({"role": "assistant", "content": ""}, None, {}),
        ({"content": " Paris"}, "length", {"token_ids": [7042]}))) + b"data: [DONE]\n\n"
SERVER_INFO = json.dumps({"engine": {"num_running_reqs": 0, "num_waiting_reqs": 0, "token_usage": 0.0,
                                     "cache_hit_rate": 0.0}}).encode()
HEALTH = json.dumps({"status": "ok", "instance_id": "stub"}).encode()
BODY = {"model": "stub", "prompt": "The capital of France", "max_tokens": 1, "temperature": 0}
CHAT_BODY = {"model": "stub", "messages": [{"role": "user", "content": "The capital of France?"}],
             "max_tokens": 1, "temperature": 0}


def _response(body: bytes, content_type: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: " + content_type + b"\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


async def stub_worker(port: int) -> None:
    """Serves until killed; one response per request, keep-alive, no chunked bodies."""
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                lines = head.decode("latin-1").split("\r\n")
                path = lines[0].split(" ")[1]
                length = next((int(v) for k, _, v in (ln.partition(":") for ln in lines[1:])
                               if k.strip().lower() == "content-length"), 0)
                body = json.loads(await reader.readexactly(length)) if length else {}
                if path.startswith("/health"):
                    out = _response(HEALTH, b"application/json")
                elif path.startswith("/get_server_info"):
                    out = _response(SERVER_INFO, b"application/json")
                else:
                    chat = path.startswith("/v1/chat")
                    if body.get("stream"):
                        out = _response(CHAT_STREAM if chat else STREAM, b"text/event-stream")
                    else:
                        out = _response(CHAT if chat else COMPLETION, b"application/json")
                writer.write(out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await server.serve_forever()


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return round(s[min(len(s) - 1, int(q * len(s)))], 3)


def cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` (Linux /proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--stream", action="store_true")
    p.add_argument("--chat", action="store_true", help="POST /v1/chat/completions")
    p.add_argument("--router-prefix", default="", help="command words to run the router under")
    p.add_argument("--stub", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("route_args", nargs="*", help="extra `radixserve route` flags (after --)")
    args = p.parse_args()
    if args.stub is not None:
        asyncio.run(stub_worker(args.stub))
        return
    stub_port = free_ports(2)
    router_port = stub_port + 1
    stub, router = f"http://127.0.0.1:{stub_port}", f"http://127.0.0.1:{router_port}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([sys.executable, __file__, "--stub", str(stub_port)], env=env)]
    body = {**(CHAT_BODY if args.chat else BODY), "stream": args.stream}
    path = "/v1/chat/completions" if args.chat else "/v1/completions"
    try:
        wait_healthy(stub, procs[0], name="stub")
        procs.append(subprocess.Popen([*args.router_prefix.split(), sys.executable, "-m", "radixserve.cli", "route",
                                       "--port", str(router_port), "--worker-urls", stub, "--log-level", "warning",
                                       *args.route_args], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_healthy(router, procs[1], name="router")
        with httpx.Client(timeout=30, trust_env=False) as c:
            def post(url: str) -> float:
                t = time.perf_counter()
                r = c.post(url + path, json=body)
                r.read()
                assert r.status_code == 200, r.text
                return (time.perf_counter() - t) * 1e3

            for _ in range(50):
                post(stub), post(router)
            t_direct, t_router = [], []
            cpu0 = cpu_s(procs[1].pid)
            for _ in range(args.requests):
                t_direct.append(post(stub))
                t_router.append(post(router))
            router_cpu = (cpu_s(procs[1].pid) - cpu0) / args.requests * 1e3
    finally:
        for i, proc in enumerate(procs):  # a profiler writes its file on SIGINT
            proc.send_signal(signal.SIGINT if i and args.router_prefix else signal.SIGTERM)
        for proc in procs:
            proc.wait(30)
    added = [r - d for r, d in zip(t_router, t_direct)]
    print(json.dumps({"load_avg_1m": os.getloadavg()[0], "requests": args.requests, "path": path,
                      "stream": args.stream,
                      "direct_p50_ms": pct(t_direct, 0.5), "direct_p99_ms": pct(t_direct, 0.99),
                      "router_p50_ms": pct(t_router, 0.5), "router_p99_ms": pct(t_router, 0.99),
                      "router_added_p50_ms": pct(added, 0.5), "router_added_p99_ms": pct(added, 0.99),
                      "router_cpu_ms_per_request": round(router_cpu, 3)}))


if __name__ == "__main__":
    main()
