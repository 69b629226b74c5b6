"""Request-body checks shared by the routes: the error a client gets, and typed field readers
that name the field in their one-line message."""

from __future__ import annotations

import math
import re


class ApiError(Exception):
    """An error that reaches the client as an OpenAI error body with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
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


MAX_DEPTH = 64  # JSON levels a request body may nest: the schemas, tools and messages in it are walked recursively


def too_deep(v, limit: int = MAX_DEPTH) -> bool:
    """Whether the decoded JSON `v` nests more than `limit` levels (arrays and objects)."""
    stack = [(v, 1)]
    while stack:
        x, depth = stack.pop()
        if depth > limit:
            return True
        items = x.values() if isinstance(x, dict) else x if isinstance(x, list) else ()
        stack.extend((y, depth + 1) for y in items if isinstance(y, (dict, list)))
    return False


def short(v, limit: int = 60) -> str:
    """A value as a message quotes it: its repr, one line, cut at `limit` characters."""
    r = repr(v)
    return r if len(r) <= limit else r[:limit] + "..."


def int_field(body, name, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return None
    if not is_int(v):
        raise bad(f"'{name}' must be an integer, got {short(v)}", name)
    if lo is not None and v < lo:
        raise bad(f"'{name}' must be >= {lo}, got {short(v)}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {short(v)}", name)
    return v


def num_field(body, name):
    v = body.get(name)
    if v is None:
        return None
    if not is_num(v):
        raise bad(f"'{name}' must be a number, got {short(v)}", name)
    return float(v)


def bool_field(body, name, default: bool = False) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {short(v)}", name)
    return v


def neutral(body, name, ok) -> None:
    """Fields of the OpenAI API this server does not implement: accepted only at a neutral value."""
    if name in body and not ok(body[name]):
        raise bad(f"'{name}' = {short(body[name])} is not supported by this server", name)


def check_prompt_size(text: str, tokenizer, max_model_len: int | None, param: str) -> None:
    """A prompt whose UTF-8 alone is more than `max_model_len` tokens can hold (at the tokenizer's
    `max_bytes_per_token`) is refused before it is tokenized, which for megabytes takes seconds."""
    per = getattr(tokenizer, "max_bytes_per_token", None) if max_model_len else None
    if per is None or len(text) * 4 <= max_model_len * per:  # a character is at most 4 bytes
        return
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > max_model_len * per:
        raise bad(
            f"This model's maximum context length is {max_model_len} tokens, but the prompt's {size:,} bytes "
            f"are more than that many tokens can hold (at most {per} bytes a token)",
            param,
        )


def check_fields(body: dict, allowed: set[str], where: str = "") -> None:
    """A field this server does not know is refused by name: a typo such as `max_token` would
    otherwise be silently ignored."""
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise bad(
            f"unknown field '{where}{short(unknown[0])[1:-1]}' (this server refuses fields it does not implement)",
            re.match(r"[^.\[]*", where).group() or unknown[0],
        )
