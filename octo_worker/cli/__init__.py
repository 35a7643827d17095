"""The ``octo-worker`` command: run the daemon and operate what it keeps.

Verbs: ``dev``, ``run``, ``check``, ``topology declare|show``, ``journal
list|show|verify|init-anchor|prune|reseal``, ``adapters list``, ``dlq
list|show|drop`` and ``console`` (``octo_worker.console``). Every
verb takes ``--config PATH`` (default ``/etc/octo/worker.toml``) and ``--json``
(one JSON document on stdout, for scripts).

Exit codes (``octo_common.runtime.output``): 0 ok, 1 a check failed or a
thing was not found, 2 usage or configuration error, 3 the broker is
unreachable (or refused a topology change), 4 the journal database is
unusable, 5 ``run`` stopped because another worker holds the fence of every
scope (a superseded failover worker).

One module per verb group: ``dev`` (a first local worker), ``run`` (run,
check), ``topology`` (declare, show), ``journal`` (list, show, verify, prune, reseal, init-anchor),
``adapters`` (list), ``dlq`` (list, show, drop) and ``console`` (the web
console, served by ``octo_worker.console``); beside them ``common`` (configuration, the
broker, the journal store, argument types) and ``main`` (the parser and the
entry point).

The package owns argument parsing, the process's logging set-up and the
operator views of the journal and the dead-letter queue. It must never
print a traceback, a key, a frame body (unless ``--body`` asks for one), a
payload, or adapter text: errors are one line on stderr naming the problem,
journal payloads are shown as format and byte count, and log processors
drop exception text (the daemon logs error codes).
"""

from octo_worker.cli.common import DEFAULT_CONFIG, PROG, run_event_loop
from octo_worker.cli.main import build_parser, main
from octo_worker.cli.run import configure_logging

__all__ = [
    "DEFAULT_CONFIG",
    "PROG",
    "build_parser",
    "configure_logging",
    "main",
    "run_event_loop",
]
