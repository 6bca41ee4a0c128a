"""A Flask shop behind WSGIIdempotencyMiddleware, served by gunicorn in tests/http/test_wsgi.py.

``SG_DATABASE_URL`` names the database (stateguard's tables and ``wsgi_charges`` exist);
``SG_LEASE`` the lease in seconds.  ``POST /charges`` records one charge (with the worker's pid)
and answers 201; a body with ``"hold": <seconds>`` keeps the handler busy that long after the
charge, so a test can kill the worker mid-request, unless the file ``SG_GATE`` exists.
``POST /refuse`` answers 409 (a refusal: not stored).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from typing import Any

from flask import Flask, jsonify, request
from sqlalchemy import Integer, String, create_engine, func, select
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, sessionmaker

from stateguard.http.wsgi import WSGIIdempotencyMiddleware


class Base(DeclarativeBase):
    pass


class Charge(Base):
    __tablename__ = "wsgi_charges"
    id: Mapped[int] = mapped_column(primary_key=True)
    key: Mapped[str] = mapped_column(String(100))
    amount: Mapped[int] = mapped_column(Integer)
    pid: Mapped[int] = mapped_column(Integer)


def _engine(url: str) -> Any:
    if url.startswith("sqlite"):
        return create_engine(url, connect_args={"timeout": 60})
    return create_engine(url, pool_size=4, max_overflow=4)


engine = _engine(os.environ.get("SG_DATABASE_URL", "sqlite:///wsgi.db"))
SessionLocal = sessionmaker(engine)
GATE = os.environ.get("SG_GATE", "")

app = Flask(__name__)


@app.post("/charges")
def charge() -> Any:
    body = request.get_json()
    with SessionLocal.begin() as session:
        session.add(
            Charge(key=request.headers.get("Idempotency-Key", ""), amount=body["amount"], pid=os.getpid())
        )
    until = time.monotonic() + float(body.get("hold", 0))
    while time.monotonic() < until and not os.path.exists(GATE):
        time.sleep(0.05)
    with SessionLocal() as session:
        count = session.scalar(select(func.count()).select_from(Charge))
    return jsonify(amount=body["amount"], pid=os.getpid(), charges=count), 201


@app.post("/refuse")
def refuse() -> Any:
    return jsonify(error="out of stock"), 409


app.wsgi_app = WSGIIdempotencyMiddleware(  # type: ignore[method-assign]
    app.wsgi_app,
    session_factory=SessionLocal,
    required_paths=["/charges"],
    anonymous="shared",  # the test clients send no credentials: one namespace, by choice
    lease=timedelta(seconds=float(os.environ.get("SG_LEASE", "60"))),
)
