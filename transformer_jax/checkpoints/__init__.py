"""Checkpoints: the orbax manager, integrity checks, averaging and restoring parameters for scoring."""
