"""A fencing token stops a paused lock holder: its late write is STALE, the newer holder's stands.

The fences here are plain integers, as a lock hands them out (``with lock as fence:``): holder A
got 5, paused past its lock's lifetime, and holder B got the lock with 6 and wrote first.
"""

import os

from sqlalchemy import String, create_engine
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column

from stateguard import Outcome, fence_column, guarded_update, version_column


class Base(DeclarativeBase): ...


class Account(Base):
    __tablename__ = "fenced_accounts"
    id: Mapped[int] = mapped_column(primary_key=True)
    iban: Mapped[str] = mapped_column(String(34))
    version: Mapped[int] = version_column()
    fence: Mapped[int | None] = fence_column()               # a nullable BIGINT


engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///fenced.db"))
Base.metadata.create_all(engine)
with Session(engine) as session, session.begin():
    session.add(Account(id=1, iban="DE00 0000"))

fence_a, fence_b = 5, 6                                      # A's lock expired while A was paused
with Session(engine) as session, session.begin():            # B, the current holder, writes
    version = session.get_one(Account, 1).version
    b = guarded_update(session, Account, 1, {"iban": "FR76 1111"}, expected_version=version, fence=fence_b)
    assert b.applied
with Session(engine) as session, session.begin():            # A wakes up and writes with its old fence
    version = session.get_one(Account, 1).version             # even with the latest version ...
    a = guarded_update(session, Account, 1, {"iban": "XX00 6666"}, expected_version=version, fence=fence_a)
    assert a.outcome is Outcome.STALE                         # ... the database refuses it
with Session(engine) as session, session.begin():
    version = session.get_one(Account, 1).version             # B again: an equal fence is the same holder
    assert guarded_update(session, Account, 1, {"iban": "FR76 2222"}, expected_version=version,
                          fence=fence_b).applied
with Session(engine) as session:
    assert session.get_one(Account, 1).iban == "FR76 2222"
engine.dispose()
