"""Closed-by-default HTTP posture: Host / Origin / API key checks, JSON-only bodies with a size
limit and a read deadline (an ASGI middleware), and a header deadline per connection (a uvicorn
protocol subclass against slow-loris clients).

Every rejection is answered in the OpenAI error envelope, or on Ollama's routes (/api/*) in
Ollama's `{"error": "..."}`.

The web page (`/` and `/static/*`) needs no API key: it holds no secret and is where the key is
entered; the Host check still applies to it, and every route it calls needs the key.

Browser origins: those named by --allow-origin, and by default this server's own loopback
origins (http://localhost:PORT, http://127.0.0.1:PORT, http://[::1]:PORT with PORT the port it
listens on), as Ollama allows localhost origins; any other origin is refused.

Ollama's routes accept a body whatever its Content-Type (Ollama does: `curl -d '{...}'` sends
application/x-www-form-urlencoded); the body must still parse as JSON. This opens no cross-site
hole: the type check is only a second line against a page's form post, which browsers send with
an Origin header that the origin check refuses first. The OpenAI routes stay JSON-only.
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import json
from dataclasses import dataclass, field
from functools import partial
from urllib.parse import urlsplit

LOOPBACK_NAMES = {"localhost", "127.0.0.1", "::1", "[::1]"}
CORS_ALLOW_HEADERS = ("authorization, content-type, accept, openai-beta, openai-organization, "
                      "openai-project, x-stainless-arch, x-stainless-async, x-stainless-lang, "
                      "x-stainless-os, x-stainless-package-version, x-stainless-retry-count, "
                      "x-stainless-runtime, x-stainless-runtime-version, "
                      "x-stainless-read-timeout, x-stainless-timeout, x-stainless-raw-response, "
                      "x-stainless-helper-method, x-stainless-stream-helper")
PUBLIC_PATHS = {"/health", "/"}  # and the page's files under /static/ (no secret in them)
STATIC_PREFIX = "/static/"
OLLAMA_PREFIX = "/api/"
BODY_METHODS = ("POST", "PUT", "PATCH", "DELETE")


def is_loopback(host: str) -> bool:
    h = host.strip("[]")
    if h == "localhost":
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def host_name(value: str) -> str:
    """The host part of a Host header (port removed, IPv6 brackets kept off)."""
    v = value.strip().lower()
    if v.startswith("["):
        return v[1:v.find("]")] if "]" in v else v
    return v.rsplit(":", 1)[0] if v.count(":") == 1 else v


@dataclass
class SecurityConfig:
    bind_host: str = "127.0.0.1"
    api_key: str | None = None
    allow_origins: list[str] = field(default_factory=list)
    max_body_bytes: int = 4 << 20
    body_timeout: float = 30.0
    header_timeout: float = 10.0
    port: int | None = None  # the port listened on (its loopback origins are allowed)
    # clients may send chat_template_kwargs.chat_template (template source: code run here)
    allow_client_chat_template: bool = False

    @property
    def loopback(self) -> bool:
        return is_loopback(self.bind_host)

    def check(self) -> None:
        """The server refuses to start open to the network without an API key."""
        if not self.loopback and not self.api_key:
            raise ValueError(f"binding to {self.bind_host} (not loopback) requires --api-key "
                             "(or MLXR_API_KEY)")


def own_origin(origin: str, port: int | None) -> bool:
    """True for http://localhost|127.0.0.1|[::1] on `port` (the port this server listens on)."""
    if port is None:
        return False
    try:
        u = urlsplit(origin)
        return (u.scheme == "http" and u.hostname in ("localhost", "127.0.0.1", "::1")
                and (u.port or 80) == port and u.path in ("", "/"))
    except ValueError:  # a malformed port
        return False


def _origin_ok(cfg: SecurityConfig, origin: str) -> bool:
    return "*" in cfg.allow_origins or origin.rstrip("/") in {
        o.rstrip("/") for o in cfg.allow_origins} or own_origin(origin, cfg.port)


async def send_error(send, status: int, message: str, type: str = "invalid_request_error",
                     code: str | None = None, headers: list | None = None,
                     ollama: bool = False) -> None:
    body = json.dumps({"error": message} if ollama else {
        "error": {"message": message, "type": type, "param": None, "code": code}}).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": hdrs + (headers or [])})
    await send({"type": "http.response.body", "body": body})


class SecurityMiddleware:
    """ASGI middleware applying SecurityConfig to every HTTP request."""

    def __init__(self, app, cfg: SecurityConfig):
        self.app, self.cfg = app, cfg
        self.loopback = cfg.loopback  # once: parsing the bind address costs ~2 us a request

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        cfg = self.cfg
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        method, path = scope["method"], scope["path"]
        ollama = path.startswith(OLLAMA_PREFIX)
        send_error_ = send_error
        if ollama:
            send_error_ = partial(send_error, ollama=True)
        # DNS rebinding: a page on evil.com resolving to 127.0.0.1 still sends Host: evil.com
        if self.loopback and host_name(headers.get("host", "")) not in LOOPBACK_NAMES:
            return await send_error_(send, 403, "Host header must name this loopback server",
                                     "permission_error", "invalid_host")
        origin = headers.get("origin")
        cors: list = []
        if origin is not None:
            if not _origin_ok(cfg, origin):
                return await send_error_(send, 403, f"origin {origin!r} is not allowed "
                                         "(see --allow-origin)", "permission_error",
                                         "origin_not_allowed")
            cors = [(b"access-control-allow-origin", origin.encode("latin-1")),
                    (b"vary", b"Origin")]
            if method == "OPTIONS":
                await send({"type": "http.response.start", "status": 204, "headers": cors + [
                    (b"access-control-allow-methods", b"GET, POST, DELETE, OPTIONS"),
                    (b"access-control-allow-headers", CORS_ALLOW_HEADERS.encode()),
                    (b"access-control-max-age", b"600")]})
                return await send({"type": "http.response.body", "body": b""})
        if cfg.api_key and path not in PUBLIC_PATHS and not path.startswith(STATIC_PREFIX):
            auth = headers.get("authorization", "")
            scheme, _, token = auth.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    token.strip().encode(), cfg.api_key.encode()):
                return await send_error_(send, 401, "missing or invalid API key (send "
                                         "'Authorization: Bearer <key>')", "invalid_request_error",
                                         "invalid_api_key",
                                         [(b"www-authenticate", b"Bearer")] + cors)
        if cors:
            send = _with_headers(send, cors)
        if method in BODY_METHODS:
            ctype = headers.get("content-type", "").split(";")[0].strip().lower()
            if ctype != "application/json" and not ollama:
                return await send_error_(send, 415, "request body must be JSON "
                                         "(Content-Type: application/json)",
                                         code="unsupported_media_type")
            try:
                length = int(headers.get("content-length", "0") or 0)
            except ValueError:
                return await send_error_(send, 400, "bad Content-Length")
            body: bytes | None = b""
            try:  # asyncio.timeout, not wait_for: no task per request (3.11's wait_for makes one)
                async with asyncio.timeout(cfg.body_timeout):
                    body, done = (None, False) if length > cfg.max_body_bytes else \
                        await self._read_body(receive)
                    if not done:  # read what the client sends before answering: a reply
                        await _drain(receive)  # over unread data is lost to a TCP reset
            except TimeoutError:
                if body is None:
                    return await send_error_(send, 413, f"request body over "
                                            f"{cfg.max_body_bytes} bytes",
                                            code="request_too_large",
                                            headers=[(b"connection", b"close")])
                return await send_error_(send, 408, "request body not received in time",
                                        code="request_timeout")
            if body is None:
                return await send_error_(send, 413, f"request body over {cfg.max_body_bytes} "
                                        "bytes", code="request_too_large",
                                        headers=[(b"connection", b"close")])
            receive = _replay(body, receive)
        return await self.app(scope, receive, send)

    async def _read_body(self, receive) -> tuple[bytes | None, bool]:
        """(body, done): body None once it passes the limit; done when the client's last
        message was read (a body over the limit can end in the very message that crossed it,
        and draining after that would wait for a message that never comes)."""
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                raise asyncio.CancelledError
            chunk = msg.get("body", b"")
            size += len(chunk)
            done = not msg.get("more_body")
            if size > self.cfg.max_body_bytes:
                return None, done
            chunks.append(chunk)
            if done:
                return b"".join(chunks), True


PROBE_INTERVAL = 0.5  # seconds between probes of a client that shut down its sending side
# A body over the limit is read and dropped up to this many bytes (then the 413 goes out
# anyway): enough for the bodies clients send by mistake, not a free upload sink
DRAIN_BYTES = 64 << 20


async def _drain(receive, limit: int = DRAIN_BYTES) -> None:
    size = 0
    while size <= limit:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            raise asyncio.CancelledError
        size += len(msg.get("body", b""))
        if not msg.get("more_body"):
            return


def _replay(body: bytes, receive):
    sent = False

    async def replay():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replay


def _with_headers(send, extra: list):
    async def wrapped(msg):
        if msg["type"] == "http.response.start":
            msg = dict(msg, headers=list(msg.get("headers", [])) + extra)
        await send(msg)
    return wrapped


def deadline_protocol(header_timeout: float, max_header_bytes: int = 64 * 1024):
    """A uvicorn HTTP protocol class that closes connections whose request headers do not arrive
    within `header_timeout` seconds (after connect, and after each response on keep-alive).

    Built on uvicorn's httptools protocol when httptools is installed (what uvicorn's own "auto"
    picks: a C parser, several times cheaper per streamed chunk than h11's pure-Python framing),
    else on h11. httptools has no bound on the size of a request head, so one is kept here
    (`max_header_bytes`, as h11_max_incomplete_event_size does for h11): past it the answer is
    431 and the connection is closed."""
    try:
        import httptools  # noqa: F401
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol as Base
    except ImportError:
        from uvicorn.protocols.http.h11_impl import H11Protocol as Base
    httptools_based = Base.__name__ == "HttpToolsProtocol"

    class DeadlineProtocol(Base):
        _deadline = None
        _head_bytes = 0

        def _arm(self):
            self._disarm()
            self._head_bytes = 0
            self._deadline = self.loop.call_later(header_timeout, self._expired)

        def _disarm(self):
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _expired(self):
            self._deadline = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport):
            super().connection_made(transport)
            self._arm()

        if httptools_based:
            def on_headers_complete(self):  # a complete request head arrived
                self._disarm()
                super().on_headers_complete()

            def data_received(self, data):
                super().data_received(data)
                if self._deadline is not None and not self.transport.is_closing():
                    self._head_bytes += len(data)  # still waiting for the end of a head
                    if self._head_bytes > max_header_bytes:
                        self._disarm()
                        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
                                             b"content-length: 0\r\nconnection: close\r\n\r\n")
                        self.transport.close()
        else:
            def handle_events(self):
                before = self.cycle
                super().handle_events()
                if self.cycle is not before:  # a complete request head arrived
                    self._disarm()

        _eof = False

        def eof_received(self):
            """The client shut down its sending side: a half-close (it still waits for the
            reply) or a full close (it left) look the same. Keep the connection open so the
            reply can reach a half-closed client, and probe with interim 102 responses
            (which HTTP/1.1 clients must skip) until the reply starts: to a client that left,
            the second write fails, and that is the disconnect the request is cancelled on."""
            self._eof = True
            self._probe()
            return True

        def _probe(self):
            cycle = getattr(self, "cycle", None)
            if self.transport.is_closing() or cycle is None or cycle.response_started:
                return
            self.transport.write(b"HTTP/1.1 102 Processing\r\n\r\n")
            self.loop.call_later(PROBE_INTERVAL, self._probe)

        def on_response_complete(self):
            super().on_response_complete()
            if self._eof and not self.transport.is_closing():
                self.transport.close()
            elif not self.transport.is_closing():
                self._arm()

        def connection_lost(self, exc):
            self._disarm()
            super().connection_lost(exc)

    return DeadlineProtocol
