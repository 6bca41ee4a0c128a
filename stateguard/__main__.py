"""``python -m stateguard``: the same as the ``stateguard`` command."""

from .tooling.cli import main

raise SystemExit(main())
