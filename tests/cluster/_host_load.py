"""The host under load for the cluster test: one HostClient, lanes of publishes, recover.

    python tests/cluster/_host_load.py   (run inside the host's network namespace)

Reads one JSON line of arguments on stdin (broker URL, host id, scope and
scope key file, ledger path and storage key, lanes, keys per run, pace,
tag), prints ``started`` once its client is up, then each lane records and
dispatches ``files.publish`` operations one after another (runs
``<tag>-<lane>-<n>``, one step per key) until stdin says ``stop`` (or
closes). The lanes have no key budget of their own: the test decides how
long the load lasts, and a heal that takes minutes (a paused node
restarted) must still find the load going. A verb a fault cuts short is
counted by its error's type and the lane goes on: ``recover`` settles it.
On ``stop`` the lanes finish their current verb; the same client then
recovers every run (a lookup for each operation not terminal, the same key
sent again where the worker never admitted it) and prints ``RESULT`` with
one JSON document: the runs and their keys, the errors raised, the
client's reconnects, what recovery left unresolved. Secrets travel on
stdin, never on a command line.

SIGUSR1 writes to stderr what each lane is doing and what each task of the
process awaits (the test asks for it when the load seems to stop).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import signal
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import structlog

from octo_common.frames import ScopeKey
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.limits import MAX_SESSION_REQUEST_IDS
from octo_common.payload import ToolPayload
from octo_common.records import StorageKeyring
from octo_host.client import HostClient
from octo_host.plan import WorkflowStep
from octo_host.store import SqliteLedgerStore

TOOL = "files.publish"


def payload(name: str, tag: str) -> ToolPayload:
    return ToolPayload.json({"name": f"{name}.txt", "content": f"{tag}:{name}"})


async def main(a: dict[str, Any]) -> None:
    lanes, per_run = a["lanes"], a["keys_per_run"]
    # A session's call budget above its request limit: the worker's request
    # limit, never this budget, has the client replace a long-lived session.
    grant = CapabilityGrant(TOOL, "json", max_calls=4 * MAX_SESSION_REQUEST_IDS)
    manifest = CapabilityManifest("manifest", [grant])
    client = HostClient(
        a["url"],
        host_id=a["host_id"],
        store=SqliteLedgerStore(a["ledger"], StorageKeyring("host-k1", bytes.fromhex(a["key"]))),
        scope_keys={a["scope"]: ScopeKey.from_file(a["scope_key_file"])},
        reply_timeout=a["reply_timeout"],
        publish_timeout=a["publish_timeout"],
        max_attempts=a["max_attempts"],
        backoff_initial=0.1,
        backoff_max=1.0,
        manifests={a["scope"]: manifest},
    )
    await client.start()
    plan = client.engine.plan([WorkflowStep(f"s{i}", f"publish {i}") for i in range(per_run)])
    session = await client.open_session(a["scope"], manifest)
    stop = asyncio.Event()
    raised: Counter[str] = Counter()
    runs: dict[str, list[str]] = {}
    names: dict[str, str] = {}  # operation key -> file name (the payload of recovery)
    dispatched = Counter[str]()
    doing: dict[int, str] = {}  # lane -> what it does now (for the SIGUSR1 dump)

    async def lane(number: int) -> None:
        for r in itertools.count():
            run_name = f"{a['tag']}-{number}-{r}"
            doing[number] = f"load_run {run_name}"
            run = await client.load_run(run_name, plan)
            runs[run_name] = []
            for step in range(per_run):
                if stop.is_set():
                    return
                name = f"{run_name}-{step}"
                body = payload(name, a["tag"])
                doing[number] = f"record_operation {name}"
                key = await client.record_operation(run, f"s{step}", TOOL, body, name.encode())
                runs[run_name].append(key)
                names[key] = name
                doing[number] = f"dispatch {name} ({time.strftime('%H:%M:%S')})"
                try:
                    await client.dispatch(session.current(), run, key, body)
                    dispatched["returned"] += 1
                except Exception as exc:  # a fault may end a verb; recover settles it
                    raised[type(exc).__name__] += 1
                    # The broker is failing over: the next key waits a little
                    # (the keys are bounded; they are not spent on an outage).
                    await asyncio.sleep(1.0)
                doing[number] = "pace"
                await asyncio.sleep(a["pace"])

    async def stopper() -> None:
        line = await asyncio.to_thread(sys.stdin.readline)
        stop.set()  # also when stdin closes: the test is gone, recover and end
        assert line.strip() in ("stop", ""), line

    def dump() -> None:
        for task in asyncio.all_tasks():
            sys.stderr.write(f"task {task.get_name()}: {awaiting(task)}\n")
        sys.stderr.write(
            f"lanes at {time.strftime('%H:%M:%S')}: returned {dispatched['returned']},"
            f" raised {dict(raised)}, reconnects {client.reconnects}, stop {stop.is_set()}\n"
        )
        for number in sorted(doing):
            sys.stderr.write(f"  lane {number}: {doing[number]}\n")
        sys.stderr.flush()

    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, dump)
    print("started", flush=True)
    watcher = asyncio.ensure_future(stopper())
    await asyncio.gather(*(asyncio.create_task(lane(n), name=f"lane-{n}") for n in range(lanes)))
    await watcher
    started = time.monotonic()
    unresolved: dict[str, list[str]] = {}
    errors: dict[str, dict[str, str]] = {}
    for run_name, keys in runs.items():
        summary = await client.recover(
            run_name,
            plan,
            a["scope"],
            manifest,
            inputs={key: payload(names[key], a["tag"]) for key in keys},
        )
        if summary.unresolved:
            unresolved[run_name] = summary.unresolved
            errors[run_name] = summary.errors
        await client.close_session(summary.session)
    result = {
        "runs": runs,
        "raised": dict(raised),
        "returned": dispatched["returned"],
        "reconnects": client.reconnects,
        "unresolved": unresolved,
        "errors": errors,
        "recover_seconds": time.monotonic() - started,
    }
    print("RESULT " + json.dumps(result), flush=True)
    await client.close()
    await client.store.close()


def awaiting(task: asyncio.Task[Any]) -> str:
    """The chain of coroutines ``task`` is suspended in, innermost last, and what
    the innermost one awaits."""
    parts: list[str] = []
    awaited: Any = task.get_coro()
    while awaited is not None:
        frame = getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)
        if frame is None:
            parts.append(repr(awaited)[:120])
            break
        code = frame.f_code
        parts.append(f"{code.co_name}@{Path(code.co_filename).name}:{frame.f_lineno}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return " > ".join(parts)


if __name__ == "__main__":
    structlog.configure(
        wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
    )
    asyncio.run(main(json.loads(sys.stdin.readline())))
