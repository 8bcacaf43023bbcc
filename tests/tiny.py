"""Shared by the end-to-end tests: the default config with overrides, locked like train.py locks it."""

from configs import default as default_config


def config_with(overrides: dict):
    """configs/default.py with ``{"section.field": value}`` overrides applied, then locked."""
    config = default_config.get_config()
    for key, value in overrides.items():
        node = config
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    config.lock()
    return config
