"""A storage server having a bad day: an HTTP proxy in front of a real one (moto's S3) that fails requests the way
object stores do in production, so the tests see what s3fs, botocore and lightdist do with real faults.

Each request is passed to ``faults``, a function of the method, the object's path and how many times that request
was seen, which names the fault to answer with, or ``None`` to pass it through:

- ``"throttle"``: 503 SlowDown, S3's answer to too many requests;
- ``"error"``: 500 InternalError;
- ``"reset"``: the connection dropped without an answer, as when a server or a load balancer goes away;
- ``"slow"``: passed through after a pause;
- ``"hold"``: no answer until the proxy is stopped, then the connection dropped: an upload stalled while its client
  dies.
"""

from __future__ import annotations

import http.client
import socket
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Literal
from urllib.parse import unquote, urlsplit

Fault = Literal["throttle", "error", "reset", "slow", "hold"]
FaultPlan = Callable[[str, str, int], Fault | None]

_ERRORS = {
    "throttle": (503, "SlowDown", "Please reduce your request rate."),
    "error": (500, "InternalError", "We encountered an internal error. Please try again."),
}
SLOW_SECONDS = 1.0


class FaultyStorage:
    """``with FaultyStorage(upstream, faults) as endpoint:`` serves at ``endpoint`` until the block ends.

    ``injected`` counts the faults answered, so a test can check that its storage really misbehaved; ``served``,
    the bytes of the bodies passed back from upstream, what clients downloaded."""

    def __init__(self, upstream: str, faults: FaultPlan) -> None:
        self.upstream = urlsplit(upstream).netloc
        self.faults = faults
        self.injected: Counter[Fault] = Counter()
        self.served = 0
        self._seen: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        self.stopped = threading.Event()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), _relay_to(self))
        self._server.daemon_threads = True

    def __enter__(self) -> str:
        threading.Thread(target=self._server.serve_forever, daemon=True).start()
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __exit__(self, *exc_info: object) -> None:
        self.stopped.set()
        self._server.shutdown()
        self._server.server_close()

    def fault_for(self, method: str, path: str) -> Fault | None:
        with self._lock:
            self._seen[method, path] += 1
            fault = self.faults(method, path, self._seen[method, path])
            if fault is not None:
                self.injected[fault] += 1
            return fault


def _relay_to(storage: FaultyStorage) -> type[BaseHTTPRequestHandler]:
    class Relay(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, as S3 clients expect; answers Expect: 100-continue

        def relay(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            fault = storage.fault_for(self.command, unquote(urlsplit(self.path).path))
            if fault == "hold":
                storage.stopped.wait()
                fault = "reset"
            if fault == "reset":
                # SO_LINGER 0: closing sends a TCP reset rather than an orderly end of the connection.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.close_connection = True
                return
            if fault in _ERRORS:
                status, code, message = _ERRORS[fault]
                self.answer(status, {"Content-Type": "application/xml"}, _s3_error(code, message))
                return
            if fault == "slow":
                time.sleep(SLOW_SECONDS)
            upstream = http.client.HTTPConnection(storage.upstream, timeout=60)
            try:
                headers = {name: value for name, value in self.headers.items() if name.lower() != "expect"}
                upstream.request(self.command, self.path, body=body, headers=headers)
                response = upstream.getresponse()
                data = response.read()
                passed = {
                    name: value
                    for name, value in response.getheaders()
                    if name.lower() not in ("transfer-encoding", "connection", "content-length")
                }
                with storage._lock:  # counted before the client has the bytes, so a count read after a read is whole
                    storage.served += len(data)
                self.answer(response.status, passed, data, length=response.getheader("Content-Length"))
            finally:
                upstream.close()

        def answer(self, status: int, headers: dict[str, str], data: bytes, length: str | None = None) -> None:
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            # A HEAD answer states the object's length without sending it.
            self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

        do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = relay

    return Relay


def _s3_error(code: str, message: str) -> bytes:
    return (
        f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message>'
        "<RequestId>lightdist-faulty-storage</RequestId></Error>"
    ).encode()
