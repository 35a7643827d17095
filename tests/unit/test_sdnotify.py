"""sd_notify(3) against real AF_UNIX datagram sockets (octo_worker.daemon.sdnotify).

Each test binds the socket systemd would own (a path in a temporary
directory, or an abstract ``@name``), points the ``Notifier`` at it and reads
the datagrams exactly as the service manager receives them.
"""

from __future__ import annotations

import os
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from octo_worker.daemon.sdnotify import Notifier, watchdog_interval

_SUN_PATH_MAX = 107  # sockaddr_un.sun_path is 108 bytes with the terminating NUL


class Manager:
    """The receiving end of NOTIFY_SOCKET."""

    def __init__(self, address: str, bind_to: str) -> None:
        self.address = address
        self.socket = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.socket.bind(bind_to)
        self.socket.settimeout(2.0)

    def receive(self) -> bytes:
        return self.socket.recv(65536)

    def nothing_pending(self) -> bool:
        self.socket.setblocking(False)
        try:
            self.socket.recv(65536)
        except BlockingIOError:
            return True
        finally:
            self.socket.settimeout(2.0)
        return False


@pytest.fixture
def path_manager(tmp_path: Path) -> Iterator[Manager]:
    directory = tmp_path
    short: str | None = None
    if len(str(tmp_path / "notify.sock")) > _SUN_PATH_MAX:
        short = tempfile.mkdtemp(prefix="octo-sd-")
        directory = Path(short)
    address = str(directory / "notify.sock")
    manager = Manager(address, address)
    yield manager
    manager.socket.close()
    if short is not None:
        os.unlink(address)
        os.rmdir(short)


@pytest.fixture
def abstract_manager() -> Iterator[Manager]:
    name = f"octo-test-{uuid.uuid4().hex}"
    manager = Manager("@" + name, "\0" + name)
    yield manager
    manager.socket.close()


def test_each_notification_is_one_exact_datagram(path_manager: Manager) -> None:
    notifier = Notifier(path_manager.address)
    assert notifier.enabled
    assert notifier.ready() is True
    assert path_manager.receive() == b"READY=1"
    assert notifier.ready("serving 2 scope(s)") is True
    assert path_manager.receive() == b"READY=1\nSTATUS=serving 2 scope(s)"
    assert notifier.watchdog() is True
    assert path_manager.receive() == b"WATCHDOG=1"
    assert notifier.status("reconnecting") is True
    assert path_manager.receive() == b"STATUS=reconnecting"
    assert notifier.stopping() is True
    assert path_manager.receive() == b"STOPPING=1"
    assert notifier.notify("RELOADING=1", "STATUS=x") is True
    assert path_manager.receive() == b"RELOADING=1\nSTATUS=x"
    assert path_manager.nothing_pending()


def test_abstract_socket_address(abstract_manager: Manager) -> None:
    notifier = Notifier(abstract_manager.address)
    assert notifier.ready("up") is True
    assert abstract_manager.receive() == b"READY=1\nSTATUS=up"
    assert notifier.watchdog() is True
    assert abstract_manager.receive() == b"WATCHDOG=1"


def test_notify_socket_comes_from_the_environment(
    abstract_manager: Manager, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", abstract_manager.address)
    assert Notifier().stopping() is True
    assert abstract_manager.receive() == b"STOPPING=1"


def test_without_a_socket_every_call_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    notifier = Notifier()
    assert not notifier.enabled
    assert notifier.ready("x") is False
    assert notifier.watchdog() is False
    assert notifier.stopping() is False
    assert notifier.status("x") is False
    assert Notifier("").ready() is False


def test_a_socket_nobody_listens_on_is_reported_not_raised(tmp_path: Path) -> None:
    gone = Notifier(str(tmp_path / "absent.sock"))
    assert gone.enabled
    assert gone.ready() is False
    assert Notifier(f"@octo-test-nobody-{uuid.uuid4().hex}").watchdog() is False


@pytest.mark.parametrize(
    ("usec", "pid", "expected"),
    [
        (None, None, None),
        ("30000000", None, 15.0),
        ("30000000", "self", 15.0),
        ("30000000", "other", None),
        ("0", None, None),
        ("", None, None),
        ("-5", None, None),
        ("thirty", None, None),
        ("1000000", None, 0.5),
    ],
)
def test_watchdog_interval(
    monkeypatch: pytest.MonkeyPatch, usec: str | None, pid: str | None, expected: float | None
) -> None:
    for name, value in (("WATCHDOG_USEC", usec), ("WATCHDOG_PID", pid)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        elif value == "self":
            monkeypatch.setenv(name, str(os.getpid()))
        elif value == "other":
            monkeypatch.setenv(name, str(os.getpid() + 1))
        else:
            monkeypatch.setenv(name, value)
    assert watchdog_interval() == expected


def test_a_manager_that_reads_nothing_never_blocks_the_sender(path_manager: Manager) -> None:
    # The daemon notifies from its event loop: once the manager's queue is
    # full (net.unix.max_dgram_qlen), a blocking send would stop the daemon.
    notifier = Notifier(path_manager.address)
    results: list[bool] = []

    def ping() -> None:
        results.extend(notifier.watchdog() for _ in range(200))

    sender = threading.Thread(target=ping, daemon=True)
    started = time.monotonic()
    sender.start()
    sender.join(timeout=5.0)
    assert not sender.is_alive(), "a watchdog ping blocked on a full notify socket"
    assert time.monotonic() - started < 5.0
    assert results[0] is True and results[-1] is False  # queued, then dropped
    # READY and STOPPING wait a little for room, then give up as well.
    started = time.monotonic()
    assert notifier.stopping() is False
    assert 0.9 <= time.monotonic() - started < 3.0
    # Once the manager reads, notifications go through again.
    drained = 0
    while not path_manager.nothing_pending():
        drained += 1
    assert drained >= 1
    assert notifier.watchdog() is True
