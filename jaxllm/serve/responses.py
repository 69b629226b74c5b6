"""OpenAI's Responses API (`POST /v1/responses`, `GET /v1/responses/{id}`), served as chat requests.

A Responses request is translated into the chat request that `parse_request("chat", ...)` checks
(`Turn`), so every rule of the chat route holds unchanged: its fields, the chat template, tools,
structured output, reasoning; a 400 that names a chat field is renamed to the Responses field it
came from. The answer, read by the request's `OutputPlan` as a chat answer is read, becomes output
items (`reasoning`, `message`, `function_call`) and the stream events that build them
(`response_output.Answer`): a whole response is built by the same events, so it is what a stream
of the same answer adds up to. Responses are kept in memory (`ResponseStore`) with the
conversation they end, which a request's `previous_response_id` continues.
"""

from __future__ import annotations

import collections
import json
import re
import uuid
from dataclasses import dataclass

from jaxllm.serve.fields import ApiError, bad, check_fields, is_int
from jaxllm.serve.protocol import GenRequest, parse_request
from jaxllm.serve.response_output import Answer

# Responses fields that are chat fields of the same name and meaning: handed to the chat request
# as sent, which checks them (those a self-hosted model cannot act on are accepted and ignored there).
SHARED = (
    "model",
    "temperature",
    "top_p",
    "parallel_tool_calls",
    "stream",
    "user",
    "store",
    "metadata",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "prompt_cache_retention",
    "prompt_cache_options",
    "moderation",
)
# Responses-only fields that cannot change the answer here: their types checked, not used.
# (`max_tool_calls` bounds calls of built-in tools, which this server has none of.)
IGNORED = {
    "max_tool_calls": is_int,
    "stream_options": lambda v: isinstance(v, dict),
    "access_programs": lambda v: isinstance(v, dict),
    "background_options": lambda v: isinstance(v, dict),
    "image": lambda v: isinstance(v, dict),
}
# Fields whose being ignored would change the answer: refused unless at their neutral value.
REFUSED = {
    "background": (lambda v: v is False, "background responses are not supported: the answer comes with the request"),
    "truncation": (
        lambda v: v == "disabled",
        "only 'disabled' is supported: a conversation longer than the context is refused, never cut",
    ),
    "conversation": (lambda v: False, "conversations are not kept here; send 'previous_response_id' or the items"),
    "prompt": (lambda v: False, "prompt templates are not kept here; send 'instructions' and 'input'"),
    "context_management": (lambda v: v == [], "context compaction is not supported"),
}
FIELDS = {
    *SHARED,
    *IGNORED,
    *REFUSED,
    "input",
    "instructions",
    "max_output_tokens",
    "previous_response_id",
    "reasoning",
    "text",
    "tools",
    "tool_choice",
    "include",
    "top_logprobs",
}
LOGPROBS = "message.output_text.logprobs"
# `include` values that name outputs of built-in tools or input images, which no answer here has
NOTHING_TO_INCLUDE = {
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
}
MEDIA = ("input_image", "input_file", "input_audio")
SUMMARIES = (None, "auto", "concise", "detailed")
# a chat error's words -> the Responses field they came from
RENAMED = [
    (r"\bresponse_format\.json_schema\b", "text.format"),
    (r"\bresponse_format\b", "text.format"),
    (r"\bmax_tokens\b", "max_output_tokens"),
    (r"\breasoning_effort\b", "reasoning.effort"),
    (r"(tools\[\d+\])\.function\.", r"\1."),
    (r"\bmessages\b", "input"),
]
PARAMS = {
    "messages": "input",
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}


def _known(obj: dict, allowed: set[str], where: str, param: str) -> None:
    """check_fields, the error naming the request field `param` that holds `obj`."""
    try:
        check_fields(obj, allowed, where)
    except ApiError as e:
        e.param = param
        raise


def _checked(body) -> None:
    """The request's own fields: none unknown, the refused ones neutral, the ignored ones typed."""
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    check_fields(body, FIELDS)
    for name, (neutral, why) in REFUSED.items():
        if body.get(name) is not None and not neutral(body[name]):
            raise bad(f"'{name}' = {json.dumps(body[name])[:80]}: {why}", name)
    for name, ok in IGNORED.items():
        if body.get(name) is not None and not ok(body[name]):
            raise bad(f"'{name}' has the wrong type ({type(body[name]).__name__})", name)
    include = body.get("include")
    if include is not None:
        if not isinstance(include, list) or not all(isinstance(v, str) for v in include):
            raise bad("'include' must be a list of strings", "include")
        if "reasoning.encrypted_content" in include:
            raise bad(
                "'include' = reasoning.encrypted_content: reasoning comes as plain text in the reasoning "
                "items' content; send those items back, or 'previous_response_id'",
                "include",
            )
        other = [v for v in include if v != LOGPROBS and v not in NOTHING_TO_INCLUDE]
        if other:
            raise bad(f"'include' has an unknown value {other[0]!r}", "include")


# -- the request as a chat request ------------------------------------------------------------------
def _text(content, where: str) -> str:
    """A message's content or a call's output (a string, or a list of text parts) -> its text."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"{where} must be a string or a list of content parts", "input")
    out = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind in ("input_text", "output_text") and isinstance(p.get("text"), str):
            out.append(p["text"])
        elif kind == "refusal" and isinstance(p.get("refusal"), str):
            out.append(p["refusal"])
        elif kind in MEDIA:
            raise bad(f"{where}[{j}] is {kind!r}: this model reads text only", "input")
        else:
            raise bad(f"{where}[{j}] must be an input_text or output_text part", "input")
    return "".join(out)


def _reasoning_text(item: dict, where: str) -> str:
    if item.get("encrypted_content") is not None:
        raise bad(f"{where}.encrypted_content: this server makes and reads no encrypted reasoning", "input")
    for key, kind in (("content", "reasoning_text"), ("summary", "summary_text")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(
            isinstance(p, dict) and p.get("type") == kind and isinstance(p.get("text"), str) for p in parts
        ):
            raise bad(f"{where}.{key} must be a list of {kind} parts", "input")
        if parts:
            return "".join(p["text"] for p in parts)
    return ""


def input_messages(items) -> tuple[list[dict], list[list[str]]]:
    """`input` -> chat messages, and where each came from: [the message's item, then its tool calls'
    items]. A function_call joins the assistant message before it (as this server's own output
    items of one answer do); a reasoning item goes with the assistant message after it."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}], [["input"]]
    if not isinstance(items, list) or not items:
        raise bad("'input' must be a string or a non-empty list of items", "input")
    msgs, origins, reasoning = [], [], None
    for i, it in enumerate(items):
        w = f"input[{i}]"
        if not isinstance(it, dict):
            raise bad(f"{w} must be an object", "input")
        kind = it.get("type", "message")
        if kind == "message":
            _known(it, {"type", "role", "content", "id", "status", "phase"}, f"{w}.", "input")
            if it.get("role") not in ("user", "system", "developer", "assistant"):
                raise bad(
                    f"{w}.role must be one of user, system, developer, assistant, got {it.get('role')!r}", "input"
                )
            msgs.append({"role": it["role"], "content": _text(it.get("content"), f"{w}.content")})
            origins.append([w])
        elif kind == "function_call":
            _known(it, {"type", "call_id", "name", "arguments", "id", "status"}, f"{w}.", "input")
            bad_key = next((k for k in ("call_id", "name", "arguments") if not isinstance(it.get(k), str)), None)
            if bad_key:
                raise bad(f"{w}.{bad_key} must be a string", "input")
            call = {
                "id": it["call_id"],
                "type": "function",
                "function": {"name": it["name"], "arguments": it["arguments"]},
            }
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
                origins[-1].append(w)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append([w, w])
        elif kind == "function_call_output":
            _known(it, {"type", "call_id", "output", "id", "status"}, f"{w}.", "input")
            if not isinstance(it.get("call_id"), str):
                raise bad(f"{w}.call_id must be a string: the call_id of the function_call it answers", "input")
            output = _text(it.get("output"), f"{w}.output")
            msgs.append({"role": "tool", "tool_call_id": it["call_id"], "content": output})
            origins.append([w])
        elif kind == "reasoning":
            _known(it, {"type", "id", "summary", "content", "encrypted_content", "status"}, f"{w}.", "input")
            reasoning = _reasoning_text(it, w)
            continue
        elif kind == "item_reference":
            raise bad(f"{w}: item references are not supported; send the item, or 'previous_response_id'", "input")
        else:
            raise bad(
                f"{w}: items of type {kind!r} are not supported here (message, function_call, "
                f"function_call_output, reasoning)",
                "input",
            )
        if reasoning and msgs[-1]["role"] == "assistant" and "reasoning_content" not in msgs[-1]:
            msgs[-1]["reasoning_content"] = reasoning
        reasoning = None
    return msgs, origins


def chat_tools(tools) -> list[dict]:
    """Responses' flat function tools -> chat's {"type": "function", "function": {...}}; built-in
    tools are refused (none runs here)."""
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of function tools", "tools")
    out = []
    for i, t in enumerate(tools):
        kind = t.get("type") if isinstance(t, dict) else None
        if kind != "function":
            raise bad(
                f"tools[{i}]: the tool {kind!r} is not available on this server; only function tools are"
                if isinstance(kind, str)
                else f"tools[{i}] must be {{'type': 'function', 'name': ...}}",
                "tools",
            )
        out.append({"type": "function", "function": {k: v for k, v in t.items() if k != "type"}})
    return out


def chat_tool_choice(v):
    if isinstance(v, dict) and v.get("type") == "function":
        _known(v, {"type", "name"}, "tool_choice.", "tool_choice")
        return {"type": "function", "function": {"name": v.get("name")}}
    if isinstance(v, dict):
        raise bad(
            f"'tool_choice' of type {v.get('type')!r} is not supported: send 'none', 'auto', 'required' or "
            f"{{'type': 'function', 'name': ...}}",
            "tool_choice",
        )
    return v


def chat_text_format(text) -> dict:
    """`text` ({format, verbosity}) -> chat's `response_format` and `verbosity`."""
    if not isinstance(text, dict):
        raise bad("'text' must be an object with 'format'", "text")
    _known(text, {"format", "verbosity"}, "text.", "text")
    out = {"verbosity": text["verbosity"]} if text.get("verbosity") is not None else {}
    fmt = text.get("format")
    if fmt is not None:
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        out["response_format"] = fmt
    return out


def chat_reasoning(r) -> dict:
    """`reasoning` -> chat's `reasoning_effort` (thinking on or off, where the model thinks). The
    reasoning comes back as it is written, in the reasoning item's content: `summary` is accepted,
    and no summary is written."""
    if not isinstance(r, dict):
        raise bad("'reasoning' must be an object", "reasoning")
    _known(r, {"effort", "summary", "generate_summary", "context", "mode"}, "reasoning.", "reasoning")
    for key, ok in (
        ("summary", SUMMARIES),
        ("generate_summary", SUMMARIES),
        ("context", (None, "auto")),
        ("mode", (None, "standard")),
    ):
        if r.get(key) not in ok:
            raise bad(
                f"'reasoning.{key}' must be one of {', '.join(v for v in ok if v)}, got {r.get(key)!r}", "reasoning"
            )
    return {} if r.get("effort") is None else {"reasoning_effort": r["effort"]}


@dataclass
class Turn:
    """One Responses request and the chat request it is served as."""

    id: str
    body: dict  # the request as sent (what the Response object echoes)
    chat: dict  # the chat request
    origins: list[list[str]]  # chat message i came from origins[i] (`input_messages`)
    history: list[dict]  # the conversation so far, instructions left out: what is kept

    @classmethod
    def read(cls, body, store: ResponseStore) -> Turn:
        _checked(body)
        if "input" not in body:
            raise bad("'input' is required", "input")
        msgs, origins = input_messages(body["input"])
        prev = body.get("previous_response_id")
        if prev is not None:
            if not isinstance(prev, str):
                raise bad("'previous_response_id' must be a string", "previous_response_id")
            before = store.conversation(prev)
            msgs, origins = before + msgs, [["previous_response_id"]] * len(before) + origins
        history = list(msgs)
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad("'instructions' must be a string", "instructions")
        if instructions:  # OpenAI's: this request's instructions, never an earlier one's
            msgs, origins = [{"role": "system", "content": instructions}] + msgs, [["instructions"]] + origins
        chat = {k: body[k] for k in SHARED if k in body}
        chat["messages"] = msgs
        if body.get("max_output_tokens") is not None:
            chat["max_tokens"] = body["max_output_tokens"]
        if body.get("tools") is not None:
            chat["tools"] = chat_tools(body["tools"])
        if body.get("tool_choice") is not None:
            chat["tool_choice"] = chat_tool_choice(body["tool_choice"])
        if body.get("text") is not None:
            chat.update(chat_text_format(body["text"]))
        if body.get("reasoning") is not None:
            chat.update(chat_reasoning(body["reasoning"]))
        if LOGPROBS in (body.get("include") or []) or body.get("top_logprobs") is not None:
            chat.update(logprobs=True, top_logprobs=body.get("top_logprobs") or 0)
        return cls("resp_" + uuid.uuid4().hex, body, chat, origins, history)

    @property
    def store(self) -> bool:
        return self.body.get("store") is not False

    def request(self, engine, served_name: str, max_model_len: int, features, max_num_seqs: int) -> GenRequest:
        """The chat request, checked as the chat route checks it (raises ApiError, see `renamed`)."""
        return parse_request("chat", self.chat, engine, served_name, max_model_len, features, max_num_seqs)

    def renamed(self, e: ApiError) -> ApiError:
        """A chat route's error in the Responses request's words: `messages[i]` as the item it came
        from, chat fields as the Responses fields they were sent as."""

        def origin(m):
            where = self.origins[int(m[1])] if int(m[1]) < len(self.origins) else ["input"]
            if m[3] is not None and int(m[3]) + 1 < len(where):
                return where[int(m[3]) + 1]  # the function_call item of that tool call
            return where[0] + (m[2] or "")

        msg = re.sub(r"messages\[(\d+)\](\.tool_calls\[(\d+)\]\.function)?", origin, e.message)
        for pattern, new in RENAMED:
            msg = re.sub(pattern, new, msg)
        return ApiError(e.status, msg, type=e.type, param=PARAMS.get(e.param, e.param), code=e.code, headers=e.headers)

    def answer(self, req: GenRequest, tokenizer) -> Answer:
        return Answer(self, req, tokenizer)


class ResponseStore:
    """Responses kept for `previous_response_id` and `GET /v1/responses/{id}`: the newest
    `capacity`, the oldest dropped first; a request's `store: false` keeps nothing. A conversation
    shares its messages with the ones it continues, so a long chain costs a list of references a
    turn. Used on the event loop only."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.kept: collections.OrderedDict[str, tuple[list[dict], dict]] = collections.OrderedDict()

    def keep(self, answer: Answer) -> None:
        if self.capacity <= 0 or not answer.turn.store:
            return
        self.kept[answer.turn.id] = (answer.conversation(), answer.response())
        while len(self.kept) > self.capacity:
            self.kept.popitem(last=False)

    def conversation(self, rid: str) -> list[dict]:
        if rid not in self.kept:
            raise ApiError(
                404,
                f"previous response '{rid}' not found: the server keeps the last {self.capacity} "
                f"responses (--max-stored-responses), in memory, unless sent with 'store': false",
                param="previous_response_id",
                code="previous_response_not_found",
            )
        return self.kept[rid][0]

    def response(self, rid: str) -> dict:
        if rid not in self.kept:
            raise ApiError(
                404,
                f"response '{rid}' not found: the server keeps the last {self.capacity} responses "
                f"(--max-stored-responses), unless sent with 'store': false",
                param="response_id",
                code="not_found",
            )
        return self.kept[rid][1]
