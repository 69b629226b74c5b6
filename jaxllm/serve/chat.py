"""Chat requests: messages (tool calls and tool results included), `tools`, `tool_choice` and
`chat_template_kwargs` checked, then rendered by the model's chat template into the prompt, with
the plan for reading the answer back (`output.OutputPlan`).

`tool_choice`: "auto" (the default with tools) lets the model choose; "none" leaves the tools out of
the prompt; "required" and a named function write the start of a call into the answer (the
family's call marker, and the name), so the model goes on from inside a call. Without constrained
decoding the call's arguments are the model's own: one that does not parse comes back as content.
"""

from __future__ import annotations

import json
import re

from jaxllm.errors import JaxllmError
from jaxllm.serve.fields import bad, bool_field, check_fields, check_prompt_size
from jaxllm.serve.output import ChatFeatures, OutputPlan

ROLES = ("system", "user", "assistant", "developer", "tool")
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
# fields a client echoes back from an assistant message it received; only their empty values
ECHOED = ("refusal", "annotations", "audio", "function_call")
TEMPLATE_KWARGS = ("enable_thinking",)


def message_text(content, where: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(
        isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content
    ):
        return "".join(p["text"] for p in content)
    raise bad(f"{where}.content must be a string or a list of text parts", "messages")


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant message's tool calls, their arguments decoded: chat templates take them as
    objects, as transformers passes them."""
    if not isinstance(calls, list) or not calls:
        raise bad(f"{where}.tool_calls must be a non-empty list", "messages")
    out = []
    for j, c in enumerate(calls):
        w = f"{where}.tool_calls[{j}]"
        f = c.get("function") if isinstance(c, dict) else None
        if (
            not isinstance(c, dict)
            or set(c) - {"id", "type", "function", "index"}
            or c.get("type", "function") != "function"
            or not isinstance(f, dict)
            or set(f) != {"name", "arguments"}
            or not isinstance(c.get("id"), str)
        ):
            raise bad(
                f"{w} must be {{'id': str, 'type': 'function', 'function': {{'name': str, 'arguments': str}}}}",
                "messages",
            )
        if not isinstance(f["name"], str) or not isinstance(f["arguments"], str):
            raise bad(f"{w}.function.name and .arguments must be strings", "messages")
        try:
            args = json.loads(f["arguments"])
        except ValueError:
            args = None
        if not isinstance(args, dict):
            raise bad(f"{w}.function.arguments must be a JSON object", "messages")
        out.append({"id": c["id"], "type": "function", "function": {"name": f["name"], "arguments": args}})
    return out


def chat_messages(body: dict, features: ChatFeatures) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise bad("'messages' is required", "messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"{where} must be an object with 'role' and 'content'", "messages")
        role = m.get("role")
        if role not in ROLES:
            raise bad(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", "messages")
        allowed = {"role", "content", "name"} | {
            "assistant": {"tool_calls", "reasoning_content", *ECHOED},
            "tool": {"tool_call_id"},
        }.get(role, set())
        extra = sorted(set(m) - allowed)
        if extra:
            raise bad(f"{where} has unknown field '{extra[0]}'", "messages")
        echoed = next((k for k in ECHOED if m.get(k)), None)
        if echoed:
            raise bad(f"{where}.{echoed} is not supported (only null or empty)", "messages")
        if (role == "tool" or m.get("tool_calls")) and features.tools is None:
            raise bad(
                f"{where}: this model has no tool-call format, so tool calls and results cannot be sent", "messages"
            )
        content = m.get("content")
        msg = {
            "role": "system" if role == "developer" else role,
            "content": "" if content is None and role == "assistant" else message_text(content, where),
        }
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise bad(f"{where}.name must be a string", "messages")
            msg["name"] = m["name"]
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _tool_calls(m["tool_calls"], where)
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise bad(f"{where}.tool_call_id is required: the id of the call this message answers", "messages")
            msg["tool_call_id"] = m["tool_call_id"]
        if m.get("reasoning_content") is not None:
            if not isinstance(m["reasoning_content"], str):
                raise bad(f"{where}.reasoning_content must be a string", "messages")
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def tools_field(body: dict, features: ChatFeatures) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad("'tools' must be a list of function tools", "tools")
    if features.tools is None:
        raise bad("this model has no tool-call format, so 'tools' is not supported", "tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or set(t) != {"type", "function"}
            or t["type"] != "function"
            or not isinstance(f, dict)
        ):
            raise bad(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., ...}}}}", "tools")
        check_fields(f, {"name", "description", "parameters", "strict"}, f"tools[{i}].function.")
        name = f.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise bad(f"tools[{i}].function.name must be 1-64 letters, digits, '_', '.' or '-', got {name!r}", "tools")
        if name in names:
            raise bad(f"tools[{i}]: a second function named {name!r}", "tools")
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise bad(f"tools[{i}].function.description must be a string", "tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise bad(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        if f.get("strict"):
            raise bad(
                f"tools[{i}].function.strict = true is not supported: arguments are not constrained to the schema",
                "tools",
            )
        names.add(name)
        out.append({"type": "function", "function": {k: v for k, v in f.items() if k != "strict" and v is not None}})
    return out


def tool_choice_field(body: dict, tools: list[dict] | None) -> tuple[str, str | None]:
    """-> (mode: "none" | "auto" | "required" | "named", the named function or None)."""
    v = body.get("tool_choice")
    if v is None:
        return ("auto" if tools else "none"), None
    if v in ("none", "auto", "required"):
        if v != "none" and not tools:
            raise bad(f"'tool_choice' = {v!r} needs 'tools'", "tool_choice")
        return v, None
    f = v.get("function") if isinstance(v, dict) else None
    if (
        isinstance(v, dict)
        and set(v) == {"type", "function"}
        and v["type"] == "function"
        and isinstance(f, dict)
        and set(f) == {"name"}
        and isinstance(f["name"], str)
    ):
        if f["name"] not in [t["function"]["name"] for t in tools or []]:
            raise bad(f"'tool_choice' names the function {f['name']!r}, which is not in 'tools'", "tool_choice")
        return "named", f["name"]
    raise bad(
        "'tool_choice' must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}",
        "tool_choice",
    )


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def reasoning_effort_field(body: dict) -> str | None:
    v = body.get("reasoning_effort")
    if v is not None and v not in REASONING_EFFORTS:
        raise bad(f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}, got {v!r}", "reasoning_effort")
    return v


def template_kwargs_field(body: dict, features: ChatFeatures, template_variables=()) -> dict:
    """vLLM's `chat_template_kwargs` (of them the templates here read `enable_thinking`), or else
    OpenAI's `reasoning_effort` as `enable_thinking`; `template_variables`: the names the model's
    chat template reads."""
    v = body.get("chat_template_kwargs")
    effort = reasoning_effort_field(body)
    out = {}
    if v is not None:
        if not isinstance(v, dict):
            raise bad("'chat_template_kwargs' must be an object", "chat_template_kwargs")
        check_fields(v, set(TEMPLATE_KWARGS), "chat_template_kwargs.")
        if v.get("enable_thinking") is not None:
            if features.reasoning is None:
                raise bad(
                    "this model does not think, so 'chat_template_kwargs.enable_thinking' is not supported",
                    "chat_template_kwargs",
                )
            out["enable_thinking"] = bool_field(v, "enable_thinking")
    # OpenAI's `reasoning_effort`: thinking off at "none", on otherwise, for a model that thinks and
    # whose template can turn it off; for the rest it cannot change what kind of answer comes
    if (
        "enable_thinking" not in out
        and effort is not None
        and features.reasoning is not None
        and "enable_thinking" in template_variables
    ):
        out["enable_thinking"] = effort != "none"
    return out


def chat_prompt(
    body: dict,
    engine,
    features: ChatFeatures,
    add_generation_prompt: bool = True,
    add_special: bool = False,
    max_model_len: int | None = None,
) -> tuple[list[int], OutputPlan | None]:
    """The prompt's token ids and how to read the answer (None: as plain text). The template writes
    BOS itself, so the tokenizer adds no special tokens unless `add_special`. `max_model_len`: a
    rendered prompt too long for it is refused before it is tokenized (`check_prompt_size`)."""
    messages = chat_messages(body, features)
    tools = tools_field(body, features)
    mode, name = tool_choice_field(body, tools)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad(f"'parallel_tool_calls' must be true or false, got {parallel!r}", "parallel_tool_calls")
    if engine.tokenizer is None:
        raise bad("this model has no tokenizer, so chat requests cannot be served", "messages")
    names = engine.tokenizer.template_variables()
    kwargs = template_kwargs_field(body, features, names)
    if tools and mode != "none" and "tools" not in names:
        raise bad("this model's chat template does not render tools, so 'tools' is not supported", "tools")
    if kwargs and "enable_thinking" not in names:
        raise bad("this model's chat template does not read 'enable_thinking'", "chat_template_kwargs")
    try:
        text = engine.tokenizer.render_chat(
            messages, add_generation_prompt, tools=tools if mode != "none" else None, **kwargs
        )
    except JaxllmError as e:
        raise bad(str(e), "messages") from None
    prefix = features.tools.forced_prefix(name) if mode in ("required", "named") else ""
    check_prompt_size(text + prefix, engine.tokenizer, max_model_len, "messages")
    ids = engine.tokenizer.encode(text + prefix, add_special=add_special)
    if not ids:
        raise bad("'messages' render to an empty prompt", "messages")
    r = features.reasoning
    thinking = r is not None and not prefix and kwargs.get("enable_thinking", r.default)
    plan = OutputPlan(
        tools=features.tools if mode != "none" else None,
        reasoning=r if thinking else None,
        prefix=prefix,
        parallel=parallel is not False,
        thinking_open=bool(thinking) and text.rstrip().endswith(r.start),
    )
    return ids, (plan if plan.tools or plan.reasoning else None)
