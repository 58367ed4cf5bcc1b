"""The review site over HTTP: the standard library's threading server, GET and HEAD only.

No web framework: the site is a handful of read-only paths (``site.py``), and http.server is
enough for one reviewer's browser. It binds 127.0.0.1 by default; it has no login, so anyone who
can reach the port can read every answer of the job.
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

from worker.review.html import CSP, esc, page
from worker.review.site import Response, ReviewSite

log = logging.getLogger(__name__)

SECURITY_HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "X-Frame-Options": "DENY",
}


class _ReviewHandler(BaseHTTPRequestHandler):
    site: ReviewSite  # set on the subclass made by make_server
    server_version = "visbatch-review"
    sys_version = ""

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    def _answer(self, *, send_body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        try:
            response = self.site.get(path)
        except Exception:
            log.exception("review page %s failed", path)
            failed = _error_page("500", "this page failed; see the server's log")
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, failed, send_body)
            return
        if response is None:
            self._send(HTTPStatus.NOT_FOUND, _error_page("404", f"no page {path}"), send_body)
            return
        self._send(HTTPStatus.OK, response, send_body)

    def _send(self, status: HTTPStatus, response: Response, send_body: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", response.content_type)
        self.send_header("Content-Length", str(len(response.body)))
        self.send_header("Cache-Control", "private, max-age=86400" if response.immutable else "no-store")
        for name, value in SECURITY_HEADERS.items():
            self.send_header(name, value)
        self.end_headers()
        if send_body:
            self.wfile.write(response.body)

    def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - the base class's name
        log.debug("%s " + format, self.address_string(), *args)


def _error_page(code: str, message: str) -> Response:
    body = page(code, f'<h1>{esc(code)}</h1><p>{esc(message)}</p><p><a href="/index.html">the job</a></p>')
    return Response(body.encode(), "text/html; charset=utf-8")


def make_server(site: ReviewSite, host: str = "127.0.0.1", port: int = 8000) -> ThreadingHTTPServer:
    """A bound server (port 0: any free port, read it from ``server.server_address``)."""
    handler = type("ReviewHandler", (_ReviewHandler,), {"site": site})
    server = ThreadingHTTPServer((host, port), handler)
    server.daemon_threads = True
    return server
