"""Three RabbitMQ nodes on this machine, one per network namespace, on a bridge.

Nothing here touches the shared node on 127.0.0.1:5672: every node has its
own namespace (so its own loopback, its own epmd on port 4369, its own
address on the bridge), its own node name, configuration, mnesia and log
directories under a temporary directory; the nodes share one Erlang cookie
(their own, not the machine's). ``rabbitmqctl`` is always run inside the
node's namespace with ``-n`` naming that node.

The layout (``10.213.<net>.0/24``, ``net`` chosen per run)::

    root namespace: bridge <prefix>br, 10.213.<net>.254
      <prefix>n1  10.213.<net>.1   octo1@10.213.<net>.1
      <prefix>n2  10.213.<net>.2   octo2@...
      <prefix>n3  10.213.<net>.3   octo3@...
      <prefix>w   10.213.<net>.10  the worker process
      <prefix>h   10.213.<net>.11  the host process

The client namespaces resolve ``CLUSTER_NAME`` to the three node addresses
(``/etc/netns/<namespace>/hosts``, which ``ip netns exec`` mounts over
``/etc/hosts``): the worker and the host take one AMQP URL, and a name with
three addresses is how they reach another node when theirs is gone (the
connection tries each address in turn).

Faults: :meth:`Cluster.kill` (SIGKILL of a node's Erlang VM),
:meth:`Cluster.partition` (nftables rules inside a namespace that drop every
packet to and from the given addresses), :meth:`Cluster.heal`.
:meth:`Cluster.destroy` removes everything this module made (processes,
namespaces, the bridge, the hosts files); it is safe to call twice and after
a half-made set-up.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Final

__all__ = ["CLUSTER_NAME", "Cluster", "Node", "missing_requirements"]

SERVER_DIR: Final = Path("/usr/lib/rabbitmq/bin")
CLUSTER_NAME: Final = "octo-cluster.test"
AMQP_PORT: Final = 5672
NODES: Final = 3
NFT_TABLE: Final = "octo_partition"
NETNS_ETC: Final = Path("/etc/netns")


def missing_requirements() -> str | None:
    """Why a cluster cannot be made here (one line), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    for tool in ("ip", "nft"):
        if shutil.which(tool) is None:
            return f"needs {tool} (apt-get install {'iproute2' if tool == 'ip' else 'nftables'})"
    if not (SERVER_DIR / "rabbitmq-server").exists():
        return f"needs the RabbitMQ server scripts in {SERVER_DIR}"
    probe = f"octoprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, check=False)
    if made.returncode != 0:
        return "cannot create a network namespace: " + made.stderr.decode(errors="replace").strip()
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, check=False)
    return None


def run(*argv: str, timeout: float = 60.0, check: bool = True) -> str:
    """Run a fixed argv (no shell); its stdout, or AssertionError with its output."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if check and done.returncode != 0:
        raise AssertionError(f"{' '.join(argv)}: rc {done.returncode}: {done.stdout}{done.stderr}")
    return done.stdout


@dataclass
class Node:
    """One RabbitMQ node in its namespace."""

    index: int
    namespace: str
    address: str
    root: Path
    home: Path

    @property
    def name(self) -> str:
        return f"octo{self.index}@{self.address}"

    @property
    def url(self) -> str:
        return f"amqp://{self.address}:{AMQP_PORT}/"

    @property
    def pid_file(self) -> Path:
        return self.root / "node.pid"

    def env(self) -> dict[str, str]:
        """The node's and its rabbitmqctl's environment: nothing read from /etc/rabbitmq."""
        return {
            "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
            "LANG": "C.UTF-8",
            "HOME": str(self.home),
            "RABBITMQ_NODENAME": self.name,
            "RABBITMQ_USE_LONGNAME": "true",
            "RABBITMQ_NODE_IP_ADDRESS": self.address,
            "RABBITMQ_NODE_PORT": str(AMQP_PORT),
            "RABBITMQ_DIST_PORT": "25672",
            "RABBITMQ_CONF_ENV_FILE": str(self.root / "rabbitmq-env.conf"),
            "RABBITMQ_CONFIG_FILE": str(self.root / "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": str(self.root / "advanced.config"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(self.root / "enabled_plugins"),
            "RABBITMQ_MNESIA_BASE": str(self.root / "mnesia"),
            "RABBITMQ_LOG_BASE": str(self.root / "log"),
            "RABBITMQ_PID_FILE": str(self.pid_file),
            # A VM killed or stopped abruptly dumps here, not in the caller's directory.
            "ERL_CRASH_DUMP": str(self.root / "erl_crash.dump"),
        }

    def prepare(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "rabbitmq.conf").write_text(
            f"listeners.tcp.default = {self.address}:{AMQP_PORT}\n"
            # The clients come from the bridge, not from loopback.
            "loopback_users = none\n"
            # The node cut off from the majority stops serving (and closes
            # its clients' connections) until the partition heals.
            "cluster_partition_handling = pause_minority\n"
            "log.file.level = warning\n",
            encoding="utf-8",
        )
        # A partition is noticed within about net_ticktime seconds. Erlang 25's
        # default prevent_overlapping_partitions disconnects nodes on its own
        # and can leave a paused node paused after the heal.
        (self.root / "advanced.config").write_text(
            "[{kernel, [{net_ticktime, 8}, {prevent_overlapping_partitions, false}]}].\n",
            encoding="utf-8",
        )
        (self.root / "enabled_plugins").write_text("[].\n", encoding="utf-8")
        (self.root / "rabbitmq-env.conf").write_text("", encoding="utf-8")

    def exec_argv(self, *argv: str) -> list[str]:
        environment = [f"{k}={v}" for k, v in self.env().items()]
        return ["ip", "netns", "exec", self.namespace, "env", "-i", *environment, *argv]

    def ctl(self, *args: str, timeout: float = 60.0, check: bool = True) -> str:
        """``rabbitmqctl -n <this node> ...`` inside its namespace."""
        return run(
            *self.exec_argv(str(SERVER_DIR / "rabbitmqctl"), "-n", self.name, "-q", *args),
            timeout=timeout,
            check=check,
        )

    def start(self) -> None:
        run(*self.exec_argv(str(SERVER_DIR / "rabbitmq-server"), "-detached"), timeout=60)
        self.ctl("wait", str(self.pid_file), "--timeout", "90", timeout=120)
        self.ctl("await_startup", "--timeout", "90", timeout=120)

    def beam_pid(self) -> int | None:
        with contextlib.suppress(OSError, ValueError):
            return int(self.pid_file.read_text("ascii").strip())
        return None

    def logs(self, tail: int = 3000) -> str:
        texts = [p.read_text("utf-8", "replace")[-tail:] for p in self.root.rglob("log/*.log")]
        return "\n".join(texts)


@dataclass
class Cluster:
    """The bridge, the namespaces and the three nodes (see the module docstring)."""

    root: Path
    prefix: str
    net: int
    nodes: list[Node] = field(default_factory=list)
    made_namespaces: list[str] = field(default_factory=list)
    bridge_made: bool = False
    partitioned: set[str] = field(default_factory=set)

    @classmethod
    def plan(cls, root: Path) -> Cluster:
        tag = os.getpid() % 10000
        cluster = cls(root, f"oc{tag}", 1 + os.getpid() % 250)
        home = root / "home"
        home.mkdir(parents=True, mode=0o700, exist_ok=True)
        cookie = home / ".erlang.cookie"
        cookie.write_text(secrets.token_hex(20).upper(), encoding="ascii")
        cookie.chmod(0o400)
        for index in range(1, NODES + 1):
            cluster.nodes.append(
                Node(
                    index, f"{cluster.prefix}n{index}", cluster.ip(index), root / f"n{index}", home
                )
            )
        return cluster

    def ip(self, last: int) -> str:
        return f"10.213.{self.net}.{last}"

    @property
    def bridge(self) -> str:
        return f"{self.prefix}br"

    @property
    def worker_namespace(self) -> str:
        return f"{self.prefix}w"

    @property
    def host_namespace(self) -> str:
        return f"{self.prefix}h"

    @property
    def worker_address(self) -> str:
        return self.ip(10)

    @property
    def host_address(self) -> str:
        return self.ip(11)

    @property
    def url(self) -> str:
        """The clients' URL: one name, the three nodes' addresses."""
        return f"amqp://{CLUSTER_NAME}:{AMQP_PORT}/"

    # Network -------------------------------------------------------------------------

    def _namespace(self, name: str, address: str, slot: int) -> None:
        run("ip", "netns", "add", name)
        self.made_namespaces.append(name)
        outside, inside = f"{self.prefix}v{slot}", f"{self.prefix}i{slot}"
        run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
        run("ip", "link", "set", inside, "netns", name)
        run("ip", "link", "set", outside, "master", self.bridge)
        run("ip", "link", "set", outside, "up")
        inns = ("ip", "netns", "exec", name)
        run(*inns, "ip", "addr", "add", f"{address}/24", "dev", inside)
        run(*inns, "ip", "link", "set", inside, "up")
        run(*inns, "ip", "link", "set", "lo", "up")

    def _hosts_file(self, namespace: str) -> None:
        folder = NETNS_ETC / namespace
        folder.mkdir(parents=True, exist_ok=True)
        lines = ["127.0.0.1 localhost"]
        lines += [f"{node.address} {CLUSTER_NAME}" for node in self.nodes]
        (folder / "hosts").write_text("\n".join(lines) + "\n", encoding="ascii")

    def build_network(self) -> None:
        run("ip", "link", "add", self.bridge, "type", "bridge")
        self.bridge_made = True
        run("ip", "addr", "add", f"{self.ip(254)}/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        for node in self.nodes:
            self._namespace(node.namespace, node.address, node.index)
        self._namespace(self.worker_namespace, self.worker_address, 10)
        self._namespace(self.host_namespace, self.host_address, 11)
        for namespace in (self.worker_namespace, self.host_namespace):
            self._hosts_file(namespace)

    # Nodes -----------------------------------------------------------------------------

    def start(self) -> float:
        """Start the three nodes and join the second and third to the first; seconds taken."""
        started = time.monotonic()
        for node in self.nodes:
            node.prepare()
        first, *others = self.nodes
        procs = [
            subprocess.Popen(  # fixed argv, no shell
                node.exec_argv(str(SERVER_DIR / "rabbitmq-server"), "-detached"),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            for node in self.nodes
        ]
        for proc in procs:
            proc.wait(60)
        for node in self.nodes:
            node.ctl("wait", str(node.pid_file), "--timeout", "120", timeout=150)
            node.ctl("await_startup", "--timeout", "120", timeout=150)
        for node in others:
            node.ctl("stop_app")
            node.ctl("join_cluster", first.name, timeout=120)
            node.ctl("start_app", timeout=120)
        running = self.running_nodes(first)
        assert running == {n.name for n in self.nodes}, running
        return time.monotonic() - started

    def running_nodes(self, via: Node) -> set[str]:
        """The running nodes the cluster status of ``via`` lists."""
        import json

        status = json.loads(via.ctl("cluster_status", "--formatter", "json", timeout=30))
        return set(status.get("running_nodes", []))

    def running_nodes_or_none(self, via: Node) -> set[str] | None:
        """:meth:`running_nodes`, or None when ``via`` does not answer."""
        try:
            return self.running_nodes(via)
        except (AssertionError, subprocess.TimeoutExpired, ValueError):
            return None

    def server_pids(self, node: Node) -> list[int]:
        """The node's Erlang VM: the beam in its namespace that boots ``rabbit``."""
        found = []
        for pid in run("ip", "netns", "pids", node.namespace, check=False).split():
            with contextlib.suppress(OSError):
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                if argv and argv[0].endswith(b"beam.smp") and b"rabbit" in argv:
                    found.append(int(pid))
        return found

    def kill(self, node: Node) -> list[int]:
        """SIGKILL the node's Erlang VM (its namespace, address and epmd stay)."""
        pids = self.server_pids(node)
        assert pids, f"no Erlang VM of {node.name} in {node.namespace}"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        return pids

    def restart(self, node: Node) -> None:
        """Start a killed node again: it rejoins the cluster with its own database."""
        with contextlib.suppress(FileNotFoundError):
            node.pid_file.unlink()
        node.start()

    def partition(self, namespace: str, addresses: list[str]) -> None:
        """Inside ``namespace``, drop every packet to and from ``addresses``."""
        inns = ("ip", "netns", "exec", namespace)
        run(*inns, "nft", "add", "table", "inet", NFT_TABLE)
        self.partitioned.add(namespace)
        for hook in ("input", "output"):
            run(
                *inns, "nft", "add", "chain", "inet", NFT_TABLE, hook,
                f"{{ type filter hook {hook} priority 0 ; policy accept ; }}",
            )  # fmt: skip
            for address in addresses:
                way = "saddr" if hook == "input" else "daddr"
                run(
                    *inns, "nft", "add", "rule", "inet", NFT_TABLE, hook, "ip", way, address, "drop"
                )

    def heal(self) -> None:
        """Delete every partition table this cluster added."""
        for namespace in sorted(self.partitioned):
            run("ip", "netns", "exec", namespace, "nft", "delete", "table", "inet", NFT_TABLE,
                check=False)  # fmt: skip
        self.partitioned.clear()

    def connected_node(self, peer: str, via: list[Node]) -> Node | None:
        """The node holding a client connection from address ``peer``, asked of the
        first node of ``via`` that answers (connections are listed cluster-wide)."""
        for asked in via:
            listed = asked.ctl(
                "list_connections",
                "--no-table-headers",
                "peer_host",
                "pid",
                check=False,
                timeout=20,
            )
            if not listed:
                continue
            for line in listed.splitlines():
                host, _, pid = line.partition("\t")
                if host.strip() == peer:
                    for node in self.nodes:
                        if f"<{node.name}." in pid:
                            return node
            return None
        return None

    def queue_members(self, queue: str, via: Node) -> tuple[int, int]:
        """How many members the quorum queue ``queue`` has, and how many are online."""
        listed = via.ctl(
            "list_queues", "--no-table-headers", "name", "members", "online", timeout=30
        )
        for line in listed.splitlines():
            name, members, online = line.split("\t")
            if name == queue:
                return members.count("@"), online.count("@")
        raise AssertionError(f"no queue {queue}: {listed}")

    def queue_messages(self, via: Node) -> dict[str, int]:
        """Every queue's messages (ready and unacknowledged), asked of ``via``."""
        listed = via.ctl("list_queues", "--no-table-headers", "name", "messages", timeout=30)
        found = {}
        for line in listed.splitlines():
            name, count = line.split("\t")
            found[name] = int(count)
        return found

    # Clean-up --------------------------------------------------------------------------

    def destroy(self) -> None:
        """Kill every process in the namespaces (nodes, epmd, clients), remove them all."""
        self.heal()
        for namespace in self.made_namespaces:
            pids = run("ip", "netns", "pids", namespace, check=False).split()
            for pid in pids:
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pid), signal.SIGKILL)
        deadline = time.monotonic() + 10
        for namespace in self.made_namespaces:
            while run("ip", "netns", "pids", namespace, check=False).split():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.1)
            run("ip", "netns", "del", namespace, check=False)
            shutil.rmtree(NETNS_ETC / namespace, ignore_errors=True)
        self.made_namespaces.clear()
        if self.bridge_made:
            run("ip", "link", "del", self.bridge, check=False)
            self.bridge_made = False
        for node in self.nodes:
            shutil.rmtree(node.root / "mnesia", ignore_errors=True)


def clean_leftovers() -> list[str]:
    """Remove what a killed run of this module left: its namespaces (and every process
    in them), their hosts files, its bridges. Only names this module makes
    (``oc<digits>`` and a suffix) are touched. Returns the names removed."""
    import re

    removed = []
    ours = re.compile(r"oc\d{1,4}(n\d|w|h)")
    for line in run("ip", "netns", "list", check=False).splitlines():
        name = line.split()[0] if line.split() else ""
        if not ours.fullmatch(name):
            continue
        for pid in run("ip", "netns", "pids", name, check=False).split():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.5)
        run("ip", "netns", "del", name, check=False)
        shutil.rmtree(NETNS_ETC / name, ignore_errors=True)
        removed.append(name)
    for line in run("ip", "-o", "link", "show", "type", "bridge", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if re.fullmatch(r"oc\d{1,4}br", name):
            run("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


if __name__ == "__main__":
    import sys

    if sys.argv[1:] != ["--clean"]:
        sys.exit("usage: python -m tests.cluster.netns --clean")
    if os.geteuid() == 0 and shutil.which("ip") is not None:
        for name in clean_leftovers():
            print(f"removed {name}")
