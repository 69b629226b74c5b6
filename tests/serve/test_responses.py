"""The Responses API (`/v1/responses`) and `GET /v1/models/{id}`, through the official openai client
and raw HTTP: every streamed event and every Response object is validated by the `openai`
package's own types, and each answer is checked against what the chat route gives for the same
conversation.

Two servers: a tiny Qwen3 whose answers are scripted (`tiny_chat.ScriptedEngine`, as in
test_server_chat.py) for reasoning, function calls and the request checks; the embedded Gemma 3
270M as a live process for greedy answers, `previous_response_id`, structured output and
log-probabilities against /v1/chat/completions.
"""
from __future__ import annotations

import json
import re

import httpx
import openai
import pydantic
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from test_server import API_KEY, ServerProcess
from test_server_chat import Scripted

WEATHER = [{"type": "function", "name": "get_weather", "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
CHAT_WEATHER = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in WEATHER]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EVENTS = pydantic.TypeAdapter(ResponseStreamEvent)
ENDS = ("response.completed", "response.incomplete", "response.failed")
# the events of one output item, in order: text items (message, reasoning) and function calls
ITEM_EVENTS = {"message": re.compile(r"added part_added (?:output_text\.delta )*output_text\.done part_done done"),
               "reasoning": re.compile(r"added part_added (?:reasoning_text\.delta )*reasoning_text\.done part_done done"),
               "function_call": re.compile(r"added function_call_arguments\.delta function_call_arguments\.done done")}


def events_of(url: str, body: dict, key: str | None = None) -> list[dict]:
    """A raw Responses stream -> its events (each `data:` line, its `event:` line checked against it)."""
    out, name = [], None
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, headers=headers,
                      timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("event: "):
                name = line[len("event: "):]
            elif line.startswith("data: "):
                out.append(json.loads(line[len("data: "):]))
                assert out[-1]["type"] == name
    return out


def checked_stream(events: list[dict]) -> dict:
    """The stream's events valid and in order -> its final Response object (as JSON): each event
    an `openai` event type, sequence numbers 0, 1, 2, ...; created, in_progress, then each output
    item's events from its `added` to its `done` (items one after another, in output_index order),
    then completed, incomplete or failed; each item's deltas add up to its final text."""
    for e in events:
        EVENTS.validate_python(e)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [e["type"] for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1]["type"] in ENDS and all(e["type"] not in ENDS for e in events[:-1])
    final = events[-1]["response"]
    Response.model_validate(final)
    per_item: dict[int, list[dict]] = {}
    for e in events[2:-1]:
        assert e["output_index"] == len(per_item) - (e["type"] != "response.output_item.added")
        per_item.setdefault(e["output_index"], []).append(e)
    assert len(per_item) == len(final["output"])
    for i, item in enumerate(final["output"]):
        kinds = " ".join(e["type"].removeprefix("response.").replace("output_item.", "").replace("content_part.", "part_")
                         for e in per_item[i])
        assert ITEM_EVENTS[item["type"]].fullmatch(kinds), kinds
        assert per_item[i][-1]["item"] == item
        deltas = "".join(e["delta"] for e in per_item[i] if e["type"].endswith(".delta"))
        assert deltas == (item["arguments"] if item["type"] == "function_call" else item["content"][0]["text"])
    return final


def without_ids(output: list[dict]) -> list[dict]:
    return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in output]


# -- the scripted Qwen3: reasoning, function calls, request checks -----------------------------------
@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    import tiny_chat
    s = Scripted(tiny_chat.make_qwen3(tmp_path_factory.mktemp("qwen3_responses")))
    yield s
    s.server.stop()


def create(s: Scripted, **kw) -> Response:
    return s.client.responses.create(model="m", temperature=0, **kw)


def whole(s: Scripted, body: dict) -> dict:
    """A non-streamed Response as JSON, validated by the package's type."""
    r = s.post("/v1/responses", {"model": "m", **body})
    assert r.status_code == 200, r.text
    Response.model_validate(r.json())
    return r.json()


def test_reasoning_and_message_whole_and_streamed(qwen3):
    qwen3.answer = lambda p: "<think>\nTwo and two.\n</think>\n\nFour."
    r = create(qwen3, input="2+2?")
    assert [o.type for o in r.output] == ["reasoning", "message"] and r.status == "completed"
    assert r.output[0].content[0].text == "Two and two." and r.output[0].summary == []
    assert r.output_text == "Four." and r.output[1].content[0].annotations == []
    assert r.usage.input_tokens == len(qwen3.last_prompt()) and r.usage.output_tokens > 0
    assert r.usage.output_tokens_details.reasoning_tokens > 0
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    events = events_of(qwen3.server.url, {"model": "m", "input": "2+2?"})
    final = checked_stream(events)
    assert final["status"] == "completed" and without_ids(final["output"]) == without_ids(whole(qwen3, {"input": "2+2?"})["output"])
    assert "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta") == "Four."
    assert any(e["type"] == "response.reasoning_text.delta" for e in events)
    # the prompt and the answer's parts are the chat route's for the same message
    prompt = qwen3.last_prompt()
    chat = qwen3.chat(messages=[{"role": "user", "content": "2+2?"}]).choices[0].message
    assert qwen3.last_prompt() == prompt and (chat.reasoning_content, chat.content) == ("Two and two.", "Four.")


def test_reasoning_effort_none_turns_thinking_off(qwen3):
    qwen3.answer = lambda p: "Four."
    r = create(qwen3, input="2+2?", reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message"] and r.output_text == "Four."
    prompt = qwen3.last_prompt()
    qwen3.chat(messages=[{"role": "user", "content": "2+2?"}], reasoning_effort="none")
    assert prompt == qwen3.last_prompt()
    assert qwen3.tok.decode(prompt, skip_special=False).endswith("<think>\n\n</think>\n\n")


def test_function_call_round_trip(qwen3):
    """function_call out; its output sent back, by previous_response_id and as items, and the chat
    route's prompt for the same conversation; the final message."""
    qwen3.answer = lambda p: "It is sunny." if "<tool_response>" in p else "<think>\nAsk the tool.\n</think>\n\n" + CALL
    r = create(qwen3, input="Weather in Paris?", tools=WEATHER, instructions="Be brief.")
    assert [o.type for o in r.output] == ["reasoning", "function_call"]
    call = r.output[1]
    assert (call.name, json.loads(call.arguments), call.status) == ("get_weather", {"city": "Paris"}, "completed")
    assert call.call_id.startswith("call_") and r.output_text == ""
    streamed = checked_stream(events_of(qwen3.server.url, {"model": "m", "input": "Weather in Paris?", "tools": WEATHER}))
    assert [(o["type"], o.get("name")) for o in streamed["output"]] == [("reasoning", None), ("function_call", "get_weather")]

    result = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}
    r2 = create(qwen3, previous_response_id=r.id, input=[result], tools=WEATHER, instructions="Be brief.")
    assert r2.output_text == "It is sunny." and r2.previous_response_id == r.id
    by_id = qwen3.last_prompt()
    items = [{"role": "user", "content": "Weather in Paris?"}, *[o.model_dump(exclude_none=True) for o in r.output], result]
    r3 = create(qwen3, input=items, tools=WEATHER, instructions="Be brief.")
    assert r3.output_text == "It is sunny." and qwen3.last_prompt() == by_id
    qwen3.chat(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
                         {"role": "assistant", "content": None, "reasoning_content": "Ask the tool.",
                          "tool_calls": [{"id": call.call_id, "type": "function",
                                          "function": {"name": call.name, "arguments": call.arguments}}]},
                         {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}], tools=CHAT_WEATHER)
    assert qwen3.last_prompt() == by_id


def test_tool_choice_and_text_before_a_call(qwen3):
    qwen3.answer = lambda p: "Let me look.\n" + CALL
    r = create(qwen3, input="Weather?", tools=WEATHER, reasoning={"effort": "none"})
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Let me look."
    qwen3.answer = lambda p: '{"city": "Rome"}}\n</tool_call>'
    r = create(qwen3, input="Weather?", tools=WEATHER, tool_choice={"type": "function", "name": "get_weather"})
    assert [(o.type, o.name, o.arguments) for o in r.output] == [("function_call", "get_weather", '{"city": "Rome"}')]
    assert r.tool_choice.name == "get_weather"


def test_max_output_tokens_cut_is_incomplete(qwen3):
    qwen3.answer = lambda p: "A long answer that does not fit."
    body = {"input": "Talk.", "max_output_tokens": 5, "reasoning": {"effort": "none"}}
    r = whole(qwen3, body)
    assert r["status"] == "incomplete" and r["incomplete_details"] == {"reason": "max_output_tokens"}
    assert r["output"][0]["status"] == "incomplete" and r["usage"]["output_tokens"] == 5
    final = checked_stream(events_of(qwen3.server.url, {"model": "m", **body}))
    assert final["status"] == "incomplete" and without_ids(final["output"]) == without_ids(r["output"])


def test_an_engine_failure_fails_the_response(qwen3):
    def broken(prompt):
        raise RuntimeError("the device went away")
    qwen3.answer = broken
    events = events_of(qwen3.server.url, {"model": "m", "input": "Hi"})
    final = checked_stream(events)
    assert events[-1]["type"] == "response.failed" and final["status"] == "failed"
    assert final["error"]["code"] == "server_error"
    r = qwen3.post("/v1/responses", {"input": "Hi"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"


def test_stored_responses(qwen3):
    qwen3.answer = lambda p: "Fine."
    r = create(qwen3, input="Hi", metadata={"k": "v"}, user="u1", store=True)
    got = qwen3.client.responses.retrieve(r.id)
    assert got.id == r.id and got.output_text == "Fine." and got.metadata == {"k": "v"}
    gone = create(qwen3, input="Hi", store=False)
    with pytest.raises(openai.NotFoundError):
        qwen3.client.responses.retrieve(gone.id)
    r = qwen3.post("/v1/responses", {"input": "Hi", "previous_response_id": gone.id})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"
    assert r.json()["error"]["code"] == "previous_response_not_found"


def test_the_oldest_stored_response_is_dropped_first(qwen3):
    import tiny_chat
    qwen3.answer = lambda p: "Ok."
    server = tiny_chat.LiveServer(tiny_chat.ScriptedEngine(qwen3.engine, qwen3.reply), max_model_len=512,
                                  max_num_seqs=2, max_stored_responses=2)
    try:
        ids = [server.client().responses.create(model="m", input=f"Hi {i}").id for i in range(3)]
        assert [httpx.post(server.url + "/v1/responses", json={"input": "More", "previous_response_id": i}).status_code
                for i in ids] == [404, 200, 200]
    finally:
        server.stop()


BAD = [  # (body, the field the 400 names)
    ({"input": "Hi", "max_token": 5}, "max_token"),
    ({}, "input"),
    ({"input": []}, "input"),
    ({"input": 5}, "input"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]}, "input"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": [{"type": "web_search_call", "id": "ws_1", "status": "completed"}]}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "x"}]}, "input"),
    ({"input": "Hi", "instructions": 5}, "instructions"),
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "max_output_tokens": 10 ** 6}, "max_output_tokens"),
    ({"input": "Hi", "temperature": -1}, "temperature"),
    ({"input": "Hi", "top_p": 2}, "top_p"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "tools": [{"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "bad name"}]}, "tools"),
    ({"input": "Hi", "tools": [{"type": "function", "name": "f", "strict": True}]}, "tools"),
    ({"input": "Hi", "tools": WEATHER, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "Hi", "tools": WEATHER, "tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_schema", "name": "a", "schema": 5}}}, "text.format"),
    ({"input": "Hi", "text": {"format": {"type": "json_object"}, "colour": "red"}}, "text"),
    ({"input": "Hi", "reasoning": {"effort": "huge"}}, "reasoning.effort"),
    ({"input": "Hi", "reasoning": {"summary": "long"}}, "reasoning"),
    ({"input": "Hi", "background": True}, "background"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": "Hi", "conversation": "conv_1"}, "conversation"),
    ({"input": "Hi", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": "Hi", "metadata": {"k": 5}}, "metadata"),
    ({"input": "Hi", "store": "yes"}, "store"),
    ({"input": "Hi", "previous_response_id": 7}, "previous_response_id"),
]


@pytest.mark.parametrize("body, param", BAD, ids=[f"{i}-{p}" for i, (_, p) in enumerate(BAD)])
def test_bad_request_is_a_400_naming_the_field(qwen3, body, param):
    r = qwen3.post("/v1/responses", body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and "\n" not in err["message"] and "messages" not in err["message"], err


def test_fields_that_cannot_change_the_answer_are_accepted(qwen3):
    qwen3.answer = lambda p: "Ok."
    r = whole(qwen3, {"input": "Hi", "store": True, "metadata": {"a": "b"}, "service_tier": "auto", "user": "u",
                      "safety_identifier": "s", "prompt_cache_key": "k", "truncation": "disabled", "background": False,
                      "include": ["web_search_call.results"], "text": {"format": {"type": "text"}, "verbosity": "low"},
                      "max_tool_calls": 3, "parallel_tool_calls": False, "stream_options": {"include_obfuscation": False},
                      "reasoning": {"effort": "none", "summary": "auto"}})
    assert r["output"][0]["content"][0]["text"] == "Ok." and r["parallel_tool_calls"] is False


# -- the embedded Gemma 3 270M: greedy answers against the chat route ----------------------------------
@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    p = ServerProcess(None, tmp_path_factory.mktemp("responses_logs") / "server.log", "--max-num-seqs", "2",
                      "--max-model-len", "512", "--api-key", API_KEY)
    try:
        yield p.wait_ready()
        assert "Traceback" not in p.output(), p.output()[-3000:]
    finally:
        p.terminate()


@pytest.fixture(scope="module")
def client(gemma):
    return openai.OpenAI(base_url=gemma.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def test_models_retrieve(client, model):
    m = client.models.retrieve(model)
    assert (m.id, m.object, m.owned_by) == (model, "model", "jaxllm")
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found"


def test_previous_response_id_continues_as_the_chat_route(client, model):
    first = client.responses.create(model=model, input="Name a color.", max_output_tokens=8, temperature=0)
    assert first.status == "incomplete" or first.output_text
    second = client.responses.create(model=model, previous_response_id=first.id, input="And another one?",
                                     instructions="Answer in one word.", max_output_tokens=8, temperature=0)
    chat = client.chat.completions.create(model=model, max_tokens=8, temperature=0, messages=[
        {"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a color."},
        {"role": "assistant", "content": first.output_text}, {"role": "user", "content": "And another one?"}])
    assert second.output_text == chat.choices[0].message.content
    assert second.usage.input_tokens == chat.usage.prompt_tokens
    assert second.usage.output_tokens == chat.usage.completion_tokens
    assert (second.status == "incomplete") == (chat.choices[0].finish_reason == "length")


class City(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    days: int = pydantic.Field(ge=1, le=7)


def test_parse_with_a_pydantic_model_whole_and_streamed(client, model):
    """`responses.parse` and the `responses.stream` helper (whose final response needs
    response.completed: the schema's answer ends well within the token limit)."""
    body = {"model": model, "input": "A trip to Paris for 3 days, as JSON.", "text_format": City,
            "max_output_tokens": 40, "temperature": 0}
    r = client.responses.parse(**body)
    assert r.status == "completed" and isinstance(r.output_parsed, City)
    assert City.model_validate_json(r.output_text) == r.output_parsed
    with client.responses.stream(**body) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert "".join(deltas) == final.output_text == r.output_text and final.output_parsed == r.output_parsed


def test_a_cut_stream_adds_up_to_the_whole_response(client, model):
    body = {"model": model, "input": "Write a short line about the sea.", "max_output_tokens": 10, "temperature": 0}
    whole = client.responses.create(**body)
    final = checked_stream([e.model_dump(mode="json") for e in client.responses.create(**body, stream=True)])
    assert final["status"] == whole.status == "incomplete" and final["output"][0]["content"][0]["text"] == whole.output_text


def test_logprobs_are_the_chat_routes(client, model):
    r = client.responses.create(model=model, input="Count: one, two,", max_output_tokens=6, temperature=0,
                                top_logprobs=2, include=["message.output_text.logprobs"])
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count: one, two,"}],
                                          max_tokens=6, temperature=0, logprobs=True, top_logprobs=2)
    got = r.output[0].content[0].logprobs
    want = chat.choices[0].logprobs.content
    assert [(g.token, round(g.logprob, 4), [t.token for t in g.top_logprobs]) for g in got] == \
        [(w.token, round(w.logprob, 4), [t.token for t in w.top_logprobs]) for w in want]
    assert "".join(g.token for g in got) == r.output_text
