"""stateguard's own alembic revisions (branch label ``stateguard``).

Shipped inside the wheel as ``stateguard.migrations``; point alembic's
``version_locations`` at :func:`stateguard.migrations_location`.
"""
