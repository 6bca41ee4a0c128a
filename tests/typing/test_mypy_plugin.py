"""The stateguard.mypy plugin: a misspelt trigger is a mypy error; everything else type-checks as before.

Each test writes small modules to a temporary directory and runs mypy on them with its cache
there: in-process (``mypy.api.run``), and the run without the plugin in a process of its own,
started as the module begins so that the two cold runs share the machine's cores.  A line the plugin must
report ends with ``# E: <part of the message>``; every other line must pass.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mypy import api

ROOT = Path(__file__).resolve().parents[2]

MODELS = '''
from __future__ import annotations

from sqlalchemy import String
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from stateguard import StateMachine

TRANSITIONS = [{"trigger": "go", "source": "a", "dest": "b"}]


class Base(DeclarativeBase):
    pass


class Order(Base):
    __tablename__ = "orders"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="pending")

    flow: StateMachine[str] = StateMachine(
        "status",
        states=["pending", "paid", "shipped", "cancelled"],
        transitions=[
            {"trigger": "pay", "source": "pending", "dest": "paid", "where": lambda cls: cls.id > 0},
            dict(trigger="ship", source="paid", dest="shipped"),
            ["cancel", ["pending", "paid"], "cancelled"],
        ],
    )


class FlowMixin:
    status: Mapped[str] = mapped_column(String(20), default="a")
    flow = StateMachine("status", states=["a", "b"], transitions=(("go", "a", "b"),))


class Ticket(FlowMixin, Base):
    __tablename__ = "tickets"
    id: Mapped[int] = mapped_column(primary_key=True)


class Loose(Base):
    """Transitions the plugin cannot read: any trigger name is allowed, as without it."""

    __tablename__ = "loose"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="a")
    state: Mapped[str] = mapped_column(String(20), default="a")
    phase: Mapped[str] = mapped_column(String(20), default="a")
    flow = StateMachine("status", states=["a", "b"], transitions=TRANSITIONS)
    other = StateMachine(
        "state", states=["a", "b"], transitions=[{"trigger": t, "source": "a", "dest": "b"} for t in "xy"]
    )
    third = StateMachine("phase", states=["a", "b"], transitions=[*TRANSITIONS, ["back", "b", "a"]])


class MyMachine(StateMachine[str]):
    """A StateMachine subclass: its literal transitions are read too."""


class Job(Base):
    __tablename__ = "jobs"
    id: Mapped[int] = mapped_column(primary_key=True)
    status: Mapped[str] = mapped_column(String(20), default="queued")
    run = MyMachine("status", states=["queued", "done"], transitions=[["finish", "queued", "done"]])


class Relabelled(Order):
    """A subclass redeclaring the machine without literal transitions falls back for that machine."""

    flow = StateMachine("status", states=["pending", "paid"], transitions=TRANSITIONS)
'''

USES = """
from __future__ import annotations

from sqlalchemy.orm import Session

from models import Job, Loose, Order, Relabelled, Ticket
from stateguard import Result, StateMachine, Trigger


class Service:
    order: Order

    def pay(self, session: Session) -> Result:
        return self.order.flow.pay(session, 1)

    def typo(self, session: Session) -> Result:
        return self.order.flow.pya(session, 1)  # E: "Order.flow" has no trigger "pya"


def known(session: Session, order: Order, ticket: Ticket) -> None:
    paid: Result = Order.flow.pay(session, 1)
    Order.flow.ship.many(session, [1, 2])
    Order.flow.cancel.where(session, Order.id > 3)
    order.flow.cancel(session, order)
    trigger: Trigger = Order.flow.trigger("pay")
    names: list[str] = Order.flow.available(order)
    Order.flow.fire(session, "ship", 1)
    Order.flow.fire(session, trigger="cancel", target=order)
    print(paid, trigger, names, Order.flow.states, Order.flow.can("ship", "paid"))
    Ticket.flow.go(session, 1)
    ticket.flow.go(session, ticket)
    Job.run.finish(session, 1)


def typos(session: Session, order: Order, ticket: Ticket, cls: type[Order]) -> None:
    Order.flow.pya(session, 1)  # E: no trigger "pya" (declared: "cancel", "pay", "ship"); did you mean "pay"?
    Order.flow.shipp.many(session, [1])  # E: has no trigger "shipp"
    order.flow.refund(session, order)  # E: "Order.flow" has no trigger "refund" (declared: "cancel",
    cls.flow.cancle(session, 1)  # E: did you mean "cancel"?
    Order.flow.trigger("pya")  # E: has no trigger "pya"
    Order.flow.can("shipp", "paid")  # E: has no trigger "shipp"
    Order.flow.target_of("refund", "paid")  # E: has no trigger "refund"
    Order.flow.fire(session, "pya", 1)  # E: has no trigger "pya"
    order.flow.fire(session, trigger="shipp", target=order)  # E: has no trigger "shipp"
    Ticket.flow.og(session, 1)  # E: "Ticket.flow" has no trigger "og" (declared: "go")
    ticket.flow.pay(session, ticket)  # E: "Ticket.flow" has no trigger "pay"
    Job.run.finnish(session, 1)  # E: "Job.run" has no trigger "finnish" (declared: "finish")
    Relabelled.flow.ship(session, 1)  # inherited machine shadowed by a non-literal one: not checked


def fallbacks(session: Session, machine: StateMachine[str], name: str) -> None:
    Loose.flow.anything(session, 1)
    Loose.other.x(session, 1)
    Loose.third.whatever(session, 1)
    Relabelled.flow.anything(session, 1)
    alias = Order.flow
    alias.pya(session, 1)  # reached through a variable: not checked
    machine.pya(session, 1)
    Order.flow.trigger(name)
    Order.flow.fire(session, name, 1)
    print(getattr(Order.flow, "pya"))
"""


def mypy_args(tmp_path: Path, files: dict[str, str], *, plugin: bool, cache: str, verbose: bool) -> list[str]:
    """Write ``files`` and a config to ``tmp_path``; the arguments of mypy --strict on the two snippets."""
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    config = tmp_path / f"{cache}.ini"
    config.write_text(
        "[mypy]\n"
        "strict = True\n"
        "python_version = 3.11\n"
        f"mypy_path = {ROOT}\n"
        + ("plugins = stateguard.mypy\n" if plugin else "")
        # Check the snippets, not stateguard's own modules (CI checks those separately).
        + "[mypy-stateguard.*]\nfollow_imports = silent\n"
        + "[mypy-transitions.*,kazoo.*,graphviz.*]\nignore_missing_imports = True\n"
    )
    return [
        "--config-file",
        str(config),
        "--cache-dir",
        str(tmp_path / cache),
        "--no-error-summary",
        "--show-error-codes",
        *(["--verbose"] if verbose else []),
        str(tmp_path / "models.py"),
        str(tmp_path / "uses.py"),
    ]


def error_lines(stdout: str, stderr: str, status: int, log: list[str] | None = None) -> list[str]:
    """The error lines of a mypy run that did not crash; with ``log``, its (verbose) stderr goes there."""
    assert status in (0, 1), f"mypy crashed ({status}):\n{stdout}\n{stderr}"
    if log is None:
        assert stderr == "", stderr
    else:
        log += stderr.splitlines()
    return [line for line in stdout.splitlines() if ": error:" in line]


def run_mypy(
    tmp_path: Path, files: dict[str, str], *, plugin: bool, cache: str, log: list[str] | None = None
) -> list[str]:
    """mypy --strict on models.py and uses.py after writing ``files``; the error lines it printed.

    With ``log``, mypy runs verbosely and its log lines are appended to it.
    """
    args = mypy_args(tmp_path, files, plugin=plugin, cache=cache, verbose=log is not None)
    stdout, stderr, status = api.run(args)
    return error_lines(stdout, stderr, status, log)


@pytest.fixture(scope="module", autouse=True)
def unplugged(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], list[str]]]:
    """The run without the plugin, started in a process of its own as the module begins: a cold
    mypy run each (no cache can be shared: the plugin setting invalidates all of it), so it goes on
    the second core while the plugin runs go in-process.  Yields a call that waits for its errors."""
    tmp_path = tmp_path_factory.mktemp("unplugged")
    args = mypy_args(
        tmp_path, {"models.py": MODELS, "uses.py": USES}, plugin=False, cache="plain", verbose=False
    )
    process = subprocess.Popen(
        [sys.executable, "-m", "mypy", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )

    def errors() -> list[str]:
        stdout, stderr = process.communicate(timeout=600)
        return error_lines(stdout, stderr, process.returncode)

    try:
        yield errors
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def expected_errors(tmp_path: Path, name: str, text: str) -> dict[str, str]:
    """``{"file:line": message fragment}`` for the ``# E:`` lines of one snippet."""
    found = {}
    for number, line in enumerate(textwrap.dedent(text).splitlines(), start=1):
        match = re.search(r"# E: (.*)$", line)
        if match:
            found[f"{tmp_path / name}:{number}"] = match.group(1)
    return found


def by_location(errors: list[str]) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in errors:
        location, _, message = line.partition(": error: ")
        assert location not in found, f"two errors on one line: {found[location]!r} and {message!r}"
        found[location] = message
    return found


def test_misspelt_triggers_are_errors_and_everything_else_passes(tmp_path: Path) -> None:
    """With the plugin: exactly the marked lines fail, each naming the trigger and the declared ones.

    A second run reuses mypy's cache for models.py (the recorded triggers come back
    from the cache) while a changed uses.py gains one more typo.
    """
    files = {"models.py": MODELS, "uses.py": USES}
    errors = by_location(run_mypy(tmp_path, files, plugin=True, cache="cache"))
    expected = expected_errors(tmp_path, "uses.py", USES)
    assert len(expected) == 13
    assert sorted(errors) == sorted(expected), "\n".join(errors.values())
    for location, fragment in expected.items():
        assert fragment in errors[location], (fragment, errors[location])
        assert errors[location].endswith("[attr-defined]")

    refund = '"Order.flow" has no trigger "refund" (declared: "cancel", "pay", "ship")  [attr-defined]'
    assert [errors[loc] for loc, fragment in expected.items() if fragment.startswith(refund[:36])] == [refund]

    more = USES + "\ndef later(session: Session) -> None:\n    Order.flow.shp(session, 1)  # E: no trigger\n"
    log: list[str] = []
    again = by_location(run_mypy(tmp_path, {"uses.py": more}, plugin=True, cache="cache", log=log))
    assert any("Metadata fresh for models: file" in line for line in log), log[-20:]
    assert sorted(again) == sorted(expected_errors(tmp_path, "uses.py", more))


def test_without_the_plugin_any_name_is_a_trigger(unplugged: Callable[[], list[str]]) -> None:
    """Not configured, mypy types every unknown attribute as a Trigger: the typos pass (the old behaviour)."""
    assert unplugged() == []
