"""`radixrt router --metrics-port P`: GET /metrics over HTTP, beside the router's ZeroMQ port.

A thread of the router's process serves it as a client of the router's own socket (the `metrics`
op, which joins the workers' texts and the router's counters), so the router's loop stays one
thread. With keys configured it asks for the admin key as a Bearer token, as the gateway's
/metrics does: the text names every tenant.
"""

from __future__ import annotations

import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST

from radixrt.client.endpoint import RuntimeEndpoint
from radixrt.server.tenants import KeyRing

logger = logging.getLogger(__name__)

SCRAPE_TIMEOUT_S = 35.0  # beyond the router's own wait for its workers (GATHER_TIMEOUT_S)


def serve_metrics(host: str, port: int, router_url: str, keys: KeyRing) -> ThreadingHTTPServer:
    """Start serving /metrics on (host, port) in a daemon thread; the caller shuts it down."""
    endpoint = RuntimeEndpoint(router_url, api_key=keys.any_key(), timeout=SCRAPE_TIMEOUT_S)

    class Handler(BaseHTTPRequestHandler):
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

    server = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=server.serve_forever, daemon=True, name="metrics-http").start()
    return server
