"""Who may reach the session browser, and which requests may act: binding, token, ``Host``, same-origin and
CSRF checks, and the response headers (docs/ui.md, "Safe by default").
"""

from __future__ import annotations

import hmac
import ipaddress
import secrets
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loomray.errors import LoomrayUserError

COOKIE = "loomray_ui"
TOKEN_ENV = "LOOMRAY_UI_TOKEN"
_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")

SECURITY_HEADERS = {
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
                               "connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cache-control": "no-store",
}


def is_loopback(host: str) -> bool:
    """True for a loopback name or address (``127.0.0.0/8``, ``::1``, ``localhost``)."""
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_binding(host: str, token: str | None) -> None:
    """Refuse to serve on a non-loopback address without a token."""
    if not is_loopback(host) and not token:
        raise LoomrayUserError(f"the UI binds to {host}, which is not a loopback address: give it a token "
                               f"(--token or {TOKEN_ENV}) so that only people who have it can reach it")


@dataclass
class Guard:
    """The server's secrets and the checks of every request (see the module doc)."""

    token: str | None
    loopback: bool
    csrf: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    def token_ok(self, request: Request) -> bool:
        """The request carries the token (always true when none is set)."""
        if not self.token:
            return True
        auth = request.headers.get("authorization", "")
        given = auth[7:] if auth.lower().startswith("bearer ") else request.cookies.get(COOKIE, "")
        return hmac.compare_digest(given.encode(), self.token.encode())

    def host_ok(self, request: Request) -> bool:
        """A loopback server answers to loopback host names only (no DNS rebinding)."""
        if not self.loopback:
            return True
        host = urlsplit("//" + request.headers.get("host", "")).hostname or ""
        return is_loopback(host)

    def same_origin(self, request: Request) -> bool:
        """The request came from this server's own page: its Origin, else its Sec-Fetch-Site, says so."""
        origin = request.headers.get("origin")
        if origin is not None:
            return origin == f"{request.url.scheme}://{request.headers.get('host', '')}"
        return request.headers.get("sec-fetch-site", "same-origin") in ("same-origin", "none")

    def csrf_ok(self, form_token: object) -> bool:
        """The form carries this server's CSRF token."""
        return isinstance(form_token, str) and hmac.compare_digest(form_token.encode(), self.csrf.encode())


class GuardMiddleware:
    """Applies a :class:`Guard` to every HTTP request and adds the security headers to every response."""

    def __init__(self, app: ASGIApp, guard: Guard) -> None:
        self.app, self.guard = app, guard

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request = Request(scope)
        refusal = self._refusal(request)
        if refusal is not None:
            await self._with_headers(refusal, scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []),
                                      *((k.encode(), v.encode()) for k, v in SECURITY_HEADERS.items())]
            await send(message)

        await self.app(scope, receive, send_with_headers)

    def _refusal(self, request: Request) -> Response | None:
        if not self.guard.host_ok(request):
            return PlainTextResponse("unknown host", status_code=421)
        given = request.query_params.get("token")
        if given is not None and self.guard.token and hmac.compare_digest(given.encode(), self.guard.token.encode()):
            # Trade the token in the URL for a cookie, and drop it from the address bar and history.
            target = request.url.remove_query_params("token")
            response = RedirectResponse(target.path + (f"?{target.query}" if target.query else ""), status_code=303)
            response.set_cookie(COOKIE, self.guard.token, httponly=True, samesite="strict", path="/")
            return response
        if not self.guard.token_ok(request):
            return PlainTextResponse("this session browser needs its token: open it as /?token=...",
                                     status_code=401)
        if request.method not in ("GET", "HEAD") and not self.guard.same_origin(request):
            return PlainTextResponse("refused: a cross-site request", status_code=403)
        return None

    async def _with_headers(self, response: Response, scope: Scope, receive: Receive, send: Send) -> None:
        for k, v in SECURITY_HEADERS.items():
            response.headers[k] = v
        await response(scope, receive, send)
