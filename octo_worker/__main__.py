"""``python -m octo_worker``: the ``octo-worker`` command (see :mod:`octo_worker.cli`)."""

from octo_worker.cli import main

raise SystemExit(main())
