"""The demo's scenarios, one module per scheme; importing this package registers them in order.

Each module registers one function with :func:`~stateguard.tooling.demo.storm.scenario`
(appended to :data:`~stateguard.tooling.demo.storm.SCENARIOS`): the order of the
imports below is the order of the rows in the result table.
"""

from __future__ import annotations

from . import state_machine as state_machine  # isort: skip
from . import optimistic_version as optimistic_version  # isort: skip
from . import insert_once as insert_once  # isort: skip
from . import flash_sale as flash_sale  # isort: skip
from . import http_retry_storm as http_retry_storm  # isort: skip
from . import outbox_pipeline as outbox_pipeline  # isort: skip

__all__ = [
    "flash_sale",
    "http_retry_storm",
    "insert_once",
    "optimistic_version",
    "outbox_pipeline",
    "state_machine",
]
