"""The host's authenticated record storage: one module per part.

``contract`` (the backend contract and the rules every backend shares),
``authenticated`` (``AuthenticatedStore``), ``memory``, ``sqlite`` and
``postgres`` (the backends and their ledger stores; ``postgres_sql`` beside
the last, and ``octo_common.runtime.postgres`` for the URL, password file,
pool and migrations), ``head`` (the sealed store head that
commits to every record), ``anchor`` (the rollback anchor file's formats and
rules) and ``sqlite_head`` (how the SQLite backend keeps both).
``octo_host.store`` re-exports the public names (docs/host-library.md).

This package must never import the client, the CLI or the worker.
"""
