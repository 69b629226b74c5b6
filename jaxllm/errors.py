"""Errors that reach the user as one line: the CLI and server print `str(err)` and exit/return 4xx."""


class JaxllmError(Exception):
    """Base class: anything the user can fix (bad flag, bad model, bad request)."""


class ModelError(JaxllmError):
    """A model directory/file that is missing, malformed, unsupported or inconsistent."""


class RequestError(JaxllmError):
    """A generation request that cannot be served as asked (too long, bad sampling values)."""
