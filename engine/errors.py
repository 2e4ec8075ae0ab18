"""Errors the user can act on. The CLI prints their message on one line and exits with code 2."""


class S2MoEError(Exception):
    """Base for every error whose message is meant for the user."""


class ModelError(S2MoEError):
    """The model file is missing, not a GGUF, damaged, or unsuitable for the request."""


class ConfigError(S2MoEError):
    """Invalid option values or combinations."""


class ContextError(S2MoEError):
    """The prompt does not fit the context window."""
