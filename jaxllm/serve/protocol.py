"""OpenAI request validation and response shapes.

Validation is strict: a field this server does not know is refused with 400 naming it (a typo such
as `max_token` would otherwise be silently ignored), and an OpenAI feature it does not implement is
accepted only at its neutral value (e.g. `n: 1`, `suffix: null`, `presence_penalty: 0`).
"""

from __future__ import annotations

import logging
import re
import secrets
import time
import uuid
from dataclasses import dataclass

from jaxllm.engine.request import MAX_LOGPROBS, SEED_MOD, Request
from jaxllm.errors import JaxllmError, RequestError
from jaxllm.serve.chat import chat_prompt
from jaxllm.serve.fields import (
    ApiError,
    bad,
    bool_field,
    check_fields,
    check_prompt_size,
    int_field,
    is_int,
    neutral,
    num_field,
    short,
)
from jaxllm.serve.grammar import GUIDED, Constraint, constraint_field
from jaxllm.serve.output import ChatFeatures, OutputPlan, chat_features
from jaxllm.tokenizer import Tokenizer

SEED_RANGE = (-(2**63), 2**64 - 1)  # what OpenAI and vLLM take (an int64, or a uint64); used modulo 2**32
LOGPROB_FLOOR = -9999.0  # what -inf is written as (JSON has no infinity; OpenAI's value)


@dataclass
class GenRequest(Request):
    """One validated generation request, ready for the scheduler, with what the HTTP answer needs."""

    kind: str = "completion"  # "completion" | "chat"
    model: str = ""
    stream: bool = False
    include_usage: bool = False
    created: int = 0
    output: OutputPlan | None = None  # chat: how the answer is read (reasoning, tool calls)
    prompt_text: str = ""  # what `echo` writes back
    constraint: Constraint | None = None  # structured output: what the answer must match
    shown_prompt_logprobs: int | None = None  # vLLM's `prompt_logprobs` as asked: the response lists them


# The fields each route takes: OpenAI's, as its API reference lists them, and vLLM's extras that its
# users send (docs/server.md has the table). Every other field is refused by name: a typo such as
# `max_token` would otherwise be silently ignored.
COMMON_FIELDS = {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "seed",
    "n",
    "stop",
    "stream",
    "stream_options",
    "user",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
    "logprobs",
    "response_format",
    *GUIDED,
    # vLLM's sampling extras
    "top_k",
    "min_p",
    "ignore_eos",
    "repetition_penalty",
    "min_tokens",
    "stop_token_ids",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
    "truncate_prompt_tokens",
    "prompt_logprobs",
}
COMPLETION_FIELDS = COMMON_FIELDS | {"prompt", "echo", "suffix", "best_of"}
# OpenAI's fields that cannot change what a self-hosted model answers: accepted (their types
# checked), logged at debug level, not used.
IGNORED = {
    "store": bool,
    "metadata": dict,
    "service_tier": str,
    "safety_identifier": str,
    "prompt_cache_key": str,
    "prompt_cache_retention": str,
    "prompt_cache_options": dict,
    "verbosity": str,
    "moderation": dict,
}
# OpenAI's fields whose being ignored would change the answer: refused unless absent or null.
REFUSED = {
    "audio": "audio output is not supported: this model writes text",
    "prediction": "predicted outputs are not supported by this server",
    "web_search_options": "web search is not available on this server",
    "functions": "the deprecated 'functions' is not supported; send 'tools'",
    "function_call": "the deprecated 'function_call' is not supported; send 'tool_choice'",
}
CHAT_FIELDS = (
    COMMON_FIELDS
    | set(IGNORED)
    | set(REFUSED)
    | {
        "messages",
        "max_completion_tokens",
        "top_logprobs",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "modalities",
        "reasoning_effort",
        "chat_template_kwargs",
    }
)
MAX_METADATA = 16  # OpenAI's limits on `metadata`: 16 pairs, keys of 64 and values of 512 characters
log = logging.getLogger("jaxllm.serve")


def _check_unsupported(body: dict) -> None:
    neutral(body, "suffix", lambda v: v is None)
    neutral(body, "best_of", lambda v: v is None or (is_int(v) and v == 1))
    for name, why in REFUSED.items():
        if body.get(name) is not None:
            raise bad(f"'{name}': {why}", name)
    m = body.get("modalities")
    if m is not None:
        if not isinstance(m, list) or not all(isinstance(x, str) for x in m):
            raise bad("'modalities' must be a list of strings", "modalities")
        if any(x != "text" for x in m):
            raise bad(f"'modalities' = {m!r}: this model writes text only (send [\"text\"])", "modalities")
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise bad(f"'user' must be a string, got {type(user).__name__}", "user")
    ignored = [k for k in IGNORED if body.get(k) is not None]
    for k in ignored:
        if not isinstance(body[k], IGNORED[k]):
            what = {bool: "true or false", dict: "an object", str: "a string"}[IGNORED[k]]
            raise bad(f"'{k}' must be {what}", k)
    meta = body.get("metadata")
    if meta is not None and (
        len(meta) > MAX_METADATA
        or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= 64 and len(v) <= 512 for k, v in meta.items()
        )
    ):
        raise bad(
            f"'metadata' must map at most {MAX_METADATA} keys of up to 64 characters to strings of up to 512",
            "metadata",
        )
    if ignored:
        log.debug("fields accepted and not used by a self-hosted model: %s", ", ".join(ignored))


def _n(body, max_num_seqs: int | None) -> int:
    n = int_field(body, "n", lo=1)
    if n is not None and max_num_seqs is not None and n > max_num_seqs:
        raise bad(f"'n' = {n} answers need {n} slots, but this server has {max_num_seqs} (--max-num-seqs)", "n")
    return 1 if n is None else n


def _logit_bias(body) -> dict:
    """`logit_bias`'s keys as token ids (JSON keys are strings); its values and ranges are the
    request's checks (`Request.check`)."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise bad("'logit_bias' must be an object mapping token ids to biases", "logit_bias")
    out = {}
    for key, bias in v.items():
        if not re.fullmatch(r"[0-9]{1,10}", key):
            raise bad(f"'logit_bias' keys must be token ids, got {short(key)}", "logit_bias")
        if int(key) in out:
            raise bad(f"'logit_bias' names token {int(key)} twice", "logit_bias")
        out[int(key)] = bias
    return out


def _stop_token_ids(body) -> list[int]:
    v = body.get("stop_token_ids")
    if v is None:
        return []
    if not isinstance(v, list) or not all(is_int(t) for t in v):
        raise bad("'stop_token_ids' must be a list of token ids", "stop_token_ids")
    return v


def _sampling(body, vocab_size: int) -> dict:
    """The sampling fields as numbers, with OpenAI's and vLLM's defaults and meanings (temperature
    1 unless given, top_k -1 or 0 for none, a seed of any int64 or uint64 taken modulo 2**32, none
    given: a random one); their ranges are the request's checks (`Request.check`)."""
    temperature = num_field(body, "temperature")
    top_k = int_field(body, "top_k", lo=-1)
    seed = int_field(body, "seed", lo=SEED_RANGE[0], hi=SEED_RANGE[1])
    if seed is None:
        seed = secrets.randbelow(SEED_MOD)
    if top_k is not None and not 0 < top_k < vocab_size:
        top_k = None  # -1, 0 and anything >= the vocabulary all mean "no top-k"
    values = {
        name: num_field(body, name)
        for name in ("top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
    }
    defaults = {"min_p": 0.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0}
    return {
        "temperature": 1.0 if temperature is None else temperature,  # OpenAI's default
        "top_k": top_k,
        "seed": seed % SEED_MOD,
        **{k: defaults[k] if v is None and k in defaults else v for k, v in values.items()},
    }


def _logprobs(kind: str, body) -> int | None:
    """The alternatives per token a request asks for, None without log-probabilities: completions'
    `logprobs` N, chat's `logprobs: true` with `top_logprobs` N."""
    if kind == "completion":
        return body.get("logprobs")  # its range: `Request.check`
    on = bool_field(body, "logprobs")
    top = int_field(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top is not None and not on:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    return (top or 0) if on else None


def _stream_options(body, stream: bool) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not stream:
        raise bad("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(opts, dict) or any(k != "include_usage" for k in opts):
        raise bad("'stream_options' must be an object with the one field 'include_usage'", "stream_options")
    return bool_field(opts, "include_usage")


# -- prompts --------------------------------------------------------------------------------------
def completion_prompt_ids(body: dict, engine, max_model_len: int | None = None) -> list[int]:
    """`prompt`: a string, a list of token ids, or a one-element list of either. `max_model_len`:
    a string too long for it is refused before it is tokenized (`check_prompt_size`)."""
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]
    if isinstance(p, str):
        if engine.tokenizer is None:
            raise bad("this model has no tokenizer; send 'prompt' as a list of token ids", "prompt")
        check_prompt_size(p, engine.tokenizer, max_model_len, "prompt")
        ids = engine.tokenizer.encode(p)
    elif isinstance(p, list) and p and all(is_int(t) for t in p):
        vocab = engine.cfg.vocab_size
        if any(not 0 <= t < vocab for t in p):
            raise bad(f"token ids in 'prompt' must lie in [0, {vocab})", "prompt")
        ids = list(p)
    elif isinstance(p, list) and len(p) > 1 and all(isinstance(x, (str, list)) for x in p):
        raise bad("'prompt' holds several prompts; send one prompt per request", "prompt")
    elif isinstance(p, list) and p:
        wrong = next(t for t in p if not is_int(t))
        raise bad(f"'prompt' must be a string or a list of token ids, and {short(wrong)} is not a token id", "prompt")
    elif p is None:
        raise bad("'prompt' is required", "prompt")
    else:
        raise bad("'prompt' must be a string or a non-empty list of token ids", "prompt")
    if not ids:
        raise bad("'prompt' is empty (it encodes to no tokens)", "prompt")
    return ids


def _prompt_text(body: dict, ids: list[int], engine) -> str:
    """The prompt as `echo` returns it: the string sent, or the text of the token ids sent."""
    p = body["prompt"]
    p = p[0] if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)) else p
    return p if isinstance(p, str) else engine.tokenizer.decode(ids) if engine.tokenizer is not None else ""


# -- the whole request ----------------------------------------------------------------------------
def parse_request(
    kind: str,
    body,
    engine,
    served_name: str,
    max_model_len: int,
    features: ChatFeatures | None = None,
    max_num_seqs: int | None = None,
) -> GenRequest:
    """Validate a decoded JSON body for /v1/completions (kind 'completion') or /v1/chat/completions;
    `features`: what the model family's chat answers hold (by default from the engine's family);
    `max_num_seqs`: the slots, which bound `n`."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_fields(body, COMPLETION_FIELDS if kind == "completion" else CHAT_FIELDS)
    _check_model(body, served_name)
    _check_unsupported(body)
    stream = bool_field(body, "stream")
    ignore_eos = bool_field(body, "ignore_eos")
    include_usage = _stream_options(body, stream)
    sampling = _sampling(body, engine.cfg.vocab_size)
    n = _n(body, max_num_seqs)
    logit_bias = _logit_bias(body)
    stop_token_ids = _stop_token_ids(body)
    min_tokens = int_field(body, "min_tokens", lo=0) or 0
    logprobs = _logprobs(kind, body)
    echo = bool_field(body, "echo")
    max_tokens = int_field(body, "max_tokens", lo=0 if echo else 1)
    if kind == "chat":
        mct = int_field(body, "max_completion_tokens", lo=1)
        max_tokens = mct if mct is not None else max_tokens
    constraint = constraint_field(body)
    plan, prompt_text = None, ""
    limit = None if body.get("truncate_prompt_tokens") is not None else max_model_len  # no cheap refusal
    if kind == "completion":
        ids = completion_prompt_ids(body, engine, limit)
        if echo:
            prompt_text = _prompt_text(body, ids, engine)
    else:
        ids, plan = chat_prompt(body, engine, features or chat_features(engine.cfg.family), max_model_len=limit)
        if constraint is not None and plan is not None:  # a constrained answer is all content
            if plan.tools is not None:
                raise bad(
                    f"'{constraint.field}' cannot be combined with 'tools' (unless 'tool_choice' is "
                    f"'none'): the answer is either constrained or free to call tools",
                    constraint.field,
                )
            plan = None
    kept = _truncated(body, ids, max_model_len)
    if echo and len(kept) < len(ids):  # the prompt echoed as the model read it
        prompt_text = _prompt_text({"prompt": kept}, kept, engine)
    ids = kept
    max_tokens = _fit_context(
        len(ids),
        max_tokens,
        max_model_len,
        default=16 if kind == "completion" else None,
        prompt_param="prompt" if kind == "completion" else "messages",
        tokens_param="max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens",
    )
    rid = ("cmpl-" if kind == "completion" else "chatcmpl-") + uuid.uuid4().hex
    special = plan is not None and any(p is not None and p.decode_special for p in (plan.tools, plan.reasoning))
    skip_special = bool_field(body, "skip_special_tokens", True) and not special
    prompt_lp = int_field(body, "prompt_logprobs")
    bool_field(body, "spaces_between_special_tokens", True)  # the tokenizer's own joining, as vLLM's fast ones
    req = GenRequest(
        ids,
        max_tokens,
        kind=kind,
        model=served_name,
        stop=body.get("stop"),
        ignore_eos=ignore_eos,
        stream=stream,
        include_usage=include_usage,
        id=rid,
        created=int(time.time()),
        skip_special=skip_special,
        include_stop=bool_field(body, "include_stop_str_in_output"),
        prompt_logprobs=prompt_lp,
        shown_prompt_logprobs=prompt_lp,
        output=plan,
        logprobs=logprobs,
        echo=echo,
        prompt_text=prompt_text,
        n=n,
        logit_bias=logit_bias,
        stop_token_ids=stop_token_ids,
        min_tokens=min_tokens,
        constraint=constraint,
        **sampling,
    )
    try:
        return req.check(engine.cfg.vocab_size)  # the checks every request meets, Engine.generate's too
    except RequestError as e:
        raise bad(str(e), e.param) from None


# -- /tokenize and /detokenize (vLLM's) ------------------------------------------------------------
TOKENIZE_FIELDS = {
    "model",
    "prompt",
    "messages",
    "add_special_tokens",
    "add_generation_prompt",
    "return_token_strs",
    "tools",
    "chat_template_kwargs",
}
CHAT_ONLY = ("add_generation_prompt", "tools", "chat_template_kwargs")


def _check_model(body: dict, served_name: str) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise bad(f"'model' must be a string, got {model!r}", "model")
    if model not in (None, served_name):
        raise ApiError(
            404,
            f"The model '{model}' does not exist; this server serves '{served_name}'",
            param="model",
            code="model_not_found",
        )


def _tokenizer(engine, param: str):
    if engine.tokenizer is None:
        raise bad("this model has no tokenizer", param)
    return engine.tokenizer


def tokenize(body, engine, served_name: str, max_model_len: int, features: ChatFeatures) -> dict:
    """`prompt` (a string) or chat `messages` -> their token ids, as the generation routes see them."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_fields(body, TOKENIZE_FIELDS)
    _check_model(body, served_name)
    if ("prompt" in body) == ("messages" in body):
        raise bad("send one of 'prompt' (a string) and 'messages' (a chat)", "prompt")
    tok = _tokenizer(engine, "prompt" if "prompt" in body else "messages")
    if "prompt" in body:
        extra = next((k for k in CHAT_ONLY if k in body), None)
        if extra:
            raise bad(f"'{extra}' applies to 'messages' only", extra)
        if not isinstance(body["prompt"], str):
            raise bad("'prompt' must be a string", "prompt")
        try:
            ids = tok.encode(body["prompt"], add_special=bool_field(body, "add_special_tokens", True))
        except JaxllmError as e:
            raise bad(str(e), "prompt") from None
    else:
        ids, _ = chat_prompt(
            body,
            engine,
            features,
            bool_field(body, "add_generation_prompt", True),
            bool_field(body, "add_special_tokens"),
        )
    strs = None
    if bool_field(body, "return_token_strs"):
        strs = [tok.tok.id_to_token(i) if isinstance(tok, Tokenizer) else str(i) for i in ids]
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": ids, "token_strs": strs}


def detokenize(body, engine, served_name: str) -> dict:
    """`tokens` -> their text, special tokens included (so it inverts /tokenize)."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_fields(body, {"model", "tokens"})
    _check_model(body, served_name)
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(is_int(t) for t in ids):
        raise bad("'tokens' must be a list of token ids", "tokens")
    vocab = engine.cfg.vocab_size
    if any(not 0 <= t < vocab for t in ids):
        raise bad(f"token ids in 'tokens' must lie in [0, {vocab})", "tokens")
    tok = _tokenizer(engine, "tokens")
    return {"prompt": tok.decode(ids, skip_special=False) if isinstance(tok, Tokenizer) else tok.decode(ids)}


def _truncated(body: dict, ids: list[int], max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens` k: the prompt's last k tokens (-1: the last max_model_len - 1,
    so one new token fits)."""
    k = body.get("truncate_prompt_tokens")
    if k is None:
        return ids
    if not is_int(k) or not (k == -1 or k >= 1):
        raise bad(f"'truncate_prompt_tokens' must be -1 or an integer >= 1, got {k!r}", "truncate_prompt_tokens")
    k = max_model_len - 1 if k == -1 else k
    return ids[-k:]


def _fit_context(
    n_prompt: int,
    max_tokens: int | None,
    limit: int,
    default: int | None,
    prompt_param: str,
    tokens_param: str = "max_tokens",
) -> int:
    if n_prompt >= limit:
        raise bad(
            f"This model's maximum context length is {limit} tokens, but the prompt has {n_prompt} "
            f"tokens (at least one new token must fit)",
            prompt_param,
        )
    if max_tokens is None:  # vLLM's defaults: 16 for completions, the rest of the context for chat
        return min(default or limit, limit - n_prompt)
    if n_prompt + max_tokens > limit:
        raise bad(
            f"This model's maximum context length is {limit} tokens, but {short(n_prompt + max_tokens)} were "
            f"requested ({n_prompt} in the prompt + {short(max_tokens)} {tokens_param}); reduce the prompt or "
            f"{tokens_param}",
            tokens_param,
        )
    return max_tokens


# -- responses ------------------------------------------------------------------------------------
