"""Sphinx configuration of stateguard's documentation site.

Build it with warnings as errors and every cross reference checked (this is what CI runs)::

    sphinx-build -W --keep-going -n -b html docs docs/_build/html

or serve it with live reload while writing: ``sphinx-autobuild docs docs/_build/html``.
Pages are MyST Markdown; the API reference is autodoc over the public import paths.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "docs" / "_ext"))

project = "stateguard"
author = "stateguard's maintainers"
copyright = "stateguard's maintainers"

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "sphinxarg.ext",
    "sphinx_copybutton",
    # A reference to any public path of an object (stateguard.outbox.Sink) links to the page that
    # documents it (stateguard.Sink): docs/_ext/public_names.py.
    "public_names",
]

source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]
# The Graphviz source of docs/order-flow.svg: an input of the picture, not a page.
exclude_patterns += ["order-flow.dot"]
# ``--db`` stays two hyphens (docutils would make it an en dash) and quotes stay straight.
smartquotes = False

# -- MyST ---------------------------------------------------------------------
myst_enable_extensions = ["colon_fence", "deflist", "fieldlist", "attrs_inline", "attrs_block"]
# ``## A heading`` gets an anchor, so ``[text](page.md#a-heading)`` links are checked.
myst_heading_anchors = 3

# -- autodoc --------------------------------------------------------------------
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True
autodoc_default_options = {"members": True, "show-inheritance": True}
# Type names in signatures read ``Session``, not ``sqlalchemy.orm.session.Session``.
python_use_unqualified_type_names = True
add_module_names = False

# -- nitpicky: every reference must resolve -------------------------------------
# CI has no internet, so there is no intersphinx: the names of other projects (SQLAlchemy,
# the standard library, redis-py, kazoo, starlette...) have no page to link to.  They are
# silenced here by their top-level package, so a reference to stateguard's own API that
# does not resolve is still an error.
nitpicky = True
_EXTERNAL = [
    "sqlalchemy",
    "alembic",
    "transitions",
    "redis",
    "kazoo",
    "pika",
    "aio_pika",
    "nats",
    "starlette",
    "fastapi",
    "opentelemetry",
    "celery",
    "graphviz",
    "mypy",
    "typing",
    "typing_extensions",
    "collections",
    "contextlib",
    "datetime",
    "decimal",
    "enum",
    "uuid",
    "json",
    "logging",
    "asyncio",
    "types",
    "threading",
    "concurrent",
    "argparse",
    "pathlib",
    "os",
    "re",
    "abc",
    "dataclasses",
    "functools",
    "inspect",
    "socket",
    "_thread",
    "builtins",
    "time",
    "secrets",
    "hashlib",
    "weakref",
    "httpx",
    "flask",
    "werkzeug",
    "anyio",
]
# Names other projects' types appear under in signatures when an annotation is a string that
# names a class imported for type checking only (``session: Session``): the same classes.
_EXTERNAL_UNQUALIFIED = [
    "Session", "AsyncSession", "Engine", "AsyncEngine", "Connection", "AsyncConnection",
    "sessionmaker", "async_sessionmaker", "scoped_session", "Mapped", "MetaData", "Table", "Column",
    "ColumnElement", "InstrumentedAttribute", "QueryableAttribute", "Select", "Executable", "TypeEngine",
    "Operations", "UUID", "Decimal", "datetime", "timedelta", "date", "Path", "Logger",
    "Redis", "AsyncRedis", "RedisCluster", "KazooClient", "Tracer", "Meter", "Span",
    "BlockingConnection", "Channel", "AbstractRobustConnection", "NATS", "JetStreamContext",
    "Request", "Response", "Starlette", "WSGIApplication", "StartResponse", "WSGIEnvironment",
    "Celery", "Task",
]
nitpick_ignore_regex = [
    (r"py:.*", rf"({'|'.join(_EXTERNAL)})(\..*)?"),
    # Builtins and typing names as annotations show them unqualified (``int``, ``Any``, ``Self``).
    (r"py:.*", r"(int|str|bytes|float|bool|dict|list|tuple|set|frozenset|object|type|None|"
     r"Exception|BaseException|TypeError|ValueError|KeyError|RuntimeError|TimeoutError|"
     r"Any|Self|Callable|Iterator|Iterable|Mapping|Sequence|Awaitable|Coroutine|AsyncIterator|"
     r"Generator|AsyncGenerator|Literal|TypeVar|ParamSpec|Concatenate|Never|NoReturn)"),
    (r"py:.*", rf"({'|'.join(_EXTERNAL_UNQUALIFIED)})"),
    # Type variables and ParamSpecs of stateguard's generics (``T``, ``P``, ``SessionT``...).
    (r"py:.*", r"(stateguard\.[\w.]*\.)?_?([A-Z]\w{0,2}|[A-Z]\w*T)"),
    # Private names (a module or class whose name starts with ``_``) have no page: a signature or a
    # base class may show one (``Bases: _RedisLock``), a reader cannot import it.
    (r"py:.*", r"(.+\.)?_[A-Za-z]\w*(\..+)?"),
    # IdempotentCall's constructor takes the internal claim object; users get the call from
    # idempotent() and never build one, so the claim class has no page.
    (r"py:class", r"(stateguard\.idempotency\.claim\.)?Claim"),
]

# ``stateguard graph`` prints Mermaid; the pages show it as text (no diagram JavaScript from a CDN).
def setup(app: object) -> None:
    from pygments.lexers.special import TextLexer
    from sphinx.highlighting import lexers

    lexers["mermaid"] = TextLexer()


# -- HTML -------------------------------------------------------------------------
html_theme = "furo"
html_title = "stateguard"
html_static_path = ["_static"]
# Copy the command, not the prompt or the output.
copybutton_prompt_text = r"\$ |>>> |\.\.\. "
copybutton_prompt_is_regexp = True
