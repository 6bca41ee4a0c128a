"""``python -m stateguard``: the same as the ``stateguard`` command."""

from .cli import main

raise SystemExit(main())
