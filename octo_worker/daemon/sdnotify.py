"""A small sd_notify(3) client: READY, WATCHDOG, STOPPING and STATUS.

systemd passes ``NOTIFY_SOCKET`` to a ``Type=notify`` service; we send one
datagram per notification. Abstract sockets start with ``@``. When the
variable is absent (not under systemd), every call is a no-op that returns
False. Nothing secret is ever sent.
"""

from __future__ import annotations

import os
import socket

__all__ = ["Notifier", "watchdog_interval"]


class Notifier:
    """Sends notifications to the service manager, if there is one."""

    def __init__(self, address: str | None = None) -> None:
        self._address = address if address is not None else os.environ.get("NOTIFY_SOCKET")

    @property
    def enabled(self) -> bool:
        return bool(self._address)

    def notify(self, *states: str, wait: float = 0.0) -> bool:
        """Send ``KEY=VALUE`` lines in one datagram; False when not under systemd.

        Called on the event loop: the send never blocks longer than ``wait``
        seconds (by default not at all). A datagram socket whose reader is
        slow fills up (``net.unix.max_dgram_qlen``, 10 by default) and a
        blocking send would then stop the whole daemon; the notification is
        dropped instead (False), and the next one tries again.
        """
        address = self._address
        if not address:
            return False
        target = "\0" + address[1:] if address.startswith("@") else address
        payload = "\n".join(states).encode("utf-8")
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            if wait > 0:
                sock.settimeout(wait)
            else:
                sock.setblocking(False)
            try:
                sock.connect(target)
                sock.sendall(payload)
            except OSError:  # BlockingIOError and TimeoutError included
                return False
        return True

    def ready(self, status: str = "") -> bool:
        # Once, and systemd waits for it: worth a short wait if its queue is full.
        return self.notify("READY=1", *([f"STATUS={status}"] if status else []), wait=1.0)

    def watchdog(self) -> bool:
        return self.notify("WATCHDOG=1")

    def stopping(self) -> bool:
        return self.notify("STOPPING=1", wait=1.0)

    def status(self, text: str) -> bool:
        return self.notify(f"STATUS={text}")


def watchdog_interval() -> float | None:
    """Half of ``WATCHDOG_USEC`` in seconds when the watchdog is on for this process."""
    usec = os.environ.get("WATCHDOG_USEC")
    if not usec or not usec.isdigit() or int(usec) == 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid and pid.isdigit() and int(pid) != os.getpid():
        return None
    return int(usec) / 2_000_000
