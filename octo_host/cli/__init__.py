"""The ``octo-host`` command: drive and inspect workflow runs from the shell.

Verbs: ``keys generate``, ``ledger show|init-anchor``, ``find``,
``dispatch``, ``reconcile``, ``compensate``, ``recover``, ``resolve`` and
``audit show``.
Every verb takes ``--config PATH`` (default ``/etc/octo/host.toml``, see
:mod:`octo_host.config`) and ``--json`` (one JSON document on stdout).

Exit codes: 0 ok (for the verbs that talk to a worker: the operation or
compensation is ``succeeded``); 1 refused, not found, or the observed state
is not ``succeeded`` (failed, cancelled, or still pending after every
attempt); 2 usage or configuration error; 3 the broker is unreachable (or
no worker queue exists for the scope); 4 the ledger database is unusable.

Payloads (``--payload``, ``--original``) are given inline or as ``@FILE``;
their format is the configured grant's: JSON for ``format = "json"`` (strict
parse), the text as is for ``format = "text"``. The ledger keeps only
fingerprints, so the verbs that resend an input take it again and check it
against the recorded fingerprint; ``reconcile`` sends none (a lookup), and
``find KEY`` names the run that holds a key (``reconcile`` and ``resolve``
take the run from the key when it is not given). ``recover --inputs FILE`` reads
``{"operations": {KEY: input}, "compensations": {KEY: {"inverse": input,
"original": input}}}`` (inputs as JSON values: objects for JSON tools,
strings for text tools).

``dispatch`` derives the ``op-`` key from plan, step, tool, input and nonce
(default nonce ``RUN/STEP``), so repeating the same command after a crash
finds the recorded key and settles it instead of creating another.
``compensate`` resumes a recorded, unfinished compensation with the same
inverse (fresh approval) and refuses any other second compensation.
``resolve`` (an ``op-`` key decides an operation, a ``cmp-`` key a
compensation) audits the decision, then sends it to the worker in a sealed
lookup request: its journal records it without calling the adapter, and
the ledger records the worker's answer (``--host-only``: the ledger alone).

One command at a time per ledger: the broker verbs and ``resolve`` hold an
exclusive lock on ``<database>.lock``, because two processes of one host id
would share the reply queue and take each other's replies.

One module per verb group: ``keys``, ``ledger`` (show, init-anchor),
``operations`` (dispatch, reconcile), ``compensate``, ``recover``, ``audit``
(resolve, audit show); beside them ``options`` (arguments and payloads),
``context`` (configuration, plans, the store, the client), ``results`` (what
a verb prints) and ``main`` (the parser and the entry point).

The package owns argument parsing, output and the exit status. It must never
print a traceback, a key, a payload, worker failure text or an operator's
reason outside ``audit show``; errors are one line on stderr. It does not
import :mod:`octo_worker`.
"""

from octo_common.runtime.output import (
    EXIT_BROKER,
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
)
from octo_host.cli.main import main

__all__ = [
    "EXIT_BROKER",
    "EXIT_CHECK_FAILED",
    "EXIT_OK",
    "EXIT_STORAGE",
    "EXIT_USAGE",
    "main",
]
