"""idempotent(mode="separate") at its edges: a failure rolls back the writes that were not checkpointed
and keeps the checkpointed ones, base exceptions release the key, and a same-transaction call meets
IN_PROGRESS for a live separate claim."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy import Engine
from sqlalchemy.orm import Session

from stateguard import (
    RequestFailed,
    RequestInProgress,
    idempotent,
)
from tests._support.idem_items import Boom, Item, _names, md
from tests.conftest import Backend


@pytest.fixture
def eng(engine: Engine, backend: Backend) -> Iterator[Engine]:
    backend.create(md)
    yield engine


@pytest.mark.parametrize("exc", [KeyboardInterrupt, SystemExit])
def test_base_exceptions_release_a_separate_key(eng: Engine, exc: type[BaseException]) -> None:
    with pytest.raises(exc), Session(eng) as s, idempotent(s, scope="bs", key="k", mode="separate"):
        s.add(Item(id=1, name="leak"))
        s.flush()
        raise exc()
    assert _names(eng) == []
    with Session(eng) as s, idempotent(s, scope="bs", key="k", mode="separate") as call:
        assert not call.replayed
        call.complete("ok")


def test_same_transaction_gets_in_progress_for_a_live_separate_claim(eng: Engine) -> None:
    with Session(eng) as s1, idempotent(s1, scope="mix", key="k", mode="separate") as first:
        with pytest.raises(RequestInProgress) as caught, Session(eng) as s2, s2.begin():
            with idempotent(s2, scope="mix", key="k"):
                pytest.fail("ran while a live claim holds the key")
        assert caught.value.retry_after is not None
        first.complete({"n": 2**63 + 1})
    with Session(eng) as s, s.begin(), idempotent(s, scope="mix", key="k") as call:
        assert call.replayed and call.response == {"n": 2**63 + 1}


def test_separate_mode_edges(eng: Engine) -> None:
    # release(forget=True) frees the key for another body
    with Session(eng) as s, idempotent(s, scope="se", key="k", fingerprint="a", mode="separate") as call:
        call.checkpoint("x", {"n": 2**63})
        call.release("refused", forget=True)
    with Session(eng) as s, idempotent(s, scope="se", key="k", fingerprint="b", mode="separate") as call:
        assert not call.replayed and not call.taken_over and call.checkpoint_name is None
        call.complete("b")
    # a non-retryable error whose text has NUL / lone surrogate is stored escaped, not left in progress
    with pytest.raises(Boom), Session(eng) as s:
        with idempotent(s, scope="se", key="nul", mode="separate", non_retryable=(Boom,)):
            raise Boom("a\x00b\ud800c")
    with pytest.raises(RequestFailed) as caught, Session(eng) as s:
        with idempotent(s, scope="se", key="nul", mode="separate"):
            pytest.fail("ran")
    error = caught.value.error
    assert error is not None and error.startswith("Boom: a") and "\x00" not in error


@pytest.mark.rollback
def test_separate_failure_rolls_back_uncheckpointed_writes_and_keeps_checkpointed_ones(eng: Engine) -> None:
    with pytest.raises(Boom), Session(eng) as s:
        with idempotent(s, scope="sf", key="k", mode="separate") as call:
            s.add(Item(id=1, name="phase1"))
            call.checkpoint("p1", {"s": 'é\u2028😀\\"', "n": -(2**63) - 1})
            s.add(Item(id=2, name="leak"))
            s.flush()
            raise Boom
    assert _names(eng) == ["phase1"]
    with Session(eng) as s, idempotent(s, scope="sf", key="k", mode="separate") as call:
        assert call.taken_over and call.attempt == 2
        assert call.checkpoint_data == {"s": 'é\u2028😀\\"', "n": -(2**63) - 1}
        call.complete("ok")
