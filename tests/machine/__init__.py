"""Tests of the state machine wing, mirroring ``stateguard/machine/``."""
