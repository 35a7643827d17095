"""``python -m octo_host``: the ``octo-host`` command (see :mod:`octo_host.cli`)."""

from octo_host.cli import main

raise SystemExit(main())
