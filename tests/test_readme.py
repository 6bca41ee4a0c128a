"""The README's code runs as written: every ```python block is a test case (issue 15, item 15).

A block runs in a fresh namespace, in a temporary folder (its SQLite files land there), unless an
HTML comment directly above it says otherwise::

    <!-- readme-test: name "model" -->            later blocks can continue this one
    <!-- readme-test: continues "model" -->       run after "model" (and what it continues), in its namespace
    <!-- readme-test: needs postgresql, redis --> DATABASE_URL / REDIS_URL point at the test servers
    <!-- readme-test: needs zookeeper -->          ZOOKEEPER_HOSTS: a private ZooKeeper started for the block
    <!-- readme-test: module myapp.models -->     ``import myapp.models`` gets the tests' models
    <!-- readme-test: skip (why) -->              cannot run here (say why)

Directives combine with ``;``.  A block with top-level ``await`` runs through ``asyncio.run``.
``DATABASE_URL`` is a private PostgreSQL schema or MariaDB database for a block that needs one and
is unset otherwise (blocks then default to a SQLite file).  The README's async FastAPI example is
also tests/_async_fastapi_app.py verbatim, and its app is started and asked once.
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

from ._support import models
from .conftest import MYSQL_URL, PG_URL, REDIS_URL, unavailable

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"

_FENCE = re.compile(r"^```python\s*$")
_DIRECTIVE = re.compile(r"^<!--\s*readme-test:\s*(?P<body>.*?)\s*-->\s*$")
_SERVERS = ("postgresql", "mariadb", "redis", "zookeeper")


@dataclass
class Block:
    """One ```python block of the README and what the comment above it says."""

    index: int
    line: int
    code: str
    name: str | None = None
    continues: str | None = None
    needs: set[str] = field(default_factory=set)
    skip: str | None = None
    modules: set[str] = field(default_factory=set)

    @property
    def id(self) -> str:
        first = next((ln.strip() for ln in self.code.splitlines() if ln.strip()), "")
        return f"{self.index:02d}-L{self.line}-{re.sub(r'[^A-Za-z0-9]+', '_', first)[:40].strip('_')}"


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
                raise ValueError(f"README.md:{block.line}: unknown server(s) {sorted(unknown)}")
            block.needs |= needs
        elif word == "module" and re.fullmatch(r"[\w.]+", rest):
            block.modules.add(rest)
        elif word == "skip" and re.fullmatch(r"\(.+\)", rest):
            block.skip = rest[1:-1]
        else:
            raise ValueError(f"README.md:{block.line}: unknown readme-test directive {part!r}")


def readme_blocks(source: str | None = None) -> list[Block]:
    """Every ```python block of the README, with its directives."""
    lines = (README.read_text() if source is None else source).splitlines()
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
        block = Block(len(blocks) + 1, start + 1, "\n".join(lines[start:end]) + "\n")
        directive = _DIRECTIVE.match(lines[i - 1]) if i else None
        if directive:
            _parse_directives(block, directive["body"])
        blocks.append(block)
        i = end + 1
    return blocks


BLOCKS = readme_blocks()


def _chain(block: Block) -> list[Block]:
    """The blocks to run for ``block``: what it continues (recursively), then itself."""
    named = {b.name: b for b in BLOCKS if b.name}
    chain = [block]
    while chain[0].continues is not None:
        parent = named.get(chain[0].continues)
        if parent is None or parent.index >= chain[0].index:
            raise AssertionError(
                f"README.md:{chain[0].line} continues {chain[0].continues!r}: no such block above"
            )
        chain.insert(0, parent)
    return chain


# --------------------------------------------------------------------------
# Servers: a private namespace per test case
# --------------------------------------------------------------------------


@contextlib.contextmanager
def _private_database(server: str) -> Iterator[str]:
    """A sync URL of a fresh PostgreSQL schema or MariaDB database, dropped afterwards."""
    tag = f"sgreadme_{uuid.uuid4().hex[:10]}"
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


# --------------------------------------------------------------------------
# Running a block
# --------------------------------------------------------------------------


def _run(block: Block, ns: dict[str, Any]) -> None:
    filename = f"README.md:{block.line}"
    try:
        code = compile(block.code, filename, "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    except SyntaxError as error:
        raise AssertionError(f"{filename}: not valid Python: {error}") from error
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
def test_readme_block_runs_as_written(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The block (after the blocks it continues) runs without an error, on the servers it says it needs."""
    if block.skip is not None:
        pytest.skip(f"README.md:{block.line}: {block.skip}")
    chain = _chain(block)
    needs = set().union(*(b.needs for b in chain))
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("DATABASE_URL", raising=False)
    for name in set().union(*(b.modules for b in chain)):
        # The reader's own models module (``from myapp.models import Base``): the tests' models.
        parent, _, _ = name.rpartition(".")
        if parent:
            monkeypatch.setitem(sys.modules, parent, types.ModuleType(parent))
        monkeypatch.setitem(sys.modules, name, models)
    if "redis" in needs:
        _check_redis()
        monkeypatch.setenv("REDIS_URL", REDIS_URL)
    with contextlib.ExitStack() as stack:
        for server in ("postgresql", "mariadb"):
            if server in needs:
                monkeypatch.setenv("DATABASE_URL", stack.enter_context(_private_database(server)))
        if "zookeeper" in needs:
            from ._support.zookeeper_server import ZooKeeperServer

            monkeypatch.setenv("ZOOKEEPER_HOSTS", stack.enter_context(ZooKeeperServer()).hosts)
        ns: dict[str, Any] = {"__name__": f"readme_{block.index}"}
        try:
            for b in chain:
                _run(b, ns)
            smoke = _SMOKE.get(block.name or "")
            if smoke is not None:
                smoke(ns)
        finally:
            _dispose(ns)


def test_directives_are_well_formed() -> None:
    """Every readme-test comment sits directly above a python block, and every chain resolves."""
    lines = README.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if line.startswith("<!--") and "readme-test:" in line:
            assert _DIRECTIVE.match(line), f"README.md:{number}: malformed readme-test comment"
            assert number < len(lines) and _FENCE.match(lines[number]), (
                f"README.md:{number}: a readme-test comment must be directly above a ```python block"
            )
    names = [b.name for b in BLOCKS if b.name]
    assert len(names) == len(set(names)), f"duplicate readme-test names: {names}"
    for b in BLOCKS:
        _chain(b)
    assert len([b for b in BLOCKS if b.skip]) <= 2, "keep skips minimal"


def test_the_harness_reads_directives() -> None:
    """The parser finds blocks, names, continuations, needs and skips, and refuses unknown directives."""
    source = (
        'text\n<!-- readme-test: name "a" -->\n```python\nx = 1\n```\n'
        '<!-- readme-test: continues "a"; needs postgresql, redis -->\n```python\ny = x\n```\n'
        "<!-- readme-test: skip (a kafka sink) -->\n```python\nz = 3\n```\n```bash\nls\n```\n"
    )
    a, b, c = readme_blocks(source)
    assert (a.name, a.code, a.line) == ("a", "x = 1\n", 4)
    assert (b.continues, b.needs) == ("a", {"postgresql", "redis"})
    assert c.skip == "a kafka sink"
    with pytest.raises(ValueError, match="unknown readme-test directive"):
        readme_blocks('<!-- readme-test: nmae "a" -->\n```python\nx = 1\n```\n')


# --------------------------------------------------------------------------
# The async FastAPI example
# --------------------------------------------------------------------------


def _serve_async_quickstart(ns: dict[str, Any]) -> None:
    """Start the example app (its lifespan creates the tables), seed an order, pay it twice."""
    import httpx

    app, Order, Stock, Session = ns["app"], ns["Order"], ns["Stock"], ns["Session"]

    async def main() -> None:
        async with app.router.lifespan_context(app):
            async with Session() as s, s.begin():
                s.add_all([Order(id=1, sku="widget"), Stock(sku="widget", amount=1)])
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://shop") as client:
                headers = {"Idempotency-Key": "k1"}
                first = await client.post("/orders/1/pay", headers=headers)
                again = await client.post("/orders/1/pay", headers=headers)
                missing = await client.post("/orders/2/pay", headers={"Idempotency-Key": "k2"})
        assert (first.status_code, first.json()) == (200, {"order": 1, "status": "paid", "left": 0})
        assert again.json() == first.json()
        assert missing.status_code == 404

    asyncio.run(main())


_SMOKE = {"async-quickstart": _serve_async_quickstart}


def test_async_fastapi_quickstart_is_the_tested_app() -> None:
    """The README's async FastAPI example is tests/_async_fastapi_app.py verbatim (after its docstring)."""
    readme = README.read_text()
    app = (ROOT / "tests" / "_async_fastapi_app.py").read_text().splitlines()
    assert app[0].startswith('"""') and app[0].endswith('"""')
    code = "\n".join(app[1:]).strip("\n") + "\n"
    assert f"```python\n{code}```" in readme


def test_quickstart_has_exactly_the_two_commands_ci_runs() -> None:
    """The quickstart has two commands: install and run the demo; install the test extra and run pytest."""
    readme = README.read_text()
    quick = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in quick.splitlines() if line.startswith("python3 -m venv")]
    assert commands == [
        'python3 -m venv .venv && .venv/bin/pip install -q ".[demo]" && .venv/bin/stateguard demo',
        'python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" && .venv/bin/python -m pytest',
    ]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
