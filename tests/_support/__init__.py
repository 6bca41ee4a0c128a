"""Test support: private servers and clusters the tests start and stop by pid, fault proxies, workers."""
