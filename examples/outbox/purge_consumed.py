"""Consumed-message records are kept until purged; ages are judged on the database's clock."""

import os
import time
from datetime import timedelta

from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from stateguard import consume_once, create_tables, purge_consumed

engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///consumer.db"))
create_tables(engine)
with Session(engine) as session, session.begin():
    assert consume_once(session, "billing", "msg-1").applied
with Session(engine) as session, session.begin():
    assert consume_once(session, "billing", "msg-1").outcome.name == "REPEATED"   # a redelivery

while purge_consumed(engine, older_than=timedelta(days=30)) == 1000: ...   # nightly: keeps msg-1
time.sleep(0.01)
assert purge_consumed(engine, older_than=timedelta(milliseconds=1)) == 1     # now msg-1 is gone
engine.dispose()
