"""Errors that reach the user as one line: the CLI and server print `str(err)` and exit/return 4xx."""

import sys
import warnings
from contextlib import contextmanager


class JaxllmError(Exception):
    """Base class: anything the user can fix (bad flag, bad model, bad request)."""


class ModelError(JaxllmError):
    """A model directory/file that is missing, malformed, unsupported or inconsistent."""


class RequestError(JaxllmError):
    """A generation request that cannot be served as asked (too long, bad sampling values);
    `param`: the request field at fault, where one is (the server's 400 names it)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@contextmanager
def warnings_as_lines(stream=None):
    """Inside, each warning (a context past the model's trained length, ...) is written to `stream`
    (stderr) as one line, "warning: ...", when the block ends, not as Python's file:line report."""

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            yield
        finally:
            for w in caught:
                (stream or sys.stderr).write(f"warning: {w.message}\n")
