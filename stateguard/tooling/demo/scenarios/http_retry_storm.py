"""The HTTP retry storm: ``POST /payments`` with an ``Idempotency-Key`` on a Starlette app.

The handler is naive (every call charges); the stateguard variant puts
:class:`stateguard.asgi.IdempotencyMiddleware` in front of it.  Requests go
in-process, as an ASGI server would send them (:func:`asgi_request`), from
the storm's worker threads through an anyio portal.  It needs starlette
(``pip install 'stateguard[demo]'``) and is skipped, with a note, without it.
"""

from __future__ import annotations

import json
import random
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, func, select
from sqlalchemy.orm import sessionmaker

from ....result import Outcome
from ....tables import create_tables, idempotency_keys
from ..models import DemoSideEffect
from ..results import HAND_WRITTEN, STATEGUARD, Delivery, Request, SchemeRow
from ..storm import DemoRun, Sender, scenario

if TYPE_CHECKING:
    from ....http.asgi import ASGIApp, Message

__all__ = ["DEMO_KEY_SCOPE", "HttpAnswer", "asgi_request", "http_retry_storm"]


#: Scope prefix of the demo's idempotency keys; a run deletes the keys of earlier runs.
DEMO_KEY_SCOPE = "stateguard-demo:"
#: How long the demo's payment provider takes: the window in which retries arrive.
_PROVIDER_LATENCY = 0.01
#: How long a client keeps retrying 409 and 503 answers before it reports an error.
_CLIENT_PATIENCE = 60.0


@dataclass(frozen=True, slots=True)
class HttpAnswer:
    """An HTTP response as the demo's client received it (header names in lower case)."""

    status: int
    headers: dict[str, str]
    body: bytes


async def asgi_request(
    app: ASGIApp, method: str, path: str, headers: Sequence[tuple[bytes, bytes]], body: bytes
) -> HttpAnswer:
    """Send one request to ``app`` in-process, as an ASGI server would, and collect the response.

    The demo's transport: no sockets and no HTTP client library.  Run it on
    an event loop, e.g. through an anyio blocking portal from worker threads::

        with anyio.from_thread.start_blocking_portal() as portal:
            answer = portal.call(asgi_request, app, "POST", "/payments", headers, b'{"amount": 1}')
    """
    import anyio

    finished = anyio.Event()
    delivered = False
    status = 0
    out_headers: dict[str, str] = {}
    chunks: list[bytes] = []

    async def receive() -> Message:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": body, "more_body": False}
        # The client stays connected until the response is complete.
        await finished.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        nonlocal status
        if message["type"] == "http.response.start":
            status = int(message["status"])
            for name, value in message.get("headers", ()):
                out_headers[bytes(name).decode("latin-1").lower()] = bytes(value).decode("latin-1")
        elif message["type"] == "http.response.body":
            chunks.append(bytes(message.get("body", b"")))
            if not message.get("more_body", False):
                finished.set()

    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("ascii"),
        "query_string": b"",
        "root_path": "",
        "headers": [
            (b"host", b"demo.invalid"),
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode("ascii")),
            *headers,
        ],
        "client": ("127.0.0.1", 40000),
        "server": ("demo.invalid", 80),
        "state": {},
    }
    try:
        await app(scope, receive, send)
    finally:
        finished.set()
    return HttpAnswer(status, out_headers, b"".join(chunks))


@scenario("http retry storm")
def http_retry_storm(run: DemoRun) -> list[SchemeRow]:
    """POST /payments with an Idempotency-Key through ``IdempotencyMiddleware`` on a Starlette app.

    The handler is deliberately naive: every call charges (records a side
    effect), so only the middleware keeps it to once per key.  Each payment
    is sent 2-4 times (twins at the same instant, retries later); clients
    send a 409 (in progress) or 503 again (the provider fails the first call
    of a tenth of the payments: the middleware releases the key).  After
    the storm a tenth of the keys are reused for another amount: each must
    get 422.  The app runs in-process on one event loop (an anyio portal),
    as under an ASGI server; the clients are the demo's worker threads.
    """
    scheme = "http retry storm"
    try:
        from anyio.from_thread import BlockingPortal, start_blocking_portal
        from starlette.applications import Starlette
        from starlette.concurrency import run_in_threadpool
        from starlette.requests import Request as HttpRequest
        from starlette.responses import JSONResponse, Response
        from starlette.routing import Route
    except ImportError as error:
        run.notes.append(
            f"{scheme}: skipped: it needs starlette ({error}); pip install 'stateguard[demo]' to run it"
        )
        return []
    from ....asgi import IdempotencyMiddleware

    token = uuid.uuid4().hex[:8]
    key_scope = f"{DEMO_KEY_SCOPE}{token}"  # keys outlive the sg_demo_* tables: unique per run
    create_tables(run.engine)
    with run.engine.begin() as conn:
        conn.execute(delete(idempotency_keys).where(idempotency_keys.c.scope.startswith(DEMO_KEY_SCOPE)))
    ids = run.create_orders(run.orders)
    flaky_first = run.rng.sample(ids, max(1, len(ids) // 10))
    reused_first = run.rng.sample(ids, max(1, len(ids) // 10))
    plan = run.plan([[[Request(order_id, "pay")] for order_id in ids]])
    naive_plan, naive_ids = run.same_storm(plan, ids)
    moved = dict(zip(ids, naive_ids, strict=True))
    session_factory = sessionmaker(run.engine)
    lock = threading.Lock()
    rows: list[SchemeRow] = []

    for code in (HAND_WRITTEN, STATEGUARD):
        orders = ids if code == STATEGUARD else naive_ids
        deliveries = plan if code == STATEGUARD else naive_plan
        flaky = {o if code == STATEGUARD else moved[o] for o in flaky_first}
        reused = [o if code == STATEGUARD else moved[o] for o in reused_first]
        amounts = {order_id: 100 * (1 + i % 50) for i, order_id in enumerate(orders)}
        key = run.key(scheme, code)
        #: order id -> payment ids seen in 201 answers (a replay must show the first call's).
        seen: dict[int, set[int]] = {}

        def charge(order_id: int, amount: int, idem_key: str, worker: str, *, key: str = key,
                   flaky: set[int] = flaky) -> Response:  # fmt: skip
            with lock:
                fail = order_id in flaky
                flaky.discard(order_id)
            time.sleep(_PROVIDER_LATENCY)
            if fail:
                return JSONResponse({"error": "payment provider unavailable, try again"}, status_code=503)
            with session_factory() as session, session.begin():
                effect = DemoSideEffect(
                    scheme=key, order_id=order_id, action="pay", request_id=idem_key, worker=worker
                )
                session.add(effect)
                session.flush()
                payment_id = effect.id
            return JSONResponse(
                {"payment_id": payment_id, "order_id": order_id, "amount": amount},
                status_code=201,
                headers={"Location": f"/payments/{payment_id}"},
            )

        def create_payment(charge: Callable[..., Response]) -> Callable[[HttpRequest], Any]:
            async def endpoint(request: HttpRequest) -> Response:
                body = await request.json()
                idem_key = request.headers.get("idempotency-key", "")
                worker = request.headers.get("x-demo-worker", "?")
                return await run_in_threadpool(
                    charge, int(body["order_id"]), int(body["amount"]), idem_key, worker
                )

            return endpoint

        app = Starlette(routes=[Route("/payments", create_payment(charge), methods=["POST"])])
        if code == STATEGUARD:
            app.add_middleware(
                IdempotencyMiddleware,
                session_factory=session_factory,
                required_paths=["/payments"],
                scope=key_scope,
            )

        def client(portal: BlockingPortal, *, other_amount: bool, app: Any = app, amounts: dict[int, int]
                   = amounts, seen: dict[int, set[int]] = seen) -> Sender:  # fmt: skip
            def send(delivery: Delivery) -> Outcome:
                order_id = delivery.request.order_id
                amount = amounts[order_id] + (1 if other_amount else 0)
                body = json.dumps({"order_id": order_id, "amount": amount}).encode("utf-8")
                headers = [
                    (b"idempotency-key", f"order-{order_id}-pay".encode("ascii")),
                    (b"x-demo-worker", delivery.worker.encode("ascii")),
                ]
                deadline = time.monotonic() + _CLIENT_PATIENCE
                while True:
                    answer = portal.call(asgi_request, app, "POST", "/payments", headers, body)
                    if answer.status not in (409, 503):
                        break
                    if answer.status == 409 and "retry-after" not in answer.headers:
                        raise RuntimeError("409 without a Retry-After header")
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"still HTTP {answer.status} after {_CLIENT_PATIENCE:.0f}s of retries"
                        )
                    delivery.retried += 1
                    delivery.counts["409 in progress" if answer.status == 409 else "503 released"] += 1
                    # A real client waits Retry-After seconds (or backs off); the demo a few milliseconds.
                    time.sleep(random.uniform(0.002, 0.01))
                if answer.status == 422:
                    return Outcome.REJECTED
                if answer.status != 201:
                    raise RuntimeError(
                        f"HTTP {answer.status}: {answer.body[:120].decode('utf-8', 'replace')}"
                    )
                payment_id = int(json.loads(answer.body)["payment_id"])
                with lock:
                    seen.setdefault(order_id, set()).add(payment_id)
                replayed = answer.headers.get("idempotency-replayed") == "true"
                return Outcome.REPEATED if replayed else Outcome.APPLIED

            return send

        with start_blocking_portal() as portal:
            tally = run.storm(deliveries, client(portal, other_amount=False))
            # Every key is completed now: a buggy client reuses some for another amount.
            reuse = [[Request(order_id, "pay")] for order_id in reused]
            run.storm(reuse, client(portal, other_amount=True), tally=tally)

        damage = run.duplicates(scheme, code, {"pay": "double charges"})
        how = (
            "Starlette + IdempotencyMiddleware, POST /payments with Idempotency-Key"
            if code == STATEGUARD
            else "Starlette, the Idempotency-Key header ignored"
        )
        if code == HAND_WRITTEN:
            rows.append(run.row(scheme, how, tally, code=code, damage=damage))
            continue
        with run.engine.connect() as conn:
            per_order = {
                int(order_id): int(n)
                for order_id, n in conn.execute(
                    select(DemoSideEffect.order_id, func.count())
                    .where(DemoSideEffect.scheme == key)
                    .group_by(DemoSideEffect.order_id)
                )
            }
            completed = conn.scalar(
                select(func.count())
                .select_from(idempotency_keys)
                .where(idempotency_keys.c.scope == key_scope, idempotency_keys.c.status == "completed")
            )
        executions = [per_order.get(order_id, 0) for order_id in ids]
        problems: list[str] = []
        never = executions.count(0)
        if never:
            problems.append(f"{never} payments never ran")
        if completed != len(ids):
            problems.append(f"{completed} of {len(ids)} idempotency keys are completed")
        mixed = sorted(order_id for order_id, payments in seen.items() if len(payments) > 1)
        if mixed:
            problems.append(
                f"{len(mixed)} keys were answered with different payments, e.g. order {mixed[0]}: "
                f"{sorted(seen[mixed[0]])}"
            )
        refused = tally.outcomes[Outcome.REJECTED]
        if refused != len(reused):
            problems.append(
                f"{refused} of {len(reused)} keys reused for another amount were refused with 422"
            )
        if sum(damage.values()):
            problems.append(f"damage {damage}")
        run.notes.append(
            f"{scheme}: executions per key: min {min(executions)}, max {max(executions)} "
            f"over {len(ids)} keys (must be exactly 1)"
        )
        rows.append(run.row(scheme, how, tally, problems=problems, code=code, damage=damage))
    run.notes.append(f"{scheme}: APPLIED = the handler ran, REPEATED = the stored response replayed,")
    run.notes.append(
        f"{scheme}: REJECTED = 422 (a key reused for another amount), retried = 409 and 503 answers resent"
    )
    return rows
