"""Guarantees on database clusters the tests start themselves (Galera, replicated PostgreSQL)."""
