"""Host and worker over TLS with client certificates, on a private RabbitMQ node.

The node is this module's own (``tests/private_rabbit.py``): its only
listener speaks TLS and requires a client certificate signed by the test's
CA; the certificates are made in the test (``tests/tlsfiles.py``). The
server certificate names ``broker.octo.test``, which both sides check
(``server_name``) while connecting to 127.0.0.1. A wrong CA is one line.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import pytest

from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityManifest
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_common.runtime.tls import TlsSettings
from octo_common.states import StateKind
from octo_host.client import HostClient
from octo_host.plan import WorkflowStep
from octo_host.store import AuthenticatedStore, VolatileMemoryStore
from octo_worker.config import load_config
from octo_worker.daemon.daemon import WorkerDaemon
from tests.private_rabbit import PrivateRabbit, running_node
from tests.tlsfiles import TlsFiles, make_tls_files

from .conftest import GRANT, TOOL
from .test_worker_cli import WorkerFiles, octo_worker

pytestmark = [pytest.mark.slow, pytest.mark.rabbitmq]

SERVER_NAME = "broker.octo.test"


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_tls_files(tmp_path_factory.mktemp("tls") / "certs", SERVER_NAME)


@pytest.fixture(scope="module")
def rabbit(
    tmp_path_factory: pytest.TempPathFactory, tls_files: TlsFiles
) -> Iterator[PrivateRabbit]:
    with running_node(tmp_path_factory.mktemp("rabbit-tls"), tls_files) as node:
        yield node


def _tls_table(files: TlsFiles, ca: Path | None = None, client: bool = True) -> str:
    lines = [
        "[broker.tls]",
        f'ca_file = "{ca or files.ca}"',
        f'server_name = "{SERVER_NAME}"',
    ]
    if client:
        lines += [f'cert_file = "{files.client_cert}"', f'key_file = "{files.client_key}"']
    return "\n".join(lines) + "\n"


def _host_tls(files: TlsFiles, ca: Path | None = None) -> TlsSettings:
    return TlsSettings(
        where="broker.tls",
        ca_file=ca or files.ca,
        cert_file=files.client_cert,
        key_file=files.client_key,
        server_name=SERVER_NAME,
    )


def _client(rabbit: PrivateRabbit, scope: str, key: bytes, tls: TlsSettings) -> HostClient:
    store = AuthenticatedStore(VolatileMemoryStore(), StorageKeyring("h1", secrets.token_bytes(32)))
    return HostClient(
        rabbit.url,
        host_id=f"tls-host-{secrets.token_hex(4)}",
        scope_keys={scope: ScopeKey.from_bytes(key)},
        store=store,
        reply_timeout=30.0,
        publish_timeout=15.0,
        max_attempts=2,
        broker_tls=tls,
    )


async def test_host_and_worker_dispatch_over_tls_with_client_certificates(
    rabbit: PrivateRabbit, tls_files: TlsFiles, tmp_path: Path
) -> None:
    scope = f"tls-{secrets.token_hex(4)}"
    files = WorkerFiles(tmp_path / "worker", rabbit.url, scope, extra=_tls_table(tls_files))
    daemon = WorkerDaemon(load_config(files.config))
    running = asyncio.create_task(daemon.run())
    client = _client(rabbit, scope, files.scope_key, _host_tls(tls_files))
    try:
        await asyncio.wait_for(daemon.wait_ready(), 60.0)
        await client.start()
        plan = client.engine.plan([WorkflowStep("publish", "publish over TLS")])
        run = await client.load_run("tls-run", plan)
        payload = ToolPayload.json({"name": "tls.txt", "content": "over tls"})
        key = await client.record_operation(run, "publish", TOOL, payload, b"tls:1")
        session = await client.open_session(scope, CapabilityManifest("manifest", [GRANT]))
        state = await client.dispatch(session, run, key, payload)
        assert state.kind == StateKind.SUCCEEDED
        assert (files.published / "tls.txt").read_text() == "over tls"
    finally:
        with contextlib.suppress(Exception):
            await client.close()
        daemon.request_stop()
        await asyncio.wait_for(running, 30.0)


async def test_a_wrong_ca_or_no_client_certificate_fails_with_one_clear_line(
    rabbit: PrivateRabbit, tls_files: TlsFiles, tmp_path: Path
) -> None:
    scope = f"tls-{secrets.token_hex(4)}"
    # The worker's commands: `check` names the broker's refusal on its broker line.
    wrong = WorkerFiles(
        tmp_path / "wrong-ca", rabbit.url, scope, extra=_tls_table(tls_files, tls_files.other_ca)
    )
    result = octo_worker("check", config=wrong.config)
    assert result.returncode != 0
    (broker_line,) = [line for line in result.stdout.splitlines() if line.startswith("broker:")]
    assert "TLS: the broker's certificate was not accepted" in broker_line
    assert "broker.tls.ca_file" in broker_line
    assert "Traceback" not in result.stdout + result.stderr

    # The host client: one line, naming what to check.
    client = _client(rabbit, scope, wrong.scope_key, _host_tls(tls_files, tls_files.other_ca))
    with pytest.raises(Exception) as refused:
        await client.start()
    text = str(refused.value)
    assert "\n" not in text and "TLS: the broker's certificate was not accepted" in text
    with contextlib.suppress(Exception):
        await client.close()

    # Without a client certificate the broker refuses the connection (under
    # TLS 1.3 after the handshake, so the AMQP client sees only a reset): one
    # line that names the settings to check.
    anonymous = WorkerFiles(
        tmp_path / "no-cert", rabbit.url, scope, extra=_tls_table(tls_files, client=False)
    )
    result = octo_worker("check", config=anonymous.config)
    assert result.returncode != 0
    (broker_line,) = [line for line in result.stdout.splitlines() if line.startswith("broker:")]
    assert "FAIL" in broker_line and "TLS: the broker refused this client" in broker_line
    assert "broker.tls.cert_file" in broker_line and "broker.tls.key_file" in broker_line
    assert "Traceback" not in result.stdout + result.stderr

    no_cert = TlsSettings(
        where="broker.tls",
        ca_file=tls_files.ca,
        cert_file=None,
        key_file=None,
        server_name=SERVER_NAME,
    )
    client = _client(rabbit, scope, anonymous.scope_key, no_cert)
    with pytest.raises(Exception) as refused:
        await client.start()
    reason = str(getattr(refused.value, "reason", ""))
    assert "\n" not in reason and "TLS: the broker refused this client" in reason
    assert "check broker.tls.cert_file and broker.tls.key_file" in reason
    with contextlib.suppress(Exception):
        await client.close()
