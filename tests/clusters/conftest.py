"""Clusters that more than one module of tests/clusters uses: started once for the package, on first
use, and stopped by pid after its last test (each module still makes its own fresh tables)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .._support import galera, pg_cluster
from ._started import started


@pytest.fixture(scope="package")
def galera_cluster() -> Iterator[galera.GaleraCluster]:
    """One 3-node Galera cluster for test_galera.py and test_galera_sessions.py (one start, about
    10-20 s, instead of one per module), stopped by pid afterwards."""
    yield from started("a Galera cluster", galera.available, lambda: galera.GaleraCluster(3))


@pytest.fixture(scope="package")
def pg_pair() -> Iterator[pg_cluster.PgReplicaPair]:
    """One PostgreSQL primary with its standby for test_postgresql_durable_sessions.py and
    test_postgresql_replication.py (each module's ``pair`` fixture makes it whole, sets it
    synchronous or not and makes fresh tables for every test), stopped by pid afterwards."""
    yield from started("a PostgreSQL primary with a standby", pg_cluster.available, pg_cluster.PgReplicaPair)
