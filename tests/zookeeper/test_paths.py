"""ZooKeeperLock paths: what ZooKeeper refuses is InvalidArgument before anything is sent.

ZooKeeper's rules (PathUtils.validatePath) are checked on Java chars, UTF-16
units, so a character above U+FFFF is a surrogate pair there and refused;
the size that counts is the request's, in the UTF-8 bytes kazoo sends,
bounded by jute.maxbuffer (about 1 MB).  Against a real server: a create of
a 1,048,528-byte path is the largest it takes; one byte more and it drops
the connection, kazoo retries forever and every other lock on the client
reads SUSPENDED meanwhile.  ZooKeeperLock allows contender znode paths of
at most 4,096 bytes and refuses longer ones up front.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from stateguard import InvalidArgument, ZooKeeperLock

pytest.importorskip("kazoo", reason="!!! SKIPPED: kazoo is not installed (pip install -e '.[test]')")

from kazoo.protocol.states import KazooState

#: The longest contender znode path ZooKeeperLock allows, in UTF-8 bytes.
MAX_BYTES = 4096
#: What kazoo's recipe appends per contender: '/' + uuid4 hex + '__lock__' + 10-digit sequence.
SUFFIX = 1 + 32 + 8 + 10


def path_of(base: str, size: int, char: str = "a") -> str:
    """A path under ``base`` whose contender znode path is ``size`` bytes in UTF-8 (``char`` as filler,
    ASCII for the bytes a multi-byte ``char`` cannot fill)."""
    room = size - SUFFIX - len(base.encode()) - 1
    width = len(char.encode())
    return f"{base}/{char * (room // width)}{'a' * (room % width)}"


@pytest.fixture
def base() -> str:
    """A parent path of this test's own."""
    return f"/sg-tests/{uuid.uuid4().hex[:12]}"


@pytest.fixture
def watched(zk: Any, base: str) -> Iterator[tuple[ZooKeeperLock, list[str]]]:
    """A lock held on ``zk`` during the test and the client's connection states seen meanwhile."""
    states: list[str] = []
    zk.add_listener(states.append)
    sentinel = ZooKeeperLock(zk, f"{base}-sentinel")
    sentinel.acquire(timeout=10)
    yield sentinel, states
    sentinel.release()


def assert_untouched(zk: Any, watched: tuple[ZooKeeperLock, list[str]]) -> None:
    """The client never left CONNECTED, and the other lock on it is still held with the same fence."""
    sentinel, states = watched
    assert states == [], f"the client's connection changed state: {states}"
    assert zk.state == KazooState.CONNECTED
    assert sentinel.is_held()
    sentinel.fence  # noqa: B018 (raises LockLost while suspended)


@pytest.mark.limits
@pytest.mark.parametrize("char", ["a", "\u00e9", "\u4e00"], ids=["ascii", "2-byte", "3-byte"])
def test_longest_path_works_and_one_byte_more_is_refused(
    zk: Any, base: str, char: str, watched: tuple[ZooKeeperLock, list[str]]
) -> None:
    """A path whose contender znode is exactly 4,096 UTF-8 bytes acquires and releases on the server;
    one byte more is InvalidArgument naming the limit and saying to hash long names."""
    path = path_of(base, MAX_BYTES, char)
    lock = ZooKeeperLock(zk, path)
    with lock as fence:
        assert fence > 0
        (child,) = zk.get_children(path)
        assert len(f"{path}/{child}".encode()) == MAX_BYTES  # kazoo's suffix is what the limit assumes
    assert zk.get_children(path) == []
    with pytest.raises(InvalidArgument, match=r"(?s)4097 bytes in UTF-8.*4096.*sha256"):
        ZooKeeperLock(zk, path + "a")
    assert_untouched(zk, watched)


@pytest.mark.limits
@pytest.mark.parametrize("size", [1_048_576 - 48, 1_100_000, 10_000_000], ids=["over-jute", "1.1MB", "10MB"])
def test_megabyte_path_is_refused_before_anything_is_sent(
    zk: Any, base: str, size: int, watched: tuple[ZooKeeperLock, list[str]]
) -> None:
    """A path over ZooKeeper's request limit, with timeout=None, is InvalidArgument at once: no retry
    loop, no dropped connection, and another lock on the same client stays held."""
    path = path_of(base, size)
    started = time.monotonic()
    with pytest.raises(InvalidArgument, match="too long"):
        ZooKeeperLock(zk, path, timeout=None)
    assert time.monotonic() - started < 0.5
    time.sleep(0.3)  # a dropped connection would show as SUSPENDED by now
    assert_untouched(zk, watched)
    assert not zk.exists(base)  # not even the parent was created


@pytest.mark.hostile
@pytest.mark.parametrize(
    "char",
    ["\U0001f600", "\U00020000", "\U00010000", "\U0010ffff", "\ud800", "\udfff", "\ue000", "\uf8ff",
     "\ufff0", "\uffff", "\x00", "\x01", "\x1f", "\x7f", "\x9f"],
)  # fmt: skip
def test_characters_zookeeper_refuses(zk: Any, base: str, char: str, watched: Any) -> None:
    """A character ZooKeeper refuses (above U+FFFF: a surrogate pair in its UTF-16 check; lone
    surrogates; private use; specials; controls) is InvalidArgument, not kazoo's BadArgumentsError."""
    with pytest.raises(InvalidArgument, match="character"):
        ZooKeeperLock(zk, f"{base}/x{char}y")
    assert_untouched(zk, watched)


@pytest.mark.hostile
@pytest.mark.parametrize(
    "char", [" ", "~", "\xa0", "\u4e00", "\ud7ff", "\uf900", "\uffef", "\ufeff", "\u3000", "..."]
)
def test_characters_zookeeper_accepts(zk: Any, base: str, char: str) -> None:
    """The neighbours of the refused ranges (and '...' as a segment) are accepted by the check and by
    the server: the lock is taken and released."""
    path = f"{base}/x{char}y/{char}"
    with ZooKeeperLock(zk, path) as fence:
        assert fence > 0
    assert zk.get_children(path) == []


#: Names for the property test: any code point (surrogates included), with '/' and '.' often.
NAMES = st.text(
    st.one_of(
        st.characters(min_codepoint=0, max_codepoint=0x10FFFF, exclude_categories=()), st.sampled_from("/.")
    ),
    max_size=12,
) | st.builds(lambda c, n: c * n, st.sampled_from(["a", "\u00e9", "\u4e00"]), st.integers(1300, 4100))


@pytest.mark.hostile
@pytest.mark.limits
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=NAMES)
@example(name="\U0001f600")
@example(name="\U00020000")
@example(name="a" * 4045)
@example(name="a" * 4046)
@example(name="\u4e00" * 1349)
@example(name="")
@example(name=".")
@example(name="..")
@example(name="a/")
@example(name="a//b")
@example(name="\ud800")
@example(name="\x00")
def test_any_name_is_refused_up_front_or_works(
    clients: Callable[..., Any], name: str, watched_client: tuple[Any, ZooKeeperLock, list[str]]
) -> None:
    """Any name under a lock path either is InvalidArgument before any call to ZooKeeper, or the lock is
    acquired and released on the real server; never a kazoo error, never a dropped connection."""
    zk, sentinel, states = watched_client
    path = f"/sg-prop/{name}"
    try:
        lock = ZooKeeperLock(zk, path)
    except InvalidArgument:
        pass
    else:
        fence = lock.acquire(timeout=10)
        assert fence > 0 and lock.is_held()
        lock.release()
        assert not lock.is_held()
    assert_untouched(zk, (sentinel, states))


@pytest.fixture
def watched_client(clients: Callable[..., Any]) -> Iterator[tuple[Any, ZooKeeperLock, list[str]]]:
    """A client, a lock held on it for the whole property test, and the client's connection states."""
    zk = clients()
    states: list[str] = []
    zk.add_listener(states.append)
    sentinel = ZooKeeperLock(zk, f"/sg-tests/{uuid.uuid4().hex[:12]}-sentinel")
    sentinel.acquire(timeout=10)
    yield zk, sentinel, states
    sentinel.release()
