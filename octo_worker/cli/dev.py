"""``octo-worker dev``: a first local worker in one command.

Makes (or reuses) a private directory holding everything a first try needs:
three keys (a tenant scope key shared with the host, the journal's storage
key, the host ledger's key; each 64 hex characters, mode 0600, in a 0700
directory), a ``worker.toml`` serving one scope with the ``files.publish``
adapter, and a ``host.toml`` for the same scope with a grant and a plan named
``release``. It declares the broker topology for the scope and the host's
reply queue, prints where everything is and the next command, then runs the
worker in the foreground with human-readable logs until Ctrl-C.

Run again, it reuses the directory (same keys, scope and journal) and
writes nothing. It is for one machine and RabbitMQ's default loopback user;
production configurations are described in docs/operations.md.

It must never print a key or overwrite a key, a configuration or a journal
it did not just create.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import sys
import tomllib
from pathlib import Path
from typing import Final

from octo_common.ids import is_token
from octo_common.runtime.output import EXIT_BROKER, EXIT_OK, EXIT_USAGE, CliError, Output
from octo_worker.cli.common import PROG, Verbs, broker_connection, vhost
from octo_worker.cli.run import configure_logging, serve
from octo_worker.config import WorkerConfig, load_config
from octo_worker.daemon.topology import TopologyError, declare_topology, open_confirm_channel

__all__ = ["DEFAULT_DEV_DIR", "cmd_dev", "provision", "register"]

DEFAULT_DEV_DIR: Final = "octo-dev"
TOOL: Final = "files.publish"
PLAN: Final = "release"


def register(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    """Add ``dev`` to the verbs (it takes no ``--config``: it writes its own)."""
    dev = verbs.add_parser(
        "dev",
        help="a first local worker: keys, configs, topology, then run it (Ctrl-C stops it)",
        description=(
            "Create (or reuse) DIR with private keys, a worker.toml and a host.toml for one "
            "tenant scope served by the files.publish adapter, declare the broker topology, "
            "print the next command, and run the worker in the foreground with "
            "human-readable logs. For a first try on one machine, not for production."
        ),
    )
    dev.add_argument(
        "--dir",
        default=DEFAULT_DEV_DIR,
        metavar="DIR",
        help=f"the directory to create or reuse (default: ./{DEFAULT_DEV_DIR})",
    )
    dev.add_argument(
        "--url",
        default=None,
        metavar="AMQP_URL",
        help="the broker, without a password (default: amqp://127.0.0.1:5672/, "
        "RabbitMQ's loopback-only guest user)",
    )
    dev.add_argument(
        "--no-run",
        action="store_true",
        help="set everything up and print the next commands, without running the worker",
    )
    dev.set_defaults(handler=cmd_dev)


def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as handle:
        handle.write(data)


def _key() -> bytes:
    return secrets.token_bytes(32).hex().encode("ascii") + b"\n"


def _worker_toml(scope: str, url: str | None) -> str:
    broker = f'url = "{url}"\n' if url else ""
    return f"""# Written by `{PROG} dev`: a first local worker. Names files, holds no secret.
[worker]
state_dir = "worker"
log_format = "console"

[broker]
{broker}connect_timeout_seconds = 5.0

[storage]
journal = "journal.sqlite3"
key = {{ id = "dev-k1", key_file = "keys/journal.key" }}

[[scopes]]
name = "{scope}"
key_file = "keys/scope.key"

[adapters]
enabled = ["{TOOL}"]

[adapters.options."{TOOL}"]
target_dir = "./published"
effect_log = "./effects.log"
"""


def _host_toml(scope: str, host_id: str, url: str | None) -> str:
    broker = f'url = "{url}"\n' if url else ""
    return f"""# Written by `{PROG} dev`: a host of the dev worker's scope; holds no secret.
[host]
host_id = "{host_id}"

[broker]
{broker}connect_timeout_seconds = 5.0

[ledger]
database = "host/ledger.sqlite3"
key = {{ id = "dev-h1", key_file = "keys/ledger.key" }}

[[scopes]]
name = "{scope}"
key_file = "keys/scope.key"

[[grants]]
scope = "{scope}"
tool = "{TOOL}"
format = "json"
max_calls = 64
max_compensations = 1

[[actions]]
tool = "{TOOL}"
inverse = {{ undo = "publish" }}
match = ["name"]

[[plans]]
name = "{PLAN}"
steps = [{{ id = "publish", source = "publish the release notes" }}]
"""


def provision(directory: Path, url: str | None) -> tuple[WorkerConfig, str, bool]:
    """Create ``directory`` (or reuse it): keys, ``worker.toml``, ``host.toml``.

    Returns the worker configuration, the host id and whether anything was
    created. A directory holding some of the files but not all is refused:
    it is not one this command made.
    """
    worker_path = directory / "worker.toml"
    host_path = directory / "host.toml"
    keys = directory / "keys"
    key_files = [keys / "scope.key", keys / "journal.key", keys / "ledger.key"]
    ours = [worker_path, host_path, *key_files]
    present = [path for path in ours if path.exists()]
    created = not present
    if present and len(present) != len(ours):
        missing = ", ".join(str(path) for path in ours if not path.exists())
        raise CliError(
            EXIT_USAGE,
            f"{directory} is not a complete dev directory (missing {missing}); "
            "choose another --dir or remove it",
            "invalid_configuration",
        )
    if created:
        if directory.exists() and any(directory.iterdir()):
            raise CliError(
                EXIT_USAGE,
                f"{directory} exists and is not empty; choose another --dir",
                "invalid_configuration",
            )
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(directory, 0o700)
        keys.mkdir(mode=0o700)
        for path in key_files:
            _write_private(path, _key())
        suffix = secrets.token_hex(4)
        scope = f"dev-{suffix}"
        worker_path.write_text(_worker_toml(scope, url), encoding="utf-8")
        host_path.write_text(_host_toml(scope, f"dev-host-{suffix}", url), encoding="utf-8")
    config = load_config(worker_path)
    # The host's own loader is the host library's (the worker never imports it);
    # the host id is all the topology needs from the file.
    found: object = None
    try:
        found = tomllib.loads(host_path.read_text(encoding="utf-8"))["host"]["host_id"]
    except (tomllib.TOMLDecodeError, KeyError, TypeError):
        pass
    if not isinstance(found, str) or not is_token(found):
        raise CliError(
            EXIT_USAGE, f"{host_path}: host.host_id: not a token", "invalid_configuration"
        )
    return config, found, created


async def _declare(config: WorkerConfig, host_id: str) -> str:
    """Declare the scope's and the host's queues; the policies when the broker lets us."""
    scopes = [scope.name for scope in config.scopes]
    async with broker_connection(config) as connection:
        channel = await open_confirm_channel(connection)

        async def declare(limit: int | None) -> None:
            await declare_topology(
                channel,
                scopes,
                host_ids=[host_id],
                delivery_limit=limit,
                dead_letter_max_length=config.broker.dead_letter_max_length,
                dead_letter_max_bytes=config.broker.dead_letter_max_bytes,
                vhost=vhost(config.broker.url),
            )

        try:
            await declare(config.broker.delivery_limit)
            return f"policies applied (delivery limit {config.broker.delivery_limit})"
        except TopologyError as error:
            if "policy" not in error.reason:
                raise
            await declare(None)
            return (
                f"policies not applied ({error.reason}); a frame that keeps failing is "
                f"redelivered without limit until `{PROG} topology declare` runs with "
                "rabbitmqctl rights"
            )


def _shown(path: Path) -> str:
    """``path`` relative to the current directory when it is below it."""
    absolute = os.path.abspath(path)  # not resolved: a virtual environment's python is a link
    below = os.path.commonpath([absolute, os.getcwd()]) == os.getcwd()
    return os.path.relpath(absolute) if below else absolute


def cmd_dev(args: argparse.Namespace, out: Output) -> int:
    directory = Path(args.dir)
    config, host_id, created = provision(directory, args.url)
    scope = config.scopes[0].name
    where = _shown(directory)
    try:
        policy = asyncio.run(_declare(config, host_id))
    except TopologyError as error:
        raise CliError(EXIT_BROKER, f"topology: {error.reason}", error.code) from None
    python = _shown(Path(sys.executable)) if sys.executable else "python3"
    out.line(f"{'created' if created else 'reusing'} {where}/ (mode 0700):")
    out.line(f"  keys        {where}/keys/ (scope.key, journal.key, ledger.key; mode 0600)")
    out.line(f"  worker      {where}/worker.toml  scope {scope}, adapter {TOOL}")
    out.line(f"  host        {where}/host.toml    host id {host_id}, plan {PLAN!r}")
    out.line(f"  published   {where}/worker/published/{scope}/")
    out.line(f"topology: octo.v5.worker.{scope}, octo.v5.reply.{host_id}; {policy}")
    out.line("next, in another terminal in this directory: save the README's host quick")
    out.line(f"start as publish.py and run  {python} publish.py {where}/host.toml")
    if args.no_run:
        out.line(f"then start the worker:  {PROG} dev --dir {where}")
        return EXIT_OK
    out.line(f"starting the worker (Ctrl-C stops it; `{PROG} dev --dir {where}` starts it again)")
    sys.stdout.flush()
    return _run(config, str(directory / "worker.toml"))


def _run(config: WorkerConfig, config_path: str) -> int:
    configure_logging(config.worker.log_level, config.worker.log_format)
    return serve(config, config_path)
