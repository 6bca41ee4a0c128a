"""Client-side work of one idempotency call, counted in machine instructions rather than timed.

Wall-clock ratios move by a few per cent from run to run on a shared 2-core machine; an
instruction count under ``valgrind --tool=callgrind`` does not.  This runs ``calls`` calls of
one variant of the idempotency scenario (:func:`bench.idempotency._calls`) on an in-memory
SQLite database, so that no server and no I/O wait is counted: only the Python, SQLAlchemy and
driver work of the client.  Run it twice with two call counts and divide the difference of the
totals by the difference of the counts (start-up cancels out)::

    for n in 100 700; do
        PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/tmp/cg.$n \\
            python -m bench.instructions first $n 2>&1 | grep Collected
    done

``PYTHONHASHSEED=0`` and fixed keys make a count repeatable to the instruction; compare trees
checked out at paths of the same length (a module's path is hashed, and the hash decides dict
layouts).  Variants: ``first``, ``floor2`` (Core INSERT + UPDATE), ``hand`` (stateguard's two
statements written by hand) and ``savepoint`` (the same with the block's ``begin_nested()``).
"""

from __future__ import annotations

import sys

from sqlalchemy import create_engine
from sqlalchemy.pool import StaticPool

from stateguard.tables import idempotency_keys

from . import idempotency

VARIANTS = {
    "first": idempotency.FIRST,
    "floor2": idempotency.FLOOR2,
    "hand": idempotency.BY_HAND,
    "savepoint": idempotency.BY_HAND_SAVEPOINT,
}
#: Calls made before the counted ones matter (statement caches, the statement hook, the pool).
WARMUP = 20


def main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in VARIANTS or not argv[1].isdigit():
        print(f"usage: python -m bench.instructions {{{','.join(VARIANTS)}}} CALLS", file=sys.stderr)
        return 2
    engine = create_engine("sqlite://", poolclass=StaticPool)
    idempotency_keys.metadata.create_all(engine, tables=[idempotency_keys])
    call = idempotency._calls(engine)[VARIANTS[argv[0]]]
    for i in range(WARMUP + int(argv[1])):
        call(f"key-{i}")
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
