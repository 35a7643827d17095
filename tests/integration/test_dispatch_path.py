"""One dispatch traced through the real worker: the path a reader follows, kept short and true.

A daemon is started on a real SQLite journal with the real ``files.publish``
adapter; the broker is stubbed at the consumer boundary: deliveries are
handed to the delivery path as the consumer callback hands them, acks are
recorded, and the reply's confirmed publish runs down to a channel that
confirms at once. One session is opened and one dispatch warms the caches;
the next dispatch (a new key: admission, ack, adapter, observation, reply)
is traced with ``sys.setprofile``, and the SQLite threads with
``threading.setprofile``.

What counts as a function of the path (the rule the figures below follow):

* a function defined in ``octo_worker`` or ``octo_common.runtime`` (the
  worker and the I/O helpers it calls), run on the event loop's thread;
* entered from another module, or from no Octo frame (the event loop: the
  consumer's call, a task, a callback); a function called only by its own
  module is that module's helper and is left out;
* left out as well: the pure modules (``octo_common`` outside ``runtime``,
  the protocol library; the worker's pure rules and values, the
  ``WORKER_PURE`` list of tests/unit/test_layering.py): decisions the path
  asks for, values in and values out, each with unit tests of its own; the
  hooks (``WorkerHooks`` and its implementations: they watch the path);
  functions the compiler makes (comprehensions, lambdas, dunders).

A crossing is a call from a function of ``octo_worker.daemon`` into one of
``octo_worker.session`` or back (every call, pure functions included; a
call of a hook is left out here too, though the metrics and the faults
live in ``octo_worker.daemon``).

The figures are bounds that only go down (a ratchet): see ``FUNCTIONS``.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
from pamqp.commands import Basic

from octo_common.frames import ScopeKey, SessionAuthenticator, SessionKey, SessionRole
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import DispatchOperation, OpenSession, OperationDispatchRequest
from octo_common.payload import ToolPayload
from octo_common.transport import HEADER_KEY_NONCE, HEADER_SCOPE, HEADER_SESSION, reply_queue
from octo_worker.adapters.files import read_effect_log
from octo_worker.config import load_config
from octo_worker.daemon import WorkerDaemon
from tests.unit.test_layering import WORKER_PURE

ROOT = Path(__file__).resolve().parents[2]
TOOL = "files.publish"
GRANT = CapabilityGrant(TOOL, "json", max_calls=8)
SCOPE = "t-path"
HOST_ID = "t-path-host"

# Ratchet: the traced path may only get shorter. The goal is at most 30
# functions in at most 12 modules with at most 2 daemon <-> session crossings.
FUNCTIONS = 27
MODULES = 12
CROSSINGS = 1


# The stubbed broker -------------------------------------------------------------------


class _Underlay:
    def __init__(self, published: list[tuple[str, bytes]]) -> None:
        self.published = published

    async def basic_publish(self, body: bytes, **kwargs: Any) -> Basic.Ack:
        self.published.append((kwargs["routing_key"], body))
        return Basic.Ack()


class ConfirmingChannel:
    """A confirm-mode channel whose every publish the broker confirms at once."""

    publisher_confirms = True
    is_closed = False

    def __init__(self) -> None:
        self.published: list[tuple[str, bytes]] = []
        self.close_callbacks: set[Any] = set()
        self._underlay = _Underlay(self.published)

    async def get_underlay_channel(self) -> _Underlay:
        return self._underlay


@dataclass
class Delivery:
    """What the consumer hands the delivery path: body, headers, properties, settle."""

    body: bytes
    headers: dict[str, Any]
    reply_to: str | None
    correlation_id: str | None = None
    message_id: str | None = None
    routing_key: str | None = None
    settled: list[str] = field(default_factory=list)

    async def ack(self) -> None:
        self.settled.append("ack")

    async def reject(self, requeue: bool = False) -> None:
        self.settled.append("reject")

    async def nack(self, multiple: bool = False, requeue: bool = True) -> None:
        self.settled.append("nack")


# The tracer ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    thread: str
    caller: tuple[str, str] | None  # (module, qualified name) of the nearest Octo caller
    callee: tuple[str, str]


class Tracer:
    """Records each first call of an Octo function (a coroutine resumed is no new call)."""

    def __init__(self) -> None:
        self.active = False
        self.calls: list[Call] = []
        self._seen: dict[int, FrameType] = {}

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if not self.active or event != "call":
            return
        module = frame.f_globals.get("__name__", "")
        if not module.startswith("octo_") or id(frame) in self._seen:
            return
        self._seen[id(frame)] = frame  # kept alive, so its id is not reused
        back = frame.f_back
        while back is not None and not back.f_globals.get("__name__", "").startswith("octo_"):
            back = back.f_back
        caller = None if back is None else (back.f_globals["__name__"], back.f_code.co_qualname)
        self.calls.append(
            Call(threading.current_thread().name, caller, (module, frame.f_code.co_qualname))
        )


def _pure(module: str) -> bool:
    in_runtime = module.startswith("octo_common.runtime")
    return (module.startswith("octo_common") and not in_runtime) or module in WORKER_PURE


def _hooks(module: str, name: str) -> bool:
    return module in (
        "octo_worker.hooks",
        "octo_worker.daemon.metrics",
        "octo_worker.daemon.faults",
    )


def _compiled(name: str) -> bool:
    last = name.rsplit(".", 1)[-1]
    return "<" in last or last.startswith("__") or "<genexpr>" in name or "<listcomp>" in name


def path_of(calls: list[Call]) -> list[Call]:
    """The calls the rule of the module docstring counts."""
    return [
        call
        for call in calls
        if call.thread == threading.main_thread().name
        and (call.caller is None or call.caller[0] != call.callee[0])
        and not _pure(call.callee[0])
        and not _hooks(*call.callee)
        and not _compiled(call.callee[1])
    ]


def _side(module: str) -> str | None:
    for side in ("octo_worker.daemon", "octo_worker.session"):
        if module == side or module.startswith(side + "."):
            return side
    return None


def crossings(calls: list[Call]) -> list[Call]:
    return [
        call
        for call in calls
        if call.thread == threading.main_thread().name
        and call.caller is not None
        and _side(call.caller[0]) is not None
        and _side(call.callee[0]) is not None
        and _side(call.caller[0]) != _side(call.callee[0])
        and not _hooks(*call.callee)
    ]


# One traced dispatch -----------------------------------------------------------------------


def _write_private(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(data)
    path.chmod(0o600)


@dataclass
class Traced:
    calls: list[Call]
    delivery: Delivery
    published: list[tuple[str, bytes]]
    effects: int


@pytest.fixture(scope="module")
def traced(tmp_path_factory: pytest.TempPathFactory) -> Traced:
    return asyncio.run(_trace_one_dispatch(tmp_path_factory.mktemp("path")))


async def _trace_one_dispatch(root: Path) -> Traced:
    scope_key = secrets.token_bytes(32)
    base = root / "worker"
    _write_private(base / "keys" / "scope.key", scope_key)
    _write_private(base / "keys" / "storage.key", secrets.token_bytes(32).hex().encode())
    config_path = base / "worker.toml"
    config_path.write_text(
        f"""
[worker]
state_dir = "state"
log_level = "warning"

[broker]
url = "amqp://127.0.0.1:5672/"

[storage]
journal = "journal.sqlite3"
key = {{ id = "worker-k1", key_file = "keys/storage.key" }}

[[scopes]]
name = "{SCOPE}"
key_file = "keys/scope.key"

[adapters]
enabled = ["{TOOL}"]

[adapters.options."{TOOL}"]
target_dir = "./published"
effect_log = "./effects.log"
""",
        encoding="utf-8",
    )
    config = load_config(config_path)
    tracer = Tracer()
    threading.setprofile(tracer.profile)  # the SQLite threads the start begins
    try:
        daemon = WorkerDaemon(config)
        await daemon._start()
        channel = ConfirmingChannel()
        daemon._broker.publisher.use(None, channel)  # type: ignore[arg-type]
        daemon._broker._connected.set()
        on_message = daemon._path().on_message
        scope = daemon._scopes[SCOPE]
        session_id = "s-" + secrets.token_hex(4)
        nonce = secrets.token_bytes(32)
        key = SessionKey.derive(ScopeKey.from_bytes(scope_key), SCOPE, session_id, nonce)
        host = SessionAuthenticator(session_id, key, SessionRole.HOST)
        headers = {HEADER_SCOPE: SCOPE, HEADER_SESSION: session_id, HEADER_KEY_NONCE: nonce.hex()}
        manifest = CapabilityManifest(session_id, [GRANT])
        opening = Delivery(
            host.seal(OpenSession(manifest, reply_to=reply_queue(HOST_ID))),
            headers,
            reply_queue(HOST_ID),
        )
        await on_message(scope, opening, channel)  # type: ignore[arg-type]

        def dispatch(index: int) -> Delivery:
            request = OperationDispatchRequest(
                session_id,
                f"req-{index}",
                TOOL,
                "op-" + secrets.token_hex(8),
                ToolPayload.json({"name": f"f{index}.txt", "content": "hello"}),
            )
            frame = host.seal(DispatchOperation(request))
            return Delivery(frame, headers, reply_queue(HOST_ID), correlation_id=f"req-{index}")

        await on_message(scope, dispatch(0), channel)  # type: ignore[arg-type]
        delivery = dispatch(1)
        tracer.active = True
        sys.setprofile(tracer.profile)
        try:
            await on_message(scope, delivery, channel)  # type: ignore[arg-type]
        finally:
            sys.setprofile(None)
            tracer.active = False
        await daemon.store.close()
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]
    effects = len(read_effect_log(config.state_path("effects.log")))
    return Traced(tracer.calls, delivery, channel.published, effects)


# The tests -------------------------------------------------------------------------------


def test_the_traced_delivery_is_one_whole_dispatch(traced: Traced) -> None:
    assert traced.delivery.settled == ["ack"]
    assert [key for key, _ in traced.published][-1] == reply_queue(HOST_ID)
    assert traced.effects == 2  # the warm-up's and the traced one's
    assert traced.calls, "nothing traced: the figures below would say nothing"


def test_the_dispatch_path_is_short(traced: Traced) -> None:
    path = path_of(traced.calls)
    functions = sorted({call.callee for call in path})
    modules = sorted({module for module, _ in functions})
    print(f"\ndispatch path: {len(functions)} functions in {len(modules)} modules")
    for module in modules:
        print(f"  {module}: {', '.join(name for m, name in functions if m == module)}")
    assert len(functions) <= FUNCTIONS, functions
    assert len(modules) <= MODULES, modules


def test_the_daemon_and_the_session_cross_rarely(traced: Traced) -> None:
    found = crossings(traced.calls)
    print(f"\ndaemon <-> session crossings: {len(found)}")
    for call in found:
        print(f"  {call.caller} -> {call.callee}")
    assert len(found) <= CROSSINGS, found


def test_the_counting_rule_sees_what_it_must(traced: Traced) -> None:
    # A check of the checker: the consumer's entry, the session's driver and the reply's
    # publish are on the path; a pure module's function and a module's own helper are not.
    names = {call.callee for call in path_of(traced.calls)}
    assert ("octo_worker.daemon.deliveries", "DeliveryPath.on_message") in names
    assert ("octo_worker.session.session", "WorkerSession.handle") in names
    assert ("octo_common.runtime.broker", "publish_envelope") in names
    assert ("octo_worker.transport.delivery", "BrokerDelivery.reply") in names
    assert not any(module == "octo_worker.journal" for module, _ in names)
    assert ("octo_worker.daemon.deliveries", "DeliveryPath._deliver") not in names
    everything = {call.callee for call in traced.calls}
    assert ("octo_worker.journal", "WorkerOperationJournal.admit") in everything
    assert ("octo_worker.daemon.deliveries", "DeliveryPath._deliver") in everything


# docs/architecture.md names functions on this path: each is called on it (a class it
# names, such as a value the path hands on, exists).

_MAP = ROOT / "docs" / "architecture.md"
_NAME = re.compile(r"`([A-Za-z_][\w]*(?:\.[A-Za-z_]\w*)?)(?:\([^`]*\))?`")


def _mapped_names() -> list[str]:
    text = _MAP.read_text(encoding="utf-8")
    section = text.split("### The worker's side of one dispatch", 1)[1].split("\n#", 1)[0]
    steps = re.findall(r"^\d+\. (.*)$", section, re.MULTILINE)
    found = {name for step in steps for name in _NAME.findall(step)}
    return sorted(name for name in found if not name.endswith(".py"))


def _defines_class(name: str) -> bool:
    pattern = re.compile(rf"^class {name}\b", re.MULTILINE)
    return any(
        pattern.search(path.read_text(encoding="utf-8"))
        for package in ("octo_worker", "octo_common")
        for path in (ROOT / package).rglob("*.py")
    )


def _called(name: str, qualified: set[str]) -> bool:
    if name.isupper():
        return True  # a constant (a row of a table), not a function
    if "." in name:
        return name in qualified
    if name[0].isupper():  # a class (a value on the path): it exists
        return _defines_class(name)
    return any(q == name or q.endswith("." + name) for q in qualified)


def test_every_function_the_map_names_on_the_dispatch_path_is_called_on_it(
    traced: Traced,
) -> None:
    names = _mapped_names()
    assert len(names) >= 20, names  # the steps name their functions
    qualified = {qualname for call in traced.calls for _, qualname in [call.callee]}
    assert [name for name in names if not _called(name, qualified)] == []
    # A check of the checker: a step or a class that is not there is found out.
    assert not _called("WorkerSession.no_such_step", qualified)
    assert not _called("no_such_function", qualified)
    assert not _called("NoSuchClass", qualified)
