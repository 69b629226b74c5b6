"""The field policy of docs/server.md's request-field tables, checked against a live server: every
field of the chat-completions, completions and Responses requests, as the installed `openai`
package types them, and every vLLM extra of the table, sent with a valid value, is served or
ignored (200) or refused (400 naming it) as the tables say; the tables list every field the
package knows.

The server is a tiny random Qwen3 with its real chat template (it has tools and thinking), in this
process, so each request costs a few tiny forwards.
"""
from __future__ import annotations

import json
import re
import typing
from pathlib import Path

import httpx
import pytest
import tiny_chat

import jaxllm

DOCS = Path(__file__).resolve().parents[2] / "docs" / "server.md"
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
WEATHER = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
# A valid value of every field (what a client that sets it would send); fields some other field
# must come with (`NEEDS`) get it too.
VALID = {
    "model": "m", "messages": ASK, "prompt": "The weather in Paris is", "max_tokens": 3, "max_completion_tokens": 3,
    "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05, "seed": 3, "n": 2, "stop": ["\n\n"],
    "include_stop_str_in_output": True, "stop_token_ids": [5], "min_tokens": 1, "ignore_eos": True,
    "logit_bias": {"5": 1.5}, "stream": True, "stream_options": {"include_usage": True}, "presence_penalty": 0.5,
    "frequency_penalty": 0.5, "repetition_penalty": 1.1, "top_logprobs": 2, "prompt_logprobs": 1, "echo": True,
    "skip_special_tokens": False, "spaces_between_special_tokens": False, "truncate_prompt_tokens": 8,
    "tools": WEATHER, "tool_choice": "auto", "parallel_tool_calls": False, "reasoning_effort": "low",
    "chat_template_kwargs": {"enable_thinking": False}, "response_format": {"type": "json_object"},
    "guided_json": {"type": "object", "properties": {"a": {"type": "integer"}}}, "guided_regex": "[a-z]{3}",
    "guided_grammar": 'start: "yes" | "no"', "guided_choice": ["sun", "rain"], "modalities": ["text"],
    "user": "user-1", "store": True, "metadata": {"team": "search"}, "service_tier": "auto",
    "safety_identifier": "hashed-user", "prompt_cache_key": "weather-bot", "prompt_cache_retention": "24h",
    "prompt_cache_options": {"mode": "implicit", "ttl": "30m"}, "verbosity": "low",
    "moderation": {"model": "omni-moderation-latest"}, "best_of": 2, "suffix": " tomorrow.",
    "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "Sunny."},
    "web_search_options": {"search_context_size": "low"},
    "functions": [{"name": "get_weather", "parameters": {"type": "object", "properties": {}}}],
    "function_call": "auto",
}
BY_ROUTE = {"chat": {"logprobs": True}, "completions": {"logprobs": 2}}      # the one field typed per route
NEEDS = {"top_logprobs": {"logprobs": True}, "stream_options": {"stream": True}, "tool_choice": {"tools": WEATHER}}
ROUTES = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}


def sdk_fields(route: str) -> set[str]:
    """The request fields the installed `openai` package types for a route."""
    if route == "chat":
        from openai.types.chat import completion_create_params as params
    else:
        from openai.types import completion_create_params as params
    return set(typing.get_type_hints(params.CompletionCreateParamsBase, include_extras=False)) | {"stream"}


def policy_table() -> dict[str, dict[str, str]]:
    """docs/server.md's request-field table -> {route: {field: "served" | "ignored" | "refused"}}
    (a field not of a route is absent from its map)."""
    text = DOCS.read_text()
    section = text[text.index("### Request fields"):]
    section = section[:section.index("\n### ", 1)]
    out = {"chat": {}, "completions": {}}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 4 or not cells[0].startswith("`"):
            continue
        for name in re.findall(r"`([a-z_]+)`", cells[0]):
            for route, cell in zip(("chat", "completions"), cells[1:3]):
                if cell != "–":
                    assert cell in ("served", "ignored", "refused"), line
                    out[route][name] = cell
    return out


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tiny_chat.make_qwen3(tmp_path_factory.mktemp("fields_qwen3"))
    engine = jaxllm.load(str(path), quant="none", dtype="float32", max_ctx=1024)
    s = tiny_chat.LiveServer(engine, max_model_len=1024, max_num_seqs=4)
    yield s
    s.stop()


def test_the_table_lists_every_field_the_openai_package_knows():
    table = policy_table()
    for route in ROUTES:
        missing = sdk_fields(route) - set(table[route])
        assert not missing, f"docs/server.md's request-field table lacks {route} fields {sorted(missing)}"
        assert set(table[route]) <= set(VALID) | set(BY_ROUTE[route]), sorted(set(table[route]) - set(VALID))


@pytest.mark.parametrize("route", list(ROUTES))
def test_every_field_is_served_ignored_or_refused_as_the_table_says(server, route):
    table = policy_table()[route]
    base = {"messages": ASK} if route == "chat" else {"prompt": VALID["prompt"]}
    seen = {}
    for name, policy in sorted(table.items()):
        body = {**base, "max_tokens": 3, **NEEDS.get(name, {}), name: {**VALID, **BY_ROUTE[route]}[name]}
        r = httpx.post(server.url + ROUTES[route], json=body, timeout=120)
        seen[name] = r.status_code
        if policy == "refused":
            assert r.status_code == 400, (name, r.text)
            assert r.json()["error"]["param"] == name, (name, r.text)
        else:
            assert r.status_code == 200, (name, r.text)
            if not body.get("stream"):
                assert r.json()["choices"], (name, r.text)
            else:
                assert r.text.rstrip().endswith("data: [DONE]"), (name, r.text[-300:])
    # OpenAI's fields that cannot change a self-hosted answer are never refused
    for name in ("store", "metadata", "service_tier", "prompt_cache_key", "safety_identifier", "modalities",
                 "verbosity", "reasoning_effort", "min_p", "skip_special_tokens", "user"):
        if name in table:
            assert seen[name] == 200, name
    load = server.scheduler.load()
    assert load["running"] == 0 and load["waiting"] == 0


# -- /v1/responses: docs/server.md's Responses table ---------------------------------------------------
RESPONSES_VALID = {
    "model": "m", "input": "What is the weather in Paris?", "instructions": "Be terse.", "max_output_tokens": 3,
    "temperature": 0.7, "top_p": 0.9, "parallel_tool_calls": False, "stream": True,
    "tools": [{"type": "function", "name": "get_weather", "parameters": WEATHER[0]["function"]["parameters"]}],
    "tool_choice": "auto", "text": {"format": {"type": "json_object"}}, "reasoning": {"effort": "low"},
    "include": ["message.output_text.logprobs"], "top_logprobs": 2, "store": False, "metadata": {"team": "search"},
    "user": "user-1", "service_tier": "auto", "safety_identifier": "hashed-user", "prompt_cache_key": "weather-bot",
    "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit", "ttl": "30m"},
    "moderation": {"model": "omni-moderation-latest"}, "max_tool_calls": 3,
    "stream_options": {"include_obfuscation": False}, "access_programs": {"cyber": "standard"},
    "background_options": {"completion_window": "soonest"}, "image": {"context_compression": "auto"},
    "conversation": "conv_123", "prompt": {"id": "pmpt_123"}, "context_management": [{"type": "compaction"}],
}
RESPONSES_NEEDS = {"tool_choice": {"tools": RESPONSES_VALID["tools"]}, "stream_options": {"stream": True}}


def responses_table() -> list[tuple[str, object, bool]]:
    """docs/server.md's Responses table -> [(field, the value its row names or None, refused)]."""
    text = DOCS.read_text()
    section = text[text.index("### The Responses API"):]
    section = section[:section.index("\n### ", 1)]
    out = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not cells[0].startswith("`"):
            continue
        refused = cells[1].startswith("refused")
        for span in re.findall(r"`([^`]+)`", cells[0]):
            name, _, value = span.partition(": ")
            out.append((name, json.loads(value) if value else None, refused))
    return out


def test_the_responses_table_lists_every_field_the_openai_package_knows():
    from openai.types.responses import response_create_params as params
    known = set(typing.get_type_hints(params.ResponseCreateParamsBase)) | {"stream"}
    listed = {name for name, _, _ in responses_table()}
    assert not known - listed, f"docs/server.md's Responses table lacks {sorted(known - listed)}"
    assert listed <= set(RESPONSES_VALID) | {"previous_response_id", "background", "truncation"}


def test_every_responses_field_is_served_ignored_or_refused_as_the_table_says(server):
    first = httpx.post(server.url + "/v1/responses", json={"input": "Hi", "max_output_tokens": 3}, timeout=120)
    assert first.status_code == 200, first.text
    valid = {**RESPONSES_VALID, "previous_response_id": first.json()["id"]}
    for name, value, refused in responses_table():
        body = {"input": valid["input"], "max_output_tokens": 3, **RESPONSES_NEEDS.get(name, {}),
                name: valid[name] if value is None else value}
        r = httpx.post(server.url + "/v1/responses", json=body, timeout=120)
        if refused:
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, value, r.text)
        else:
            assert r.status_code == 200, (name, value, r.text)
