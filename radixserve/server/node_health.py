"""`serve --node-rank K > 0`: a machine running only TP ranks still answers GET /health and /live on --port, 200 while
its ranks run, so one probe set fits every pod of a multi-node group (deploy/k8s/tp/). Other paths: 404 (no API)."""
from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

PATHS = ("/health", "/live")


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:   # noqa: N802 (http.server's name)
        ok = self.path in PATHS
        body = json.dumps({"status": "ok", "role": "tensor-parallel ranks only"} if ok else
                          {"error": {"message": f"{self.path}: node rank > 0 serves no API (node 0 does)",
                                     "type": "not_found", "code": 404}}).encode()
        self.send_response(200 if ok else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:   # probes every few seconds: not logged
        pass


@contextmanager
def node_health(sock: socket.socket) -> Iterator[None]:
    """Serve the health paths on `sock` (bound, not listening) from a thread until the block ends, then close it."""
    server = ThreadingHTTPServer(sock.getsockname()[:2], _Handler, bind_and_activate=False)
    server.socket.close()
    server.socket = sock
    server.server_activate()
    thread = threading.Thread(target=server.serve_forever, name="node-health", daemon=True)
    thread.start()
    try:
        yield
    finally:
        server.shutdown()
        server.server_close()
