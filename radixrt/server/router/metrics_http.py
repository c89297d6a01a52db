"""`radixrt router --metrics-port P`: GET /metrics over HTTP, beside the router's ZeroMQ port.

A thread of the router's process serves it as a client of the router's own socket (the `metrics`
op, which joins the workers' texts and the router's counters), so the router's loop stays one
thread. With keys configured it asks for the admin key as a Bearer token, as the gateway's
/metrics does: the text names every tenant.

Open to whoever reaches the port, it bounds what one connection may hold: a socket read or write
that waits READ_TIMEOUT_S, or a request not read whole within REQUEST_DEADLINE_S (a client
trickling bytes), ends the connection; past MAX_CONNECTIONS at once a new one is closed unread.
"""

from __future__ import annotations

import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST

from radixrt.client.endpoint import ZmqEndpoint
from radixrt.server.tenants import KeyRing

logger = logging.getLogger(__name__)
Request = socket.socket | tuple[bytes, socket.socket]  # what socketserver hands a handler

SCRAPE_TIMEOUT_S = 35.0  # beyond the router's own wait for its workers (GATHER_TIMEOUT_S)
READ_TIMEOUT_S = 5.0
REQUEST_DEADLINE_S = 10.0
MAX_CONNECTIONS = 16  # a scraper or two, and their retries


class _BoundedServer(ThreadingHTTPServer):
    """A thread per connection, at most MAX_CONNECTIONS of them."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler]):
        super().__init__(address, handler)
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)

    def process_request(self, request: Request, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.shutdown_request(request)  # full: closed at once, nothing read
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Request, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _DeadlineHandler(BaseHTTPRequestHandler):
    """Each socket operation waits at most READ_TIMEOUT_S (http.server's `timeout`), and the
    request line and headers must have arrived within REQUEST_DEADLINE_S: then the socket is
    shut, which ends the blocked read."""

    timeout = READ_TIMEOUT_S

    def setup(self) -> None:
        super().setup()
        self.deadline = threading.Timer(REQUEST_DEADLINE_S, self._cut)
        self.deadline.daemon = True
        self.deadline.start()

    def _cut(self) -> None:
        try:
            self.request.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass  # closed already

    def parse_request(self) -> bool:
        parsed = super().parse_request()  # reads the headers
        self.deadline.cancel()  # read whole: answering may take the scrape's time
        return parsed

    def finish(self) -> None:
        self.deadline.cancel()
        super().finish()


def serve_metrics(host: str, port: int, router_url: str, keys: KeyRing) -> ThreadingHTTPServer:
    """Start serving /metrics on (host, port) in a daemon thread; the caller shuts it down."""
    endpoint = ZmqEndpoint(router_url, api_key=keys.any_key(), timeout=SCRAPE_TIMEOUT_S)

    class Handler(_DeadlineHandler):
        def do_GET(self) -> None:  # noqa: N802 (the http.server name)
            if self.path.split("?")[0] != "/metrics":
                return self._answer(404, b"only /metrics here\n", "text/plain")
            given = self.headers.get("Authorization", "").removeprefix("Bearer ").strip()
            principal = keys.principal_of(given)
            if principal is None or not principal.admin:
                return self._answer(401, b"/metrics needs the admin API key\n", "text/plain")
            try:
                text = endpoint.metrics().encode()
            except Exception as e:  # the router is gone or busy: the scraper sees a 503
                return self._answer(
                    503, f"the router does not answer: {e}\n".encode(), "text/plain"
                )
            self._answer(200, text, CONTENT_TYPE_LATEST)

        def _answer(self, status: int, body: bytes, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            logger.debug(format, *args)

    server = _BoundedServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http").start()
    return server
