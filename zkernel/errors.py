"""Errors zkernel raises that are not tied to one package (the facade re-exports them).

This module imports nothing of zkernel, so every layer may raise them.
"""


class ConfigError(ValueError):
    """A configuration value is wrong; the message names the key and what is valid."""
