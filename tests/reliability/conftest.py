"""Fixtures of the reliability suite: sizes (CI or soak)."""

from __future__ import annotations

import pytest

from tests.reliability._storm import Sizes, soak_factor


@pytest.fixture
def sizes(request: pytest.FixtureRequest) -> Sizes:
    """CI sizes, multiplied under ``--soak`` or ``STATEGUARD_SOAK``."""
    return Sizes(soak_factor(bool(request.config.getoption("--soak"))))
