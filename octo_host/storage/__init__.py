"""The host's authenticated record storage (H§17): one module per part.

``contract`` (the backend contract and the rules every backend shares),
``authenticated`` (``AuthenticatedStore``), ``memory``, ``sqlite`` and
``postgres`` (the backends and their ledger stores; ``postgres_sql`` and
``postgres_config`` beside the last), ``anchor`` (the rollback anchor).
``octo_host.store`` re-exports the public names of PROTOCOL.md §2.3.

This package must never import the client, the CLI or the worker.
"""
