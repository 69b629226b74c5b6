"""Request-body checks shared by the routes: the error a client gets, and typed field readers
that name the field in their one-line message."""
from __future__ import annotations

import math


class ApiError(Exception):
    """An error that reaches the client as an OpenAI error body with an HTTP status."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None) -> ApiError:
    return ApiError(400, message, param=param)


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def is_num(v) -> bool:
    return (is_int(v) or isinstance(v, float)) and math.isfinite(v)


def int_field(body, name, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return None
    if not is_int(v):
        raise bad(f"'{name}' must be an integer, got {v!r}", name)
    if lo is not None and v < lo:
        raise bad(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def num_field(body, name):
    v = body.get(name)
    if v is None:
        return None
    if not is_num(v):
        raise bad(f"'{name}' must be a number, got {v!r}", name)
    return float(v)


def bool_field(body, name, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {v!r}", name)
    return v


def neutral(body, name, ok) -> None:
    """Fields of the OpenAI API this server does not implement: accepted only at a neutral value."""
    if name in body and not ok(body[name]):
        raise bad(f"'{name}' = {body[name]!r} is not supported by this server", name)




def check_fields(body: dict, allowed: set[str], where: str = "") -> None:
    """A field this server does not know is refused by name: a typo such as `max_token` would
    otherwise be silently ignored."""
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise bad(f"unknown field '{where}{unknown[0]}' (this server refuses fields it does not implement)",
                  unknown[0])
