"""The console's web application (aiohttp): read-only pages, server-rendered.

Pages: ``/`` (scopes), ``/key/KEY`` (one operation or compensation key),
``/dlq`` (the dead-letter queue), ``/live`` (deliveries by outcome, polled
from ``/live.json`` by a small script). Every response carries a strict
Content-Security-Policy (scripts and styles from this origin only, no inline
code, no frames, no form posts) and ``Cache-Control: no-store``.

What it must never do: answer a method other than GET or HEAD (405), change
any state (no verb here writes the journal, acknowledges a dead letter or
sends a frame), render a payload, a frame body, a key or adapter failure
text, or render a value without escaping it (Jinja2 autoescaping is on for
every template; the script writes with ``textContent`` only). A failure is
one short line naming its class, never a traceback.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import importlib.resources
import time
import urllib.parse
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import aiormq
import jinja2
from aiohttp import web

from octo_common.runtime.output import CliError
from octo_common.transport import DEAD_QUEUE
from octo_worker.config import WorkerConfig
from octo_worker.console import data
from octo_worker.console.live import LiveSource
from octo_worker.console.security import (
    COOKIE,
    AccessToken,
    ConsoleSessions,
    host_of,
    is_loopback_host,
)
from octo_worker.inspection import broker_connection, dead_queue

__all__ = ["ConsoleSettings", "build_app"]

_ALLOWED_METHODS: Final = frozenset({"GET", "HEAD"})
_STATIC: Final = {
    "console.css": "text/css",
    "console.js": "text/javascript",
}
CONTENT_SECURITY_POLICY: Final = (
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; form-action 'self'; base-uri 'none'; frame-ancestors 'none'"
)
_SECURITY_HEADERS: Final = {
    "Content-Security-Policy": CONTENT_SECURITY_POLICY,
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
}
_LIVE_POLL_SECONDS: Final = 2


@dataclass
class ConsoleSettings:
    """What one console serves, and for whom."""

    config: WorkerConfig
    config_path: str  # as the operator gave it: the shown commands repeat it
    live: LiveSource
    token: AccessToken | None = None
    served_by_daemon: bool = False
    # The session cookies handed out for a ?token= visit (see security.py).
    sessions: ConsoleSessions = field(default_factory=lambda: ConsoleSessions(8 * 3600.0))


_SETTINGS: Final = web.AppKey("settings", ConsoleSettings)
_TEMPLATES: Final = web.AppKey("templates", jinja2.Environment)
_GATHERING: Final = web.AppKey("gathering", asyncio.Semaphore)
# Pages gathered at once; more requests wait their turn.
_CONCURRENT_GATHERING: Final = 2
T = TypeVar("T")


async def _off_loop(request: web.Request, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
    """Gather a page in a thread of its own, on an event loop of its own.

    Reading a journal authenticates every row it shows; served by the daemon,
    that must not hold up the daemon's loop (deliveries, watchdog). At most
    two pages are gathered at a time.
    """
    async with request.app[_GATHERING]:
        return await asyncio.to_thread(lambda: asyncio.run(work()))


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m {seconds % 60:02d}s"
    if seconds < 86400:
        return f"{seconds // 3600}h {seconds % 3600 // 60:02d}m"
    return f"{seconds // 86400}d {seconds % 86400 // 3600:02d}h"


def _utc(when: float | None) -> str:
    if when is None:
        return "-"
    moment = datetime.datetime.fromtimestamp(when, tz=datetime.UTC)
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


def _environment() -> jinja2.Environment:
    environment = jinja2.Environment(
        loader=jinja2.PackageLoader("octo_worker.console", "templates"),
        autoescape=True,  # every template, whatever its name
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )
    environment.filters["age"] = _age
    environment.filters["utc"] = _utc
    return environment


def _render(request: web.Request, template: str, status: int = 200, **values: Any) -> web.Response:
    settings = request.app[_SETTINGS]
    page = request.app[_TEMPLATES].get_template(template)
    text = page.render(
        page=template.removesuffix(".html"),
        served_by_daemon=settings.served_by_daemon,
        now=time.time(),
        **values,
    )
    return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")


def _plain(status: int, text: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.Response(text=text + "\n", status=status, headers=headers, content_type="text/plain")


# Access ----------------------------------------------------------------------------------


def _authorized(request: web.Request, settings: ConsoleSettings, token: AccessToken) -> bool:
    header = request.headers.get("Authorization", "")
    scheme, _, presented = header.partition(" ")
    if scheme.lower() == "bearer" and token.matches(presented.strip()):
        return True
    return settings.sessions.valid(request.cookies.get(COOKIE))


@web.middleware
async def _guard(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    if request.method not in _ALLOWED_METHODS:
        return _plain(405, "method not allowed: the console is read-only", {"Allow": "GET, HEAD"})
    settings = request.app[_SETTINGS]
    token = settings.token
    if token is not None:
        if not _authorized(request, settings, token):
            presented = request.query.get("token")
            if presented is not None and token.matches(presented):
                # Trade the token in the URL for a cookie, and drop it from the URL.
                query = {k: v for k, v in request.query.items() if k != "token"}
                # One leading slash: "//host/..." would send the browser elsewhere.
                target = urllib.parse.quote("/" + request.path.lstrip("/"))
                if query:
                    target += "?" + urllib.parse.urlencode(query)
                response = web.Response(status=303, headers={"Location": target})
                # A random session id, not anything derived from the token;
                # Secure: sent over HTTPS only (browsers count loopback as such).
                response.set_cookie(
                    COOKIE,
                    settings.sessions.issue(),
                    max_age=int(settings.sessions.lifetime_seconds),
                    httponly=True,
                    secure=True,
                    samesite="Strict",
                    path="/",
                )
                return response
            return _plain(401, "access token required", {"WWW-Authenticate": "Bearer"})
    else:
        host = host_of(request.headers.get("Host"))
        if host is None or not is_loopback_host(host):
            # Without a token only loopback names are served (DNS rebinding).
            return _plain(421, "this console answers only to a loopback host name")
    try:
        return await handler(request)
    except web.HTTPException:
        raise
    except asyncio.CancelledError:
        raise
    except Exception as error:  # never a traceback on a page
        return _plain(500, f"internal error ({type(error).__name__})")


async def _security_headers(_request: web.Request, response: web.StreamResponse) -> None:
    for name, value in _SECURITY_HEADERS.items():
        response.headers[name] = value


# Pages ----------------------------------------------------------------------------------


async def _dead_letter_count(config: WorkerConfig) -> tuple[int | None, str | None]:
    """The queue's message count from a passive declare: no message is touched."""
    try:
        async with broker_connection(config) as connection:
            queue = await dead_queue(connection)
            return int(queue.declaration_result.message_count or 0), None
    except CliError as error:
        return None, error.message
    except (aiormq.exceptions.AMQPError, ConnectionError, TimeoutError) as error:
        return None, f"broker error ({type(error).__name__})"


async def scopes_page(request: web.Request) -> web.Response:
    settings = request.app[_SETTINGS]

    async def gather() -> tuple[data.OverviewView, tuple[int | None, str | None]]:
        return await asyncio.gather(
            data.overview(settings.config, settings.config_path),
            _dead_letter_count(settings.config),
        )

    view, (dead, dead_error) = await _off_loop(request, gather)
    return _render(
        request,
        "scopes.html",
        status=503 if view.error else 200,
        view=view,
        dead_letters=dead,
        dead_letters_error=dead_error,
        dead_queue=DEAD_QUEUE,
    )


def _viewer(request: web.Request) -> str:
    """Who asks, for the reveal audit: the console and the peer's address."""
    return f"console:{request.remote or '-'}"


async def key_page(request: web.Request) -> web.Response:
    settings = request.app[_SETTINGS]
    key = request.match_info.get("key") or request.query.get("key", "").strip()
    scope = request.query.get("scope") or None
    if not key:
        return _render(request, "key.html", view=None, key="")
    view = await _off_loop(
        request,
        lambda: data.key_view(
            settings.config, settings.config_path, key, scope, viewer=_viewer(request)
        ),
    )
    if view.rows:
        status = 200
    elif view.invalid:
        status = 400
    else:
        status = 503 if view.error else 404
    return _render(request, "key.html", status=status, view=view, key=key)


async def dlq_page(request: web.Request) -> web.Response:
    settings = request.app[_SETTINGS]
    after_text = request.query.get("after", "")
    if after_text and not (after_text.isascii() and after_text.isdigit() and len(after_text) < 20):
        return _render(request, "dlq.html", status=400, view=None, bad_after=True)
    every_scope = request.query.get("scopes") == "all"
    if request.method == "HEAD":
        return web.Response(content_type="text/html", charset="utf-8")
    view = await _off_loop(
        request,
        lambda: data.dead_letters(
            settings.config,
            settings.config_path,
            after=int(after_text) if after_text else None,
            every_scope=every_scope,
        ),
    )
    return _render(
        request,
        "dlq.html",
        status=503 if view.error else 200,
        view=view,
        bad_after=False,
        every_scope=every_scope,
        dead_queue=DEAD_QUEUE,
    )


async def live_page(request: web.Request) -> web.Response:
    snapshot = await request.app[_SETTINGS].live.read()
    return _render(request, "live.html", snapshot=snapshot, poll_seconds=_LIVE_POLL_SECONDS)


async def live_json(request: web.Request) -> web.Response:
    snapshot = await request.app[_SETTINGS].live.read()
    return web.json_response(snapshot.document())


async def static_file(request: web.Request) -> web.Response:
    name = request.match_info["name"]
    content_type = _STATIC.get(name)
    if content_type is None:
        raise web.HTTPNotFound()
    body = importlib.resources.files("octo_worker.console").joinpath("static", name).read_bytes()
    return web.Response(body=body, content_type=content_type)


async def no_icon(_request: web.Request) -> web.Response:
    return web.Response(status=204)


def build_app(settings: ConsoleSettings) -> web.Application:
    app = web.Application(middlewares=[_guard], client_max_size=1024)
    app[_SETTINGS] = settings
    app[_TEMPLATES] = _environment()
    app[_GATHERING] = asyncio.Semaphore(_CONCURRENT_GATHERING)
    app.router.add_get("/", scopes_page)
    app.router.add_get("/key", key_page)
    app.router.add_get("/key/{key}", key_page)
    app.router.add_get("/dlq", dlq_page)
    app.router.add_get("/live", live_page)
    app.router.add_get("/live.json", live_json)
    app.router.add_get("/static/{name}", static_file)
    app.router.add_get("/favicon.ico", no_icon)
    app.on_response_prepare.append(_security_headers)

    async def close_live(_app: web.Application) -> None:
        close = getattr(settings.live, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):
                await close()

    app.on_cleanup.append(close_live)
    return app
