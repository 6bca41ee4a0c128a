"""The ``Idempotency-Key`` header for a Flask app: the WSGI face of the same middleware."""

import os

from flask import Flask
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from stateguard import create_tables
from stateguard.http.wsgi import WSGIIdempotencyMiddleware

engine = create_engine(os.environ.get("DATABASE_URL", "sqlite:///flask_shop.db"))
create_tables(engine)
SessionLocal = sessionmaker(engine)
app = Flask(__name__)
charges: list[int] = []


@app.post("/payments")
def pay() -> tuple[dict, int]:
    charges.append(1)                                         # your handler, with its own sessions
    return {"payment": len(charges)}, 201


app.wsgi_app = WSGIIdempotencyMiddleware(app.wsgi_app, session_factory=SessionLocal,
                                         required_paths=["/payments"])
client = app.test_client()
key = {"Idempotency-Key": "p-1", "Authorization": "Bearer alice-token"}
first = client.post("/payments", json={"amount": 5}, headers=key)
retry = client.post("/payments", json={"amount": 5}, headers=key)
assert retry.headers["Idempotency-Replayed"] == "true" and retry.json == first.json == {"payment": 1}
assert client.post("/payments", json={"amount": 6}, headers=key).status_code == 422
assert client.post("/payments", json={"amount": 5}).status_code == 400
assert charges == [1]
engine.dispose()
