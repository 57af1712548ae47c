"""Errors of the training stack (a leaf module: every other training module may import it)."""


class ConfigError(ValueError):
    """An invalid training config; the message names the offending field."""
