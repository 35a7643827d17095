"""I/O helpers the worker and the host share, each written once.

The one part of :mod:`octo_common` that does I/O: key files named by a
configuration, the rollback anchor file, the SQLite database thread,
PostgreSQL connections and migrations,
confirmed publish and the dead-letter copy, CLI output, fault points.
Only :mod:`octo_worker` and :mod:`octo_host` import it; the protocol
modules of :mod:`octo_common` never do (a unit test checks both rules).
Nothing here decides a protocol rule: callers pass in what to persist,
send or print.
"""
