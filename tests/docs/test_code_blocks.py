"""The documentation's code runs as written: every ```python block of README.md and of docs/**/*.md.

A block runs in a fresh namespace, in a temporary folder (its SQLite files land there), unless an
HTML comment directly above it says otherwise::

    <!-- docs-test: name "model" -->            later blocks of the page can continue this one
    <!-- docs-test: continues "model" -->       run after "model" (and what it continues), in its namespace
    <!-- docs-test: needs postgresql, redis --> DATABASE_URL / REDIS_URL point at the test servers
    <!-- docs-test: needs zookeeper -->          ZOOKEEPER_HOSTS: a private ZooKeeper started for the block
    <!-- docs-test: needs postgresql-standby --> DATABASE_URL: the primary of a private pair whose
                                                standby is synchronous, started for the block
    <!-- docs-test: needs rabbitmq, nats -->     RABBITMQ_URL / NATS_URL point at the test brokers
    <!-- docs-test: module myapp.models -->     ``import myapp.models`` gets the tests' models
    <!-- docs-test: skip (why) -->              cannot run here (say why)

Directives combine with ``;``; names and continuations are per page, and a page's blocks run in
the page's order.  A block with top-level ``await`` runs through ``asyncio.run``.  ``DATABASE_URL``
is a private PostgreSQL schema or MariaDB database for a block that needs one and is unset
otherwise (blocks then default to a SQLite file).  Code a page includes from ``examples/`` with
``{literalinclude}`` is run by test_examples.py instead.
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import re
import sys
import types
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Engine, create_engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session as OrmSession

from tests._support import models
from tests.conftest import MYSQL_URL, PG_URL, REDIS_URL, unavailable

ROOT = Path(__file__).resolve().parent.parent.parent
DOCS = ROOT / "docs"

_FENCE = re.compile(r"^```python\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*docs-test:\s*(?P<body>.*?)\s*-->\s*$")
# A python block spelled as a MyST directive would escape the harness: pages use ```python.
_UNTESTED_FENCE = re.compile(r"^\s*(```+|:::+)\s*\{(code-block|code|sourcecode)\}\s+(python|py|pycon)\b")
_SERVERS = ("postgresql", "mariadb", "redis", "zookeeper", "rabbitmq", "nats", "postgresql-standby")
#: Pages whose blocks cannot run here, however well written (none today).
MAX_SKIPS = 3


def pages() -> list[Path]:
    """README.md, then every Markdown page of the site (the build's output excepted), sorted."""
    found = sorted(p for p in DOCS.rglob("*.md") if "_build" not in p.relative_to(DOCS).parts)
    return [ROOT / "README.md", *found]


def _label(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


@dataclass
class Block:
    """One ```python block of a page and what the comment above it says."""

    page: str
    index: int
    line: int
    code: str
    name: str | None = None
    continues: str | None = None
    needs: set[str] = field(default_factory=set)
    skip: str | None = None
    modules: set[str] = field(default_factory=set)

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def id(self) -> str:
        first = next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")
        words = re.sub(r"[^A-Za-z0-9]+", "_", first)[:40].strip("_")
        return f"{self.page}-{self.index:02d}-L{self.line}-{words}"


def _parse_directives(block: Block, body: str) -> None:
    for part in filter(None, (p.strip() for p in body.split(";"))):
        word, _, rest = part.partition(" ")
        rest = rest.strip()
        if word in ("name", "continues") and re.fullmatch(r'"[^"]+"', rest):
            setattr(block, word, rest.strip('"'))
        elif word == "needs" and rest:
            needs = {n.strip() for n in rest.split(",")}
            unknown = needs - set(_SERVERS)
            if unknown:
                raise ValueError(f"{block.where}: unknown server(s) {sorted(unknown)}")
            block.needs |= needs
        elif word == "module" and re.fullmatch(r"[\w.]+", rest):
            block.modules.add(rest)
        elif word == "skip" and re.fullmatch(r"\(.+\)", rest):
            block.skip = rest[1:-1]
        else:
            raise ValueError(f"{block.where}: unknown docs-test directive {part!r}")


def page_blocks(source: str, page: str) -> list[Block]:
    """Every ```python block of one page's text, with its directives."""
    lines = source.splitlines()
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        if not _FENCE.match(lines[i]):
            i += 1
            continue
        start = i + 1
        end = start
        while end < len(lines) and lines[end].rstrip() != "```":
            end += 1
        block = Block(page, len(blocks) + 1, start + 1, "\n".join(lines[start:end]) + "\n")
        directive = _DIRECTIVE.match(lines[i - 1]) if i else None
        if directive:
            _parse_directives(block, directive["body"])
        blocks.append(block)
        i = end + 1
    return blocks


PAGES = {_label(p): page_blocks(p.read_text(encoding="utf-8"), _label(p)) for p in pages()}
BLOCKS = [block for blocks in PAGES.values() for block in blocks]


def _chain(block: Block) -> list[Block]:
    """The blocks to run for ``block``: what it continues on its page (recursively), then itself."""
    named = {b.name: b for b in PAGES[block.page] if b.name}
    chain = [block]
    while chain[0].continues is not None:
        parent = named.get(chain[0].continues)
        if parent is None or parent.index >= chain[0].index:
            raise AssertionError(
                f"{chain[0].where} continues {chain[0].continues!r}: no such block above on the page"
            )
        chain.insert(0, parent)
    return chain


# --------------------------------------------------------------------------
# Servers: a private namespace per test case
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _private_database(server: str) -> Iterator[str]:
    """A sync URL of a fresh PostgreSQL schema or MariaDB database, dropped afterwards."""
    tag = f"sgdocs_{uuid.uuid4().hex[:10]}"
    admin = create_engine(PG_URL if server == "postgresql" else MYSQL_URL, isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(
                text(f'CREATE SCHEMA "{tag}"' if server == "postgresql" else f"CREATE DATABASE `{tag}`")
            )
    except Exception as error:  # connection refused, auth ...
        admin.dispose()
        unavailable(server, error)
    try:
        if server == "postgresql":
            url = make_url(PG_URL).update_query_dict({"options": f"-csearch_path={tag}"})
        else:
            url = make_url(MYSQL_URL).set(database=tag)
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as conn:
            drop = (
                f'DROP SCHEMA IF EXISTS "{tag}" CASCADE'
                if server == "postgresql"
                else f"DROP DATABASE IF EXISTS `{tag}`"
            )
            conn.execute(text(drop))
        admin.dispose()


def _check_redis() -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    try:
        client.ping()
    except redis.ConnectionError as error:
        unavailable("redis", error)
    finally:
        client.close()


@contextlib.contextmanager
def servers_for(needs: set[str], monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Point DATABASE_URL / REDIS_URL / ZOOKEEPER_HOSTS at private test servers for ``needs``."""
    monkeypatch.delenv("DATABASE_URL", raising=False)
    if "rabbitmq" in needs or "nats" in needs:
        from tests._support import brokers as _brokers

        for server, url, check in (
            ("rabbitmq", _brokers.RABBITMQ_URL, _brokers.check_rabbitmq),
            ("nats", _brokers.NATS_URL, _brokers.check_nats),
        ):
            if server in needs:
                check()
                monkeypatch.setenv(f"{server.upper()}_URL", url)
    if "redis" in needs:
        _check_redis()
        monkeypatch.setenv("REDIS_URL", REDIS_URL)
    with contextlib.ExitStack() as stack:
        for server in ("postgresql", "mariadb"):
            if server in needs:
                monkeypatch.setenv("DATABASE_URL", stack.enter_context(_private_database(server)))
        if "postgresql-standby" in needs:
            from tests._support.pg_cluster import PgReplicaPair

            pair = stack.enter_context(PgReplicaPair())
            pair.set_synchronous(True)
            assert pair.primary is not None
            monkeypatch.setenv("DATABASE_URL", pair.primary.url)
        if "zookeeper" in needs:
            from tests._support.zookeeper_server import ZooKeeperServer

            monkeypatch.setenv("ZOOKEEPER_HOSTS", stack.enter_context(ZooKeeperServer()).hosts)
        yield


# --------------------------------------------------------------------------
# Running a block
# --------------------------------------------------------------------------


def _run(block: Block, ns: dict[str, Any]) -> None:
    try:
        code = compile(
            block.code, block.where, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True
        )
    except SyntaxError as error:
        raise AssertionError(f"{block.where}: not valid Python: {error}") from error
    if code.co_flags & inspect.CO_COROUTINE:
        asyncio.run(eval(code, ns))
    else:
        exec(code, ns)


def _dispose(ns: dict[str, Any]) -> None:
    """Close what the blocks left open: sessions first (they hold connections), then engines, clients."""
    values = list(ns.values())
    for value in values:
        if isinstance(value, OrmSession):
            value.close()
    for value in values:
        if isinstance(value, Engine):
            value.dispose()
        elif type(value).__module__.startswith("redis.") and hasattr(value, "close"):
            value.close()
        elif type(value).__module__.startswith("kazoo.") and hasattr(value, "stop"):
            value.stop()  # a KazooClient: its threads and session end here
            value.close()


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_block_runs_as_written(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block (after the blocks it continues) runs without an error, on the servers it says it needs."""
    if block.skip is not None:
        pytest.skip(f"{block.where}: {block.skip}")
    chain = _chain(block)
    monkeypatch.chdir(tmp_path)
    for name in set().union(*(b.modules for b in chain)):
        # The reader's own models module (``from myapp.models import Base``): the tests' models.
        parent, _, _ = name.rpartition(".")
        if parent:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
        monkeypatch.setitem(sys.modules, name, models)
    with servers_for(set().union(*(b.needs for b in chain)), monkeypatch):
        ns: dict[str, Any] = {"__name__": f"docs_{block.index}"}
        try:
            for b in chain:
                _run(b, ns)
        finally:
            _dispose(ns)


@pytest.mark.parametrize("page", list(PAGES), ids=list(PAGES))
def test_directives_are_well_formed(page: str) -> None:
    """Every docs-test comment sits directly above a python block, names are unique, chains resolve."""
    lines = (ROOT / page).read_text(encoding="utf-8").splitlines()
    fence = ""  # the backticks of the code block the line is in ("" outside one)
    for number, line in enumerate(lines, 1):
        ticks = re.match(r"^\s*(`{3,})", line)
        if ticks and not fence:
            fence = ticks[1]
            if not _FENCE.match(line):
                assert not _UNTESTED_FENCE.match(line), (
                    f"{page}:{number}: write a Python example as a ```python block (the tests run those) "
                    "or include it from examples/ with {literalinclude}"
                )
            continue
        if fence:
            if ticks and set(line.strip()) == {"`"} and len(line.strip()) >= len(fence):
                fence = ""
            continue
        if "docs-test:" in line and line.lstrip().startswith("<!--"):
            assert _DIRECTIVE.match(line), f"{page}:{number}: malformed docs-test comment"
            assert number < len(lines) and _FENCE.match(lines[number]), (
                f"{page}:{number}: a docs-test comment must be directly above a ```python block"
            )
    names = [b.name for b in PAGES[page] if b.name]
    assert len(names) == len(set(names)), f"{page}: duplicate docs-test names: {names}"
    for b in PAGES[page]:
        _chain(b)


def test_skips_are_few() -> None:
    """At most a handful of blocks across the docs say they cannot run, each with its reason."""
    skipped = [b.where for b in BLOCKS if b.skip]
    assert len(skipped) <= MAX_SKIPS, f"keep skips minimal: {skipped}"


def test_the_harness_finds_the_pages() -> None:
    """README.md and the site's pages are read (a broken glob would pass everything)."""
    assert "README.md" in PAGES
    assert "docs/index.md" in PAGES
    assert len(BLOCKS) >= 5


def test_the_harness_reads_directives() -> None:
    """The parser finds blocks, names, continuations, needs and skips, and refuses unknown directives."""
    source = (
        'text\n<!-- docs-test: name "a" -->\n```python\nx = 1\n```\n'
        '<!-- docs-test: continues "a"; needs postgresql, redis -->\n```python\ny = x\n```\n'
        "<!-- docs-test: skip (a kafka sink) -->\n```python\nz = 3\n```\n```bash\nls\n```\n"
    )
    a, b, c = page_blocks(source, "page.md")
    assert (a.name, a.code, a.line) == ("a", "x = 1\n", 4)
    assert (b.continues, b.needs) == ("a", {"postgresql", "redis"})
    assert c.skip == "a kafka sink"
    with pytest.raises(ValueError, match="unknown docs-test directive"):
        page_blocks('<!-- docs-test: nmae "a" -->\n```python\nx = 1\n```\n', "page.md")
    with pytest.raises(ValueError, match="unknown server"):
        page_blocks("<!-- docs-test: needs kafka -->\n```python\nx = 1\n```\n", "page.md")


def test_a_failing_block_fails() -> None:
    """A block that raises makes its test fail with the page and line in the traceback."""
    [block] = page_blocks("```python\nraise LookupError('boom')\n```\n", "page.md")
    with pytest.raises(LookupError) as caught:
        _run(block, {})
    assert any(entry.frame.code.raw.co_filename == "page.md:2" for entry in caught.traceback)


def test_quickstart_has_exactly_the_two_commands_ci_runs() -> None:
    """The README has two set-up commands: install and run the demo; install the test extra and run pytest."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = [line for line in readme.splitlines() if line.startswith("python3 -m venv")]
    assert commands == [
        'python3 -m venv .venv && .venv/bin/pip install -q ".[demo]" && .venv/bin/stateguard demo',
        'python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" && .venv/bin/python -m pytest',
    ]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
