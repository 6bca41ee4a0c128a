"""The README's code that tests run must be the code the README shows."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_async_fastapi_quickstart_is_the_tested_app() -> None:
    """The README's async FastAPI example is tests/_async_fastapi_app.py verbatim (after its docstring)."""
    readme = (ROOT / "README.md").read_text()
    app = (ROOT / "tests" / "_async_fastapi_app.py").read_text().splitlines()
    assert app[0].startswith('"""') and app[0].endswith('"""')
    code = "\n".join(app[1:]).strip("\n") + "\n"
    assert f"```python\n{code}```" in readme


def test_quickstart_has_exactly_the_two_commands_ci_runs() -> None:
    """The quickstart has two commands: install and run the demo; install the test extra and run pytest."""
    readme = (ROOT / "README.md").read_text()
    quick = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in quick.splitlines() if line.startswith("python3 -m venv")]
    assert commands == [
        'python3 -m venv .venv && .venv/bin/pip install -q ".[demo]" && .venv/bin/stateguard demo',
        'python3 -m venv .venv && .venv/bin/pip install -q -e ".[test]" && .venv/bin/python -m pytest',
    ]
    assert commands[1] in (ROOT / ".ci" / "run").read_text()
