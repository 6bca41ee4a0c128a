"""stateguard.consumers' public names are pinned, documented with an example, and importing the
package loads no broker client."""

from __future__ import annotations

import inspect
import subprocess
import sys

import stateguard.consumers

EXPECTED = [
    "Handler",
    "Message",
    "NATSConsumer",
    "RabbitMQConsumer",
    "RedisStreamConsumer",
    "enqueue",
    "exactly_once",
]


def test_all_is_pinned_and_sorted() -> None:
    """``stateguard.consumers.__all__`` is sorted and equals the pinned list."""
    assert stateguard.consumers.__all__ == EXPECTED


def test_every_public_call_has_a_docstring_with_an_example() -> None:
    """Every exported class and function, and each public method of the consumers, shows an example."""
    for name in EXPECTED:
        obj = getattr(stateguard.consumers, name)
        assert obj.__doc__, name
        if name in ("Handler",):
            continue
        assert "::" in obj.__doc__, f"{name} has no example"
    for cls in (
        stateguard.consumers.RedisStreamConsumer,
        stateguard.consumers.RabbitMQConsumer,
        stateguard.consumers.NATSConsumer,
    ):
        for method in ("run", "serve", "stop"):
            assert inspect.getdoc(getattr(cls, method)), f"{cls.__name__}.{method}"


def test_importing_the_package_loads_no_broker_client() -> None:
    """``import stateguard.consumers`` imports none of redis, pika, nats, celery (each module its own)."""
    code = (
        "import sys, stateguard.consumers\n"
        "print(sorted(m for m in ('redis', 'pika', 'nats', 'celery', 'kombu') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
