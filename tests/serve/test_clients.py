"""The clients people run against the server, each through its own API and answer types: the
official `openai` package, `litellm` (its `openai/<model>` provider) and `langchain-openai`
(`ChatOpenAI`, `OpenAI`).

On the embedded Gemma 3 270M (a server process): chat, streaming, completions and structured
output from a pydantic model or a JSON schema, every answer validated against its schema; greedy
answers are the same whichever client sent the request, streamed or not. On a tiny Qwen3 with its
real chat template, answering from a script (`tiny_chat.ScriptedEngine`, in this process): a tool
call, its result sent back as each library sends it (the SDK's message object, litellm's `Message`,
a langchain `ToolMessage`) and the answer, streamed and not; reasoning as each library exposes it.
No request fails on a server, and no client looks up a name off this machine (litellm fetches its
model-cost map from the internet unless told not to).
"""
from __future__ import annotations

import ipaddress
import json
import logging
import os
import socket

import httpx
import jsonschema
import pytest
import tiny_chat
from pydantic import BaseModel, Field
from test_server import API_KEY, ServerProcess
from test_server_chat import ASK, QWEN3_CALL, WEATHER, Scripted

# litellm reads this when it is imported: its bundled model-cost map instead of the one online
os.environ["LITELLM_LOCAL_MODEL_COST_MAP"] = "True"

RIVERS = [{"role": "user", "content": "Name three rivers."}]
STORY = "Once upon a time"
SHORT = 8                      # tokens of a free answer: enough to compare, cheap on a CPU


class Person(BaseModel):
    """A person."""
    name: str = Field(pattern="^[A-Z][a-z]{1,11}$")
    age: int = Field(ge=0, le=120)


PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"], "properties": {
    "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"}, "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ASK_PERSON = [{"role": "user", "content": "Reply with a person as a JSON object."}]
THINK = "<think>\nTwo and two.\n</think>\n\nFour."
SUM = [{"role": "user", "content": "2+2?"}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def the_person(text: str) -> Person:
    jsonschema.validate(json.loads(text), PERSON)
    return Person.model_validate_json(text)


# -- fixtures ---------------------------------------------------------------------------------------
def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.split("%")[0]).is_loopback
    except ValueError:
        return host == "localhost"


@pytest.fixture(scope="module", autouse=True)
def lookups_refused():
    """Every name or address a client looks up off the loopback, refused (and listed)."""
    real, refused = socket.getaddrinfo, []

    def loopback_only(host, *args, **kw):
        name = host.decode() if isinstance(host, bytes) else host
        if name is not None and not is_loopback(name):
            refused.append(name)
            raise socket.gaierror(socket.EAI_NONAME, f"{name}: this test reaches only the loopback")
        return real(host, *args, **kw)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(socket, "getaddrinfo", loopback_only)
        yield refused


@pytest.fixture(scope="module")
def gemma_process(tmp_path_factory):
    """The embedded model's server, started first so that it loads while the scripted tests run.
    The requests here are few and come one at a time: without a warm-up the server compiles only
    the shapes of calls they take (4), not the 17 a warm-up compiles for 4 slots."""
    p = ServerProcess(None, tmp_path_factory.mktemp("clients_logs") / "server.log", "--max-num-seqs", "4",
                      "--max-model-len", "512", "--api-key", API_KEY, "--no-warmup")
    yield p
    p.terminate()


class ErrorRecords(logging.Handler):
    def __init__(self):
        super().__init__(logging.ERROR)
        self.records: list[str] = []

    def emit(self, record):
        self.records.append(self.format(record))


@pytest.fixture(scope="module")
def server_errors():
    """What the in-process server logs at ERROR or above (a 500 logs its traceback)."""
    handler = ErrorRecords()
    loggers = [logging.getLogger(name) for name in ("jaxllm", "uvicorn.error")]
    for lg in loggers:
        lg.addHandler(handler)
    yield handler.records
    for lg in loggers:
        lg.removeHandler(handler)


@pytest.fixture(scope="module")
def qwen3(gemma_process, server_errors, tmp_path_factory):
    """The scripted Qwen3's server (the embedded model's starts before it, and loads meanwhile)."""
    s = Scripted(tiny_chat.make_qwen3(tmp_path_factory.mktemp("clients_qwen3")))
    s.url = s.server.url + "/v1"
    yield s
    s.server.stop()


@pytest.fixture(scope="module")
def gemma(gemma_process):
    return gemma_process.wait_ready()


@pytest.fixture(scope="module")
def client(gemma):
    import openai
    return openai.OpenAI(base_url=gemma.url + "/v1", api_key=API_KEY, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


@pytest.fixture(scope="module")
def expected(gemma, model):
    """Greedy answers to RIVERS (chat) and STORY (completion), asked with plain HTTP."""
    def post(route, body):
        r = httpx.post(f"{gemma.url}/v1/{route}", json={"model": model, "max_tokens": SHORT, "temperature": 0, **body},
                       headers={"Authorization": f"Bearer {API_KEY}"}, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]
    return {"chat": post("chat/completions", {"messages": RIVERS})["message"]["content"],
            "completion": post("completions", {"prompt": STORY})["text"]}


@pytest.fixture(scope="module")
def litellm(lookups_refused):
    import litellm
    litellm.suppress_debug_info = True        # its banners on stdout, for a model name it has no price for
    return litellm


@pytest.fixture(scope="module")
def langchain(lookups_refused):
    import langchain_openai
    return langchain_openai


def chat_model(langchain, url, model, api_key="none", **kw):
    return langchain.ChatOpenAI(model=model, base_url=url, api_key=api_key, temperature=0, max_retries=0,
                                timeout=300, **kw)


def prompt_text(qwen3) -> str:
    return qwen3.tok.decode(qwen3.last_prompt(), skip_special=False)


def answer_to_tool_result(qwen3):
    """The scripted model: a reasoned call of get_weather, and once the tool answered, an answer."""
    qwen3.answer = lambda p: ("<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Paris."
                              if "<tool_response>" in p else QWEN3_CALL)


# -- tool calls and reasoning (the scripted Qwen3) --------------------------------------------------
def test_openai_tool_call_round_trip(qwen3):
    """The SDK's message object goes back in the history as it came; the SDK's streaming helper
    assembles the same call. `parse()` with a pydantic tool (always `strict`) is a 400 naming
    `tools`: arguments are not constrained here."""
    import openai
    from openai.types.chat import ChatCompletion, ChatCompletionMessage
    answer_to_tool_result(qwen3)
    r = qwen3.client.chat.completions.create(model="m", messages=ASK, tools=WEATHER)
    msg = r.choices[0].message
    assert isinstance(r, ChatCompletion) and isinstance(msg, ChatCompletionMessage)
    assert r.choices[0].finish_reason == "tool_calls" and msg.content is None
    call = msg.tool_calls[0]
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == \
        ("function", "get_weather", {"city": "Paris", "days": 2})
    assert msg.reasoning_content == "The user wants the weather; I will call the tool."

    history = ASK + [msg, {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    r2 = qwen3.client.chat.completions.create(model="m", messages=history, tools=WEATHER)
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert (r2.choices[0].message.content, r2.choices[0].message.reasoning_content) == \
        ("It is sunny in Paris.", "The tool says sunny.")
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt_text(qwen3)

    with qwen3.client.chat.completions.stream(model="m", messages=ASK, tools=WEATHER,
                                              stream_options={"include_usage": True}) as s:
        events = [e.type for e in s]
        final = s.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    streamed = final.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    assert final.choices[0].finish_reason == "tool_calls" and not streamed.content
    assert streamed.reasoning_content == msg.reasoning_content and final.usage == r.usage

    class GetWeather(BaseModel):
        """The weather in a city"""
        city: str
        days: int
    with pytest.raises(openai.BadRequestError) as e:
        qwen3.client.chat.completions.parse(model="m", messages=ASK,
                                            tools=[openai.pydantic_function_tool(GetWeather, name="get_weather")])
    assert e.value.status_code == 400 and e.value.param == "tools" and "strict" in e.value.message


def test_litellm_tool_call_round_trip(qwen3, litellm):
    """litellm's `Message` goes back in the history as its documentation does it; streamed with
    usage, its chunks rebuild the same answer with the server's token counts."""
    answer_to_tool_result(qwen3)
    kw = {"model": "openai/m", "api_base": qwen3.url, "api_key": "none", "temperature": 0, "tools": WEATHER}
    r = litellm.completion(messages=ASK, **kw)
    msg = r.choices[0].message
    assert isinstance(r, litellm.ModelResponse) and isinstance(msg, litellm.Message)
    assert r.choices[0].finish_reason == "tool_calls" and not msg.content
    call = msg.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Paris", "days": 2})
    assert msg.reasoning_content == "The user wants the weather; I will call the tool."

    history = ASK + [msg, {"role": "tool", "tool_call_id": call.id, "name": "get_weather", "content": "sunny, 21 C"}]
    r2 = litellm.completion(messages=history, **kw)
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert (r2.choices[0].message.content, r2.choices[0].message.reasoning_content) == \
        ("It is sunny in Paris.", "The tool says sunny.")
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in prompt_text(qwen3)

    chunks = list(litellm.completion(messages=ASK, stream=True, stream_options={"include_usage": True}, **kw))
    assert all(isinstance(c, litellm.ModelResponseStream) for c in chunks)
    built = litellm.stream_chunk_builder(chunks, messages=ASK)
    assert isinstance(built, litellm.ModelResponse) and built.choices[0].finish_reason == "tool_calls"
    streamed = built.choices[0].message
    assert [(c.function.name, c.function.arguments) for c in streamed.tool_calls] == \
        [(call.function.name, call.function.arguments)]
    assert streamed.reasoning_content == msg.reasoning_content
    assert (built.usage.prompt_tokens, built.usage.completion_tokens) == \
        (r.usage.prompt_tokens, r.usage.completion_tokens)


def test_langchain_tool_call_round_trip(qwen3, langchain):
    """`bind_tools` with a langchain tool; the tool run on the AIMessage's call gives the
    ToolMessage sent back; streamed chunks add up to the same call. `strict=True` is the 400."""
    import openai
    from langchain_core.messages import AIMessage, AIMessageChunk, HumanMessage, ToolMessage
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str, days: int = 1) -> str:
        """The weather in a city"""
        return f"sunny in {city} for {days} days"
    answer_to_tool_result(qwen3)
    llm = chat_model(langchain, qwen3.url, "m").bind_tools([get_weather])
    ask = [HumanMessage(ASK[0]["content"])]
    ai = llm.invoke(ask)
    assert isinstance(ai, AIMessage) and ai.response_metadata["finish_reason"] == "tool_calls"
    assert [(c["name"], c["args"]) for c in ai.tool_calls] == [("get_weather", {"city": "Paris", "days": 2})]
    assert ai.invalid_tool_calls == [] and ai.content == ""
    result = get_weather.invoke(ai.tool_calls[0])
    assert isinstance(result, ToolMessage) and result.tool_call_id == ai.tool_calls[0]["id"]

    final = llm.invoke([*ask, ai, result])
    assert isinstance(final, AIMessage) and final.content == "It is sunny in Paris." and final.tool_calls == []
    assert "<tool_response>\nsunny in Paris for 2 days\n</tool_response>" in prompt_text(qwen3)
    assert final.usage_metadata["input_tokens"] == len(qwen3.last_prompt())

    chunks = list(llm.stream(ask))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    whole = sum(chunks[1:], chunks[0])
    assert [(c["name"], c["args"]) for c in whole.tool_calls] == [(c["name"], c["args"]) for c in ai.tool_calls]
    assert whole.response_metadata["finish_reason"] == "tool_calls"

    with pytest.raises(openai.BadRequestError) as e:
        chat_model(langchain, qwen3.url, "m").bind_tools([get_weather], strict=True).invoke(ask)
    assert e.value.status_code == 400 and e.value.param == "tools"


def test_reasoning_as_each_client_exposes_it(qwen3, litellm, langchain):
    """openai: `reasoning_content` as an extra field of the message and of the deltas; litellm: its
    `reasoning_content`, streamed too; langchain's ChatOpenAI keeps only OpenAI's own fields, so the
    reasoning is dropped and the content is the answer alone. With `enable_thinking` off, sent as
    each client sends extra fields, the prompt closes the empty think block."""
    qwen3.answer = lambda p: THINK
    r = qwen3.client.chat.completions.create(model="m", messages=SUM)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Two and two.", "Four.")
    deltas = [c.choices[0].delta for c in qwen3.client.chat.completions.create(model="m", messages=SUM, stream=True)
              if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == "Two and two."
    assert "".join(d.content or "" for d in deltas) == "Four."

    kw = {"model": "openai/m", "api_base": qwen3.url, "api_key": "none", "messages": SUM}
    msg = litellm.completion(**kw).choices[0].message
    assert (msg.reasoning_content, msg.content) == ("Two and two.", "Four.")
    chunks = list(litellm.completion(stream=True, **kw))
    assert "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks) == "Two and two."
    built = litellm.stream_chunk_builder(chunks, messages=SUM).choices[0].message
    assert (built.reasoning_content, built.content) == ("Two and two.", "Four.")

    llm = chat_model(langchain, qwen3.url, "m")
    ai = llm.invoke(SUM[0]["content"])
    assert ai.content == "Four." and ai.content_blocks == [{"type": "text", "text": "Four."}]
    assert "reasoning_content" not in ai.additional_kwargs
    chunks = list(llm.stream(SUM[0]["content"]))
    whole = sum(chunks[1:], chunks[0])
    assert whole.content == "Four." and "reasoning_content" not in whole.additional_kwargs

    qwen3.answer = lambda p: "Four."
    closed = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    r = qwen3.client.chat.completions.create(model="m", messages=SUM, extra_body=NO_THINKING)
    assert r.choices[0].message.content == "Four." and "reasoning_content" not in r.choices[0].message.model_extra
    assert prompt_text(qwen3).endswith(closed)
    msg = litellm.completion(extra_body=NO_THINKING, **kw).choices[0].message
    assert msg.content == "Four." and not getattr(msg, "reasoning_content", None)
    assert prompt_text(qwen3).endswith(closed)
    assert chat_model(langchain, qwen3.url, "m", extra_body=NO_THINKING).invoke(SUM[0]["content"]).content == "Four."
    assert prompt_text(qwen3).endswith(closed)


def test_async_clients_stream_the_call(qwen3, litellm, langchain):
    """The asynchronous clients, as agents and litellm's proxy run them (litellm's over aiohttp):
    streamed, each assembles the call its synchronous twin gets."""
    import asyncio

    import openai
    answer_to_tool_result(qwen3)
    want = [("get_weather", {"city": "Paris", "days": 2})]

    async def run():
        calls = {}
        async with openai.AsyncOpenAI(base_url=qwen3.url, api_key="none", max_retries=0, timeout=300) as client:
            async with client.chat.completions.stream(model="m", messages=ASK, tools=WEATHER) as s:
                msg = (await s.get_final_completion()).choices[0].message
        calls["openai"] = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
        chunks = [c async for c in await litellm.acompletion(model="openai/m", api_base=qwen3.url, api_key="none",
                                                             messages=ASK, tools=WEATHER, stream=True)]
        msg = litellm.stream_chunk_builder(chunks, messages=ASK).choices[0].message
        calls["litellm"] = [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls]
        chunks = [c async for c in chat_model(langchain, qwen3.url, "m").bind_tools(WEATHER).astream(ASK)]
        calls["langchain"] = [(c["name"], c["args"]) for c in sum(chunks[1:], chunks[0]).tool_calls]
        return calls
    assert asyncio.run(run()) == {"openai": want, "litellm": want, "langchain": want}


# -- chat, completions, streaming and structured output (the embedded Gemma 3) ----------------------
def test_openai_chat_completions_and_streams(client, model, expected):
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk
    r = client.chat.completions.create(model=model, messages=RIVERS, max_tokens=SHORT, temperature=0)
    assert isinstance(r, ChatCompletion) and r.choices[0].message.content == expected["chat"]
    assert r.usage.completion_tokens == SHORT and r.choices[0].finish_reason == "length"
    chunks = list(client.chat.completions.create(model=model, messages=RIVERS, max_tokens=SHORT, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert all(isinstance(c, ChatCompletionChunk) for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected["chat"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == SHORT

    c = client.completions.create(model=model, prompt=STORY, max_tokens=SHORT, temperature=0)
    assert isinstance(c, Completion) and c.choices[0].text == expected["completion"]
    pieces = list(client.completions.create(model=model, prompt=STORY, max_tokens=SHORT, temperature=0, stream=True))
    assert all(isinstance(p, Completion) for p in pieces)
    assert "".join(p.choices[0].text for p in pieces) == expected["completion"]


def test_openai_structured_output_from_a_pydantic_model(client, model):
    """`chat.completions.parse` and the streaming helper, both with `response_format=Person`."""
    r = client.chat.completions.parse(model=model, messages=ASK_PERSON, response_format=Person, max_tokens=40,
                                      temperature=0)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Person)
    assert the_person(msg.content) == msg.parsed
    with client.chat.completions.stream(model=model, messages=ASK_PERSON, response_format=Person, max_tokens=40,
                                        temperature=0) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.parsed == msg.parsed


def test_litellm_chat_completions_and_streams(model, gemma, litellm, expected):
    kw = {"model": f"openai/{model}", "api_base": gemma.url + "/v1", "api_key": API_KEY, "max_tokens": SHORT,
          "temperature": 0}
    r = litellm.completion(messages=RIVERS, **kw)
    assert isinstance(r, litellm.ModelResponse) and r.choices[0].message.content == expected["chat"]
    assert r.usage.completion_tokens == SHORT
    chunks = list(litellm.completion(messages=RIVERS, stream=True, stream_options={"include_usage": True}, **kw))
    assert all(isinstance(c, litellm.ModelResponseStream) for c in chunks)
    built = litellm.stream_chunk_builder(chunks, messages=RIVERS)
    assert built.choices[0].message.content == expected["chat"] and built.usage.completion_tokens == SHORT

    c = litellm.text_completion(prompt=STORY, **kw)
    assert isinstance(c, litellm.TextCompletionResponse) and c.choices[0].text == expected["completion"]
    pieces = list(litellm.text_completion(prompt=STORY, stream=True, **kw))
    assert "".join(p.choices[0].text or "" for p in pieces if p.choices) == expected["completion"]


def test_litellm_structured_output(model, gemma, litellm):
    """`response_format` as an OpenAI json_schema object, and as a pydantic model litellm converts."""
    kw = {"model": f"openai/{model}", "api_base": gemma.url + "/v1", "api_key": API_KEY, "max_tokens": 40,
          "temperature": 0, "messages": ASK_PERSON}
    schema = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    for response_format in (schema, Person):
        r = litellm.completion(response_format=response_format, **kw)
        assert isinstance(r, litellm.ModelResponse) and r.choices[0].finish_reason == "stop"
        the_person(r.choices[0].message.content)


def test_langchain_chat_completions_and_streams(model, gemma, langchain, expected):
    from langchain_core.messages import AIMessage, AIMessageChunk
    llm = chat_model(langchain, gemma.url + "/v1", model, API_KEY, max_tokens=SHORT, stream_usage=True)
    ai = llm.invoke(RIVERS[0]["content"])
    assert isinstance(ai, AIMessage) and ai.content == expected["chat"]
    assert ai.usage_metadata["output_tokens"] == SHORT and ai.response_metadata["finish_reason"] == "length"
    chunks = list(llm.stream(RIVERS[0]["content"]))
    assert all(isinstance(c, AIMessageChunk) for c in chunks)
    whole = sum(chunks[1:], chunks[0])
    assert whole.content == expected["chat"] and whole.usage_metadata["output_tokens"] == SHORT

    text = langchain.OpenAI(model=model, base_url=gemma.url + "/v1", api_key=API_KEY, max_tokens=SHORT, temperature=0,
                            max_retries=0, timeout=300)
    assert text.invoke(STORY) == expected["completion"]
    assert "".join(text.stream(STORY)) == expected["completion"]


def test_langchain_structured_output(model, gemma, langchain):
    """`with_structured_output(Person, method="json_schema")`, with the raw AIMessage beside."""
    from langchain_core.messages import AIMessage
    llm = chat_model(langchain, gemma.url + "/v1", model, API_KEY, max_tokens=40)
    out = llm.with_structured_output(Person, method="json_schema", include_raw=True).invoke(ASK_PERSON[0]["content"])
    assert out["parsing_error"] is None and isinstance(out["parsed"], Person)
    assert isinstance(out["raw"], AIMessage) and out["raw"].response_metadata["finish_reason"] == "stop"
    assert the_person(out["raw"].content) == out["parsed"]


# -- the servers' side ------------------------------------------------------------------------------
def failures(url: str) -> dict[str, float]:
    """jaxllm:request_failure_total by reason, from /metrics."""
    out = {}
    for line in httpx.get(url + "/metrics", timeout=30).text.splitlines():
        if line.startswith("jaxllm:request_failure_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


def test_no_request_failed_and_nothing_left_the_machine(gemma, qwen3, server_errors, lookups_refused):
    """No 5xx (a 500 logs its traceback; the other 5xx count as errors or timeouts), and no
    client looked up a name off the loopback."""
    for url in (gemma.url, qwen3.server.url):
        assert failures(url) == {"abort": 0.0, "timeout": 0.0, "error": 0.0}
    log = gemma.output()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
    assert server_errors == []
    assert lookups_refused == []
