"""A RabbitMQ node a test starts and stops itself, never the shared one.

Its own node name, ports, configuration, mnesia and log directories, all in
a temporary directory; ``rabbitmqctl -n`` names it on every call. With
``tls``, its one listener speaks TLS only and requires a client
certificate signed by the test's CA (``tests/tlsfiles.py``).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import pytest

from tests.tlsfiles import TlsFiles

__all__ = ["SERVER_DIR", "PrivateRabbit", "free_port", "running_node"]

SERVER_DIR: Final = Path("/usr/lib/rabbitmq/bin")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


@dataclass
class PrivateRabbit:
    """One RabbitMQ node this module starts and stops; nothing of it is shared."""

    node: str
    port: int
    root: Path
    env: dict[str, str]

    tls: bool = False

    @property
    def url(self) -> str:
        scheme = "amqps" if self.tls else "amqp"
        return f"{scheme}://127.0.0.1:{self.port}/"

    @classmethod
    def prepare(cls, root: Path, tls: TlsFiles | None = None) -> PrivateRabbit:
        home = root / "home"
        home.mkdir(parents=True, mode=0o700)
        cookie = home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(20).upper(), encoding="ascii")
        cookie.chmod(0o400)
        port = free_port()
        if tls is None:
            conf = f"listeners.tcp.local = 127.0.0.1:{port}\n"
        else:
            conf = (
                "listeners.tcp = none\n"
                f"listeners.ssl.default = 127.0.0.1:{port}\n"
                f"ssl_options.cacertfile = {tls.ca}\n"
                f"ssl_options.certfile = {tls.server_cert}\n"
                f"ssl_options.keyfile = {tls.server_key}\n"
                "ssl_options.verify = verify_peer\n"
                "ssl_options.fail_if_no_peer_cert = true\n"
            )
        (root / "rabbitmq.conf").write_text(conf, encoding="utf-8")
        (root / "enabled_plugins").write_text("[].\n", encoding="utf-8")
        (root / "rabbitmq-env.conf").write_text("", encoding="utf-8")
        node = f"octo-test-{os.getpid()}-{secrets.token_hex(4)}@localhost"
        return cls(node, port, root, cls.environment(root, node, port), tls is not None)

    @staticmethod
    def environment(root: Path, node: str, port: int) -> dict[str, str]:
        """The node's and rabbitmqctl's environment: nothing read from /etc/rabbitmq."""
        return {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(root / "home"),
            "RABBITMQ_NODENAME": node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(port),
            "RABBITMQ_DIST_PORT": str(free_port()),
            "RABBITMQ_CONF_ENV_FILE": str(root / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(root / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(root / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(root / "log"),
            "RABBITMQ_PID_FILE": str(root / "node.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    def ctl(self, *args: str, timeout: float = 60.0) -> str:
        """``rabbitmqctl -n <this node> ...``: never the shared node."""
        done = subprocess.run(  # fixed argv, no shell
            [str(SERVER_DIR / "rabbitmqctl"), "-n", self.node, "-q", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if done.returncode != 0:
            raise AssertionError(f"rabbitmqctl {args[0]}: {done.stdout}{done.stderr}")
        return done.stdout

    def start(self) -> None:
        subprocess.run(  # fixed argv, no shell
            [str(SERVER_DIR / "rabbitmq-server"), "-detached"],
            env=self.env,
            capture_output=True,
            timeout=60,
            check=True,
        )
        self.ctl("wait", str(self.root / "node.pid"), "--timeout", "60", timeout=90)
        self.ctl("await_startup", timeout=90)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.ctl("stop", timeout=60)

    def consumers(self, queue: str) -> int:
        """How many consumers ``queue`` has on this node (0 when it does not exist)."""
        for line in self.ctl("list_queues", "name", "consumers").splitlines():
            name, _, count = line.partition("\t")
            if name == queue:
                return int(count)
        return 0


@contextlib.contextmanager
def running_node(root: Path, tls: TlsFiles | None = None) -> Iterator[PrivateRabbit]:
    """A started node under ``root`` (skipped without the server scripts), stopped after."""
    if not (SERVER_DIR / "rabbitmq-server").exists():
        pytest.skip(f"no RabbitMQ server scripts in {SERVER_DIR}: cannot start a private node")
    node = PrivateRabbit.prepare(root, tls)
    try:
        node.start()
    except (subprocess.SubprocessError, AssertionError) as exc:
        node.stop()
        log = "\n".join(p.read_text("utf-8", "replace")[-2000:] for p in node.root.rglob("*.log"))
        pytest.fail(f"the private RabbitMQ node did not start: {exc}\n{log}")
    try:
        yield node
    finally:
        node.stop()
        shutil.rmtree(node.root / "mnesia", ignore_errors=True)
