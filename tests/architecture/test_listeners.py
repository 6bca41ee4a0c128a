"""stateguard costs nothing to code that does not use it: no class-level listeners.

No listener is registered on a class every engine, connection or session of a
process shares (``event.listen(Engine, ...)``, ``@event.listens_for(Session, ...)``);
stateguard registers its hooks per engine, dialect or session, on first use.
"""

from __future__ import annotations

import ast

from tests.architecture._source import module_name, parse, source_files

#: Classes every engine, connection or session of a process shares: no listener may go on them (a
#: mapper-configuration listener runs when a class is mapped, never in a transaction, and may).
SHARED_CLASSES = {"Engine", "Connection", "Session", "sessionmaker", "Pool", "Dialect"}


def shared_class_listeners(tree: ast.AST) -> list[int]:
    """Lines of ``event.listen(C, ...)`` / ``@event.listens_for(C, ...)`` with ``C`` a shared class."""
    found: list[int] = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name not in ("listen", "listens_for"):
            continue
        target = node.args[0]
        target_name = (
            target.attr
            if isinstance(target, ast.Attribute)
            else target.id
            if isinstance(target, ast.Name)
            else ""
        )
        if target_name in SHARED_CLASSES:
            found.append(node.lineno)
    return found


def test_no_listener_on_a_class_every_engine_or_session_shares() -> None:
    """stateguard registers its listeners per engine, dialect or session, never on their classes."""
    offenders = {module_name(p): lines for p in source_files() if (lines := shared_class_listeners(parse(p)))}
    assert offenders == {}


# -- the check above must be able to fail --------------------------------------------------


def test_the_listener_finder_finds_class_listeners() -> None:
    """A listener on Engine or Session (by name or attribute) counts; one on an engine object does not."""
    source = (
        "event.listen(Engine, 'begin', f)\n"
        "@event.listens_for(orm.Session, 'after_commit')\ndef g(s): pass\n"
        "event.listen(engine, 'begin', f)\n"
        "event.listen(session, 'after_commit', f)\n"
    )
    assert shared_class_listeners(ast.parse(source)) == [1, 2]
