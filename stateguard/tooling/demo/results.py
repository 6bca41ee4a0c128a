"""What a demo run records: the requests it sends, the tallies of their outcomes, the table's rows.

:class:`Request` is one logical request (delivered several times),
:class:`Tally` what its deliveries returned, :class:`SchemeRow` one row of the
result table (with the damage measured in the database afterwards) and
:class:`DemoReport` the whole run, as :mod:`~stateguard.tooling.demo.render`
and :mod:`stateguard.tooling.report` show it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from ...result import Outcome

__all__ = ["HAND_WRITTEN", "STATEGUARD", "Delivery", "DemoReport", "Request", "SchemeRow", "Tally"]

#: The ``code`` of a row run by stateguard.
STATEGUARD = "stateguard"
#: The ``code`` of a row run by the usual hand-written code (load, check in Python, save).
HAND_WRITTEN = "hand-written"


@dataclass(frozen=True, slots=True)
class Request:
    """One logical request; the demo delivers each of them several times."""

    order_id: int
    action: str

    @property
    def request_id(self) -> str:
        return f"{self.order_id}:{self.action}"


@dataclass
class Tally:
    """What the deliveries of one scheme returned.

    ``counts`` holds named extras a scenario reports next to the table
    (``{"409 in progress": 12}``).
    """

    attempts: int = 0
    retried: int = 0
    outcomes: Counter[Outcome] = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    counts: Counter[str] = field(default_factory=Counter)


@dataclass
class Delivery:
    """One delivery of a request, as a :meth:`DemoRun.storm` sender sees it.

    The sender counts its own re-sends in ``retried`` and anything worth
    reporting in ``counts``; they are added to the tally even when it raises.
    """

    request: Request
    worker: str
    retried: int = 0
    counts: Counter[str] = field(default_factory=Counter)


@dataclass
class SchemeRow:
    """One row of the result table."""

    scheme: str
    how: str
    attempts: int
    applied: int
    repeated: int
    rejected: int
    retried: int
    side_effects: int
    problems: list[str] = field(default_factory=list)
    other: dict[str, int] = field(default_factory=dict)
    #: :data:`STATEGUARD` or :data:`HAND_WRITTEN` (the usual code, run on the same storm).
    code: str = "stateguard"
    #: The damage measured in the database afterwards, by kind (``{"double charges": 12}``).
    damage: dict[str, int] = field(default_factory=dict)

    @property
    def label(self) -> str:
        """``"scheme (how)"``, e.g. ``"state machine (pay/ship/cancel)"``."""
        return f"{self.scheme} ({self.how})"

    @property
    def naive(self) -> bool:
        """``True`` for the hand-written variant (its damage is the point, not a failure of the demo)."""
        return self.code == HAND_WRITTEN

    @property
    def held(self) -> bool:
        """``True`` when the invariant held and nothing unexpected happened."""
        return not self.problems

    @property
    def ok(self) -> bool:
        """Whether the row is as it should be.

        A stateguard row holds the invariant; a hand-written row raised nothing (its damage is expected).
        """
        return not self.other.get("errors") if self.naive else self.held

    @property
    def damage_total(self) -> int:
        return sum(self.damage.values())


@dataclass
class DemoReport:
    """All rows of a demo run."""

    rows: list[SchemeRow]
    seed: int
    workers: int
    orders: int
    url: str
    elapsed: float
    #: Lines the scenarios want printed under the table (what a row means, skipped scenarios).
    notes: list[str] = field(default_factory=list)
    #: Where the demo wrote (``'PostgreSQL schema "sg_demo"'``), when known.
    namespace: str = ""
    #: What happened to the namespace after the run (dropped, or kept and how to drop it).
    afterwards: str = ""
    #: The database's name for the notes (``"postgresql"``, ``"mariadb"``, ``"sqlite"``).
    dialect: str = ""

    @property
    def ok(self) -> bool:
        """Every stateguard row held its invariant and no hand-written row raised."""
        return all(row.ok for row in self.rows)
