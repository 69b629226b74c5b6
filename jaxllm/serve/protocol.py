"""OpenAI request validation and response shapes.

Validation is strict: a field this server does not know is refused with 400 naming it (a typo such
as `max_token` would otherwise be silently ignored), and an OpenAI feature it does not implement is
accepted only at its neutral value (e.g. `n: 1`, `logprobs: null`, `presence_penalty: 0`).
"""
from __future__ import annotations

import math
import secrets
import time
import uuid
from dataclasses import dataclass, field

from ..errors import JaxllmError

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
SEED_MOD = 2 ** 32
CHAT_ROLES = ("system", "user", "assistant", "developer")


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


@dataclass
class GenRequest:
    """One validated generation request, ready for the scheduler."""
    kind: str                          # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int = 0
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    id: str = ""
    created: int = 0


# -- field checks ---------------------------------------------------------------------------------
def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return (_is_int(v) or isinstance(v, float)) and math.isfinite(v)


def _int(body, name, lo=None, hi=None):
    v = body.get(name)
    if v is None:
        return None
    if not _is_int(v):
        raise bad(f"'{name}' must be an integer, got {v!r}", name)
    if lo is not None and v < lo:
        raise bad(f"'{name}' must be >= {lo}, got {v}", name)
    if hi is not None and v > hi:
        raise bad(f"'{name}' must be <= {hi}, got {v}", name)
    return v


def _num(body, name):
    v = body.get(name)
    if v is None:
        return None
    if not _is_num(v):
        raise bad(f"'{name}' must be a number, got {v!r}", name)
    return float(v)


def _bool(body, name) -> bool:
    v = body.get(name, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise bad(f"'{name}' must be true or false, got {v!r}", name)
    return v


def _neutral(body, name, ok) -> None:
    """Fields of the OpenAI API this server does not implement: accepted only at a neutral value."""
    if name in body and not ok(body[name]):
        raise bad(f"'{name}' = {body[name]!r} is not supported by this server", name)


COMMON_FIELDS = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "n", "stop", "stream",
                 "stream_options", "user", "presence_penalty", "frequency_penalty", "logit_bias",
                 "logprobs", "ignore_eos"}     # ignore_eos: vLLM's extension, for benchmarks
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
CHAT_FIELDS = COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs", "response_format",
                               "tools", "tool_choice", "parallel_tool_calls"}


def _check_fields(body: dict, allowed: set[str]) -> None:
    unknown = sorted(k for k in body if k not in allowed)
    if unknown:
        raise bad(f"unknown field '{unknown[0]}' (this server refuses fields it does not implement)", unknown[0])


def _check_unsupported(body: dict) -> None:
    zero = lambda v: v is None or (_is_num(v) and v == 0)    # noqa: E731
    _neutral(body, "n", lambda v: v is None or (_is_int(v) and v == 1))
    _neutral(body, "presence_penalty", zero)
    _neutral(body, "frequency_penalty", zero)
    _neutral(body, "logit_bias", lambda v: not v)
    _neutral(body, "logprobs", lambda v: v is None or v is False or (_is_int(v) and v == 0))
    _neutral(body, "top_logprobs", lambda v: v is None or (_is_int(v) and v == 0))
    _neutral(body, "echo", lambda v: v is None or v is False)
    _neutral(body, "suffix", lambda v: v is None)
    _neutral(body, "best_of", lambda v: v is None or (_is_int(v) and v == 1))
    _neutral(body, "tools", lambda v: not v)
    _neutral(body, "tool_choice", lambda v: v in (None, "none", "auto"))
    _neutral(body, "response_format", lambda v: v is None or (isinstance(v, dict) and v.get("type") == "text"))


def _stop(body) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(s, str) for s in items):
        raise bad("'stop' must be a string or a list of strings", "stop")
    if len(items) > MAX_STOP_STRINGS:
        raise bad(f"'stop' takes at most {MAX_STOP_STRINGS} strings, got {len(items)}", "stop")
    if any(s == "" for s in items):
        raise bad("'stop' strings must not be empty", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in items):
        raise bad(f"'stop' strings may have at most {MAX_STOP_CHARS} characters", "stop")
    return list(dict.fromkeys(items))


def _sampling(body, vocab_size: int) -> dict:
    temperature = _num(body, "temperature")
    if temperature is not None and temperature < 0:
        raise bad(f"'temperature' must be >= 0, got {temperature}", "temperature")
    top_p = _num(body, "top_p")
    if top_p is not None and not 0 < top_p <= 1:
        raise bad(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _int(body, "top_k", lo=-1)
    seed = _int(body, "seed")
    temperature = 1.0 if temperature is None else temperature     # OpenAI's default
    if seed is None:
        seed = secrets.randbelow(SEED_MOD)
    if top_k is not None and not 0 < top_k < vocab_size:
        top_k = None                  # -1, 0 and anything >= the vocabulary all mean "no top-k"
    return {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed % SEED_MOD}


def _stream_options(body, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict) or any(k != "include_usage" for k in opts):
        raise bad("'stream_options' must be an object with the one field 'include_usage'", "stream_options")
    return _bool(opts, "include_usage")


# -- prompts --------------------------------------------------------------------------------------
def completion_prompt_ids(body: dict, engine) -> list[int]:
    """`prompt`: a string, a list of token ids, or a one-element list of either."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if engine.tokenizer is None:
            raise bad("this model has no tokenizer; send 'prompt' as a list of token ids", "prompt")
        ids = engine.tokenizer.encode(p)
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        vocab = engine.cfg.vocab_size
        if any(not 0 <= t < vocab for t in p):
            raise bad(f"token ids in 'prompt' must lie in [0, {vocab})", "prompt")
        ids = list(p)
    elif isinstance(p, list) and len(p) > 1:
        raise bad("'prompt' holds several prompts; send one prompt per request", "prompt")
    elif p is None:
        raise bad("'prompt' is required", "prompt")
    else:
        raise bad("'prompt' must be a string or a non-empty list of token ids", "prompt")
    if not ids:
        raise bad("'prompt' is empty (it encodes to no tokens)", "prompt")
    return ids


def _message_text(content, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text"
                                         and isinstance(p.get("text"), str) for p in content):
        return "".join(p["text"] for p in content)
    raise bad(f"messages[{i}].content must be a string or a list of text parts", "messages")


def chat_messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}] must be an object with 'role' and 'content'", "messages")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"messages[{i}] has unknown field '{extra[0]}'", "messages")
        role = m.get("role")
        if role not in CHAT_ROLES:
            raise bad(f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r}", "messages")
        out.append({"role": "system" if role == "developer" else role,
                    "content": _message_text(m.get("content"), i)})
    return out


def chat_prompt_ids(body: dict, engine) -> list[int]:
    messages = chat_messages(body)
    if engine.tokenizer is None:
        raise bad("this model has no tokenizer, so chat requests cannot be served", "messages")
    try:
        ids = engine.tokenizer.encode_chat(messages)
    except JaxllmError as e:
        raise bad(str(e), "messages") from None
    if not ids:
        raise bad("'messages' render to an empty prompt", "messages")
    return ids


# -- the whole request ----------------------------------------------------------------------------
def parse_request(kind: str, body, engine, served_name: str, max_model_len: int) -> GenRequest:
    """Validate a decoded JSON body for /v1/completions (kind 'completion') or /v1/chat/completions."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    _check_fields(body, COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {model!r}", "model")
    if model not in (None, served_name):
        raise ApiError(404, f"The model '{model}' does not exist; this server serves '{served_name}'",
                       param="model", code="model_not_found")
    _check_unsupported(body)
    stream = _bool(body, "stream")
    ignore_eos = _bool(body, "ignore_eos")
    include_usage = _stream_options(body, stream)
    stop = _stop(body)
    sampling = _sampling(body, engine.cfg.vocab_size)
    max_tokens = _int(body, "max_tokens", lo=1)
    if kind == "chat":
        mct = _int(body, "max_completion_tokens", lo=1)
        max_tokens = mct if mct is not None else max_tokens
    ids = completion_prompt_ids(body, engine) if kind == "completion" else chat_prompt_ids(body, engine)
    max_tokens = _fit_context(len(ids), max_tokens, max_model_len, default=16 if kind == "completion" else None)
    rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
    return GenRequest(kind, served_name, ids, max_tokens, stop=stop, ignore_eos=ignore_eos, stream=stream,
                      include_usage=include_usage, id=rid, created=int(time.time()), **sampling)


def _fit_context(n_prompt: int, max_tokens: int | None, limit: int, default: int | None) -> int:
    if n_prompt >= limit:
        raise bad(f"This model's maximum context length is {limit} tokens, but the prompt has {n_prompt} "
                  f"tokens (at least one new token must fit)", "messages")
    if max_tokens is None:            # vLLM's defaults: 16 for completions, the rest of the context for chat
        return min(default or limit, limit - n_prompt)
    if n_prompt + max_tokens > limit:
        raise bad(f"This model's maximum context length is {limit} tokens, but {n_prompt + max_tokens} were "
                  f"requested ({n_prompt} in the prompt + {max_tokens} max_tokens); reduce the prompt or "
                  f"max_tokens", "max_tokens")
    return max_tokens


# -- responses ------------------------------------------------------------------------------------
def usage(n_prompt: int, n_completion: int) -> dict:
    return {"prompt_tokens": n_prompt, "completion_tokens": n_completion,
            "total_tokens": n_prompt + n_completion}


def full_response(req: GenRequest, text: str, finish_reason: str, n_completion: int) -> dict:
    if req.kind == "completion":
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                  "finish_reason": finish_reason}
        obj = "chat.completion"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice],
            "usage": usage(len(req.prompt_ids), n_completion)}


def stream_chunk(req: GenRequest, text: str | None, finish_reason: str | None = None,
                 role: bool = False) -> dict:
    """One SSE chunk with a text delta (or the role announcement, or the finish reason)."""
    if req.kind == "completion":
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    chunk = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(req: GenRequest, n_completion: int) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [],
            "usage": usage(len(req.prompt_ids), n_completion)}
