"""stateguard's benchmarks: ``python -m bench run [--db URL ...] [--quick]``."""
