"""The operator's read-only web console (``octo-worker console``).

Modules: ``data`` (what the pages show, gathered with the ``journal`` and
``dlq`` verbs' own helpers), ``live`` (the delivery counters, in process or
scraped), ``security`` (bind address, access token, Host header), ``app``
(the aiohttp application and its pages), ``serve`` (binding it, for the
``console`` verb in ``octo_worker.cli.console`` and for the daemon's
optional console beside its metrics). Templates and the one
stylesheet and script live in ``templates/`` and ``static/``.

The console must never change state (GET and HEAD only; no verb writes the
journal, acknowledges a dead letter or sends a frame), never render a
payload, frame body, key or adapter failure text, and never bind a
non-loopback address without both ``allow_remote`` and an access token.
"""
