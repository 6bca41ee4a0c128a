"""A mypy plugin: a misspelt trigger name is a type error, not only ``UnknownTrigger`` at run time.

Enable it in the mypy configuration of the project that uses stateguard::

    [tool.mypy]                     # pyproject.toml; or [mypy] plugins = stateguard.mypy
    plugins = ["stateguard.mypy"]

Then, for a machine declared in a class body with a literal ``transitions=``::

    Order.flow.pay(session, 42)          # fine: a Trigger
    Order.flow.pya(session, 42)          # error: "Order.flow" has no trigger "pya"
                                         # (declared: "cancel", "pay"); did you mean "pay"?  [attr-defined]

While mypy analyses a class body, the plugin reads the ``transitions=``
argument of each ``StateMachine(...)`` assignment and records the trigger
names in the class's mypy metadata (so they survive the incremental cache);
an attribute of a machine reached as ``<class or instance>.<attribute>`` that
is not a member of :class:`~stateguard.StateMachine` is checked against them,
as are literal names given to ``trigger``, ``fire``, ``can`` and
``target_of``.  It only reads the source, never imports the models; what it
cannot know (triggers built at run time, a machine reached through a
variable) it leaves alone.  See ``docs/how-to/mypy.md``.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence

from mypy.checker import TypeChecker
from mypy.errorcodes import ATTR_DEFINED
from mypy.nodes import (
    ARG_NAMED,
    ARG_POS,
    ARG_STAR2,
    CallExpr,
    Context,
    DictExpr,
    Expression,
    ListExpr,
    MemberExpr,
    NameExpr,
    RefExpr,
    StrExpr,
    TupleExpr,
    TypeInfo,
)
from mypy.plugin import AttributeContext, DynamicClassDefContext, MethodContext, Plugin
from mypy.types import CallableType, Instance, ProperType, Type, TypeType, get_proper_type

__all__ = ["StateguardPlugin", "plugin"]

#: The full name of the declaration class, as mypy resolves it through re-exports.
STATE_MACHINE = "stateguard.machine.declaration.StateMachine"
#: The key of the plugin's entry in a class's mypy metadata.
METADATA_KEY = "stateguard"
#: Methods whose first argument is a trigger name.
_NAME_METHODS = frozenset({"trigger", "can", "target_of"})
#: What mypy calls for ``Order.flow.fire(session, "pay", 42)`` (``fire`` is a dual sync/async method).
_DUAL_CALL = "stateguard._async.Dual.__call__"


def plugin(version: str) -> type[Plugin]:
    """The entry point mypy calls (``plugins = ["stateguard.mypy"]``).

    ::

        # pyproject.toml
        [tool.mypy]
        plugins = ["stateguard.mypy"]
    """
    return StateguardPlugin


class StateguardPlugin(Plugin):
    """Records the trigger names of literal ``StateMachine`` declarations and checks trigger access.

    ::

        [tool.mypy]
        plugins = ["stateguard.mypy"]
    """

    def get_dynamic_class_hook(self, fullname: str) -> Callable[[DynamicClassDefContext], None] | None:
        if fullname == STATE_MACHINE or self._is_machine_class(fullname):
            return _record_triggers
        return None

    def get_attribute_hook(self, fullname: str) -> Callable[[AttributeContext], Type] | None:
        if fullname.startswith(STATE_MACHINE + "."):
            return _check_attribute
        return None

    def get_method_hook(self, fullname: str) -> Callable[[MethodContext], Type] | None:
        owner, _, method = fullname.rpartition(".")
        if owner == STATE_MACHINE and method in _NAME_METHODS:
            return _check_name_argument
        if fullname == _DUAL_CALL:
            return _check_fire
        return None

    def _is_machine_class(self, fullname: str) -> bool:
        """Whether ``fullname`` names a subclass of StateMachine (``class MyMachine(StateMachine[str])``)."""
        found = self.lookup_fully_qualified(fullname)
        node = found.node if found is not None else None
        return isinstance(node, TypeInfo) and node.has_base(STATE_MACHINE)


# -- semantic analysis: record the triggers ------------------------------------------------


def _record_triggers(ctx: DynamicClassDefContext) -> None:
    """``name = StateMachine(..., transitions=[...])`` in a class body: store the trigger names."""
    info = getattr(ctx.api, "type", None)
    if not isinstance(info, TypeInfo):
        return  # not in a class body: such a machine is never bound to a model
    machines = info.metadata.setdefault(METADATA_KEY, {}).setdefault("machines", {})
    # None records "declared here, but not literally": attribute access falls back to any name.
    machines[ctx.name] = _literal_triggers(ctx.call)


def _literal_triggers(call: CallExpr) -> list[str] | None:
    """The sorted trigger names of a literal ``transitions=`` argument, or None when not literal."""
    value: Expression | None = None
    for name, kind, arg in zip(call.arg_names, call.arg_kinds, call.args, strict=True):
        if kind == ARG_NAMED and name == "transitions":
            value = arg
        elif kind == ARG_STAR2:
            return None  # **kwargs may carry the transitions
    if not isinstance(value, ListExpr | TupleExpr):
        return None
    names: set[str] = set()
    for item in value.items:
        trigger = _trigger_of(item)
        if trigger is None:
            return None
        names.add(trigger)
    return sorted(names) if names else None


def _trigger_of(item: Expression) -> str | None:
    """The literal trigger name of one transition entry, or None."""
    if isinstance(item, DictExpr):
        for key, value in item.items:
            if isinstance(key, StrExpr) and key.value == "trigger":
                return value.value if isinstance(value, StrExpr) else None
        return None
    if isinstance(item, ListExpr | TupleExpr):
        first = item.items[0] if item.items else None
        return first.value if isinstance(first, StrExpr) else None
    callee = item.callee if isinstance(item, CallExpr) else None
    if isinstance(item, CallExpr) and isinstance(callee, RefExpr) and callee.fullname == "builtins.dict":
        for name, arg in zip(item.arg_names, item.args, strict=True):
            if name == "trigger":
                return arg.value if isinstance(arg, StrExpr) else None
    return None


# -- type checking: check the names --------------------------------------------------------


def _check_attribute(ctx: AttributeContext) -> Type:
    """``<owner>.<machine>.<name>``: an error when ``name`` is not a recorded trigger."""
    expr = ctx.context
    machine_type = ctx.type
    if not isinstance(expr, MemberExpr) or not isinstance(machine_type, Instance):
        return ctx.default_attr_type
    if machine_type.type.get(expr.name) is not None:
        return ctx.default_attr_type  # a real member of the machine (states, fire, ...), not a trigger
    # Reported once; the attribute keeps its Trigger type, so nothing else fails on the same line.
    _unknown(ctx.api, expr.expr, expr.name, expr)
    return ctx.default_attr_type


def _check_name_argument(ctx: MethodContext) -> Type:
    """``Order.flow.trigger("pya")`` (and ``can``/``target_of``) with a literal name."""
    call = ctx.context
    if not isinstance(call, CallExpr) or not isinstance(call.callee, MemberExpr):
        return ctx.default_return_type
    first = ctx.args[0] if ctx.args else []
    if len(first) == 1 and isinstance(first[0], StrExpr):
        _unknown(ctx.api, call.callee.expr, first[0].value, first[0])
    return ctx.default_return_type


def _check_fire(ctx: MethodContext) -> Type:
    """``Order.flow.fire(session, "pya", 42)``: a literal name, second positional or ``trigger=``."""
    call = ctx.context
    callee = call.callee if isinstance(call, CallExpr) else None
    if not isinstance(call, CallExpr) or not isinstance(callee, MemberExpr) or callee.name != "fire":
        return ctx.default_return_type
    named = [a for a, n in zip(call.args, call.arg_names, strict=True) if n == "trigger"]
    positional = [a for a, k in zip(call.args, call.arg_kinds, strict=True) if k == ARG_POS]
    name = named[0] if named else (positional[1] if len(positional) > 1 else None)
    if isinstance(name, StrExpr):
        _unknown(ctx.api, callee.expr, name.value, name)
    return ctx.default_return_type


def _unknown(api: object, machine_expr: Expression, name: str, where: Context) -> bool:
    """Report ``name`` when ``machine_expr`` is a machine with literally declared triggers lacking it."""
    if not isinstance(machine_expr, MemberExpr) or not isinstance(api, TypeChecker):
        return False
    owner = _owner_info(api, machine_expr.expr)
    if owner is None:
        return False
    triggers = _declared_triggers(owner, machine_expr.name)
    if triggers is None or name in triggers:
        return False
    declared = ", ".join(f'"{t}"' for t in triggers)
    message = f'"{owner.name}.{machine_expr.name}" has no trigger "{name}" (declared: {declared})'
    close = difflib.get_close_matches(name, triggers, n=1)
    if close:
        message += f'; did you mean "{close[0]}"?'
    api.fail(message, where, code=ATTR_DEFINED)
    return True


def _owner_info(api: TypeChecker, expr: Expression) -> TypeInfo | None:
    """The class whose attribute the machine is: ``Order`` in ``Order.flow`` or ``order.flow``."""
    if isinstance(expr, NameExpr) and isinstance(expr.node, TypeInfo):
        return expr.node
    found = api.lookup_type_or_none(expr)
    typ: ProperType | None = get_proper_type(found) if found is not None else None
    if isinstance(typ, TypeType):
        typ = typ.item
    if isinstance(typ, CallableType) and typ.is_type_obj():
        return typ.type_object()
    if isinstance(typ, Instance):
        return typ.type
    return None


def _declared_triggers(owner: TypeInfo, attribute: str) -> Sequence[str] | None:
    """The recorded triggers of ``owner.attribute``, from the class in the MRO that defines it."""
    for info in owner.mro:
        if attribute not in info.names:
            continue
        machines = info.metadata.get(METADATA_KEY, {}).get("machines", {})
        found = machines.get(attribute)
        return list(found) if isinstance(found, list) else None
    return None
