"""Chat features of the server, through the official openai client against live servers of tiny
Qwen3 and Gemma 4 checkpoints saved with the families' real chat templates: tool calls (a whole
round trip, streamed deltas, tool_choice, malformed calls), reasoning, enable_thinking,
/tokenize and /detokenize, and the 400s for bad input.

The answers are scripted (`tiny_chat.ScriptedEngine`): each test says what the model answers to a
prompt, and the prompt the server rendered is checked against the template's own rendering.
"""
from __future__ import annotations

import json

import httpx
import openai
import pytest
import tiny_chat

import jaxllm

MAX_LEN = 2048
WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]}}}]
TOOLS = WEATHER + [{"type": "function", "function": {"name": "get_time", "parameters": {"type": "object",
                                                                                        "properties": {}}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


class Scripted:
    """A live server whose model answers `answer(prompt_text) -> text` (the test sets it)."""

    def __init__(self, model_dir):
        self.engine = jaxllm.load(str(model_dir), quant="none", dtype="float32", max_ctx=MAX_LEN)
        self.tok = self.engine.tokenizer
        self.answer = lambda prompt: "Hello."
        self.double = tiny_chat.ScriptedEngine(self.engine, self.reply)
        self.server = tiny_chat.LiveServer(self.double, max_model_len=MAX_LEN, max_num_seqs=4)
        self.client = self.server.client()

    def reply(self, ids):
        text = self.answer(self.tok.decode(ids, skip_special=False))
        return self.tok.encode(text, add_special=False) + [self.engine.cfg.eos_ids[0]]

    def last_prompt(self) -> list[int]:
        return self.double.cores[0].prompts[-1]

    def chat(self, **kw):
        return self.client.chat.completions.create(model="m", temperature=0, **kw)

    def stream(self, **kw):
        """-> (reasoning, content, tool calls by index as dicts, finish reason, the chunks' deltas)."""
        reasoning, content, calls, finish, deltas = "", "", {}, None, []
        for chunk in self.chat(stream=True, **kw):
            c = chunk.choices[0]
            deltas.append(c.delta)
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            content += c.delta.content or ""
            for t in c.delta.tool_calls or []:
                call = calls.setdefault(t.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or t.id
                call["name"] += t.function.name or ""
                call["arguments"] += t.function.arguments or ""
            finish = c.finish_reason or finish
        return reasoning, content, calls, finish, deltas

    def post(self, path, body):
        return httpx.post(self.server.url + path, json=body, timeout=60)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    s = Scripted(tiny_chat.make_qwen3(tmp_path_factory.mktemp("qwen3_chat")))
    yield s
    s.server.stop()


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory):
    s = Scripted(tiny_chat.make_gemma4(tmp_path_factory.mktemp("gemma4_chat")))
    yield s
    s.server.stop()


def calls_of(message) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls or []]


def with_dict_arguments(messages: list[dict]) -> list[dict]:
    """Messages as the template sees them: tool-call arguments as objects, as transformers passes them."""
    out = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
                "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        out.append(m)
    return out


# -- Qwen3 ------------------------------------------------------------------------------------------
QWEN3_CALL = ('<think>\nThe user wants the weather; I will call the tool.\n</think>\n\n'
              '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>')


def test_qwen3_tool_call_round_trip(qwen3):
    qwen3.answer = lambda p: ("<think>\nThe tool says sunny.\n</think>\n\nIt is sunny in Paris."
                              if "<tool_response>" in p else QWEN3_CALL)
    r = qwen3.chat(messages=ASK, tools=TOOLS)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls"
    assert calls_of(msg) == [("get_weather", {"city": "Paris", "days": 2})]
    assert msg.tool_calls[0].type == "function" and msg.tool_calls[0].id.startswith("call_")
    assert msg.content is None and msg.reasoning_content == "The user wants the weather; I will call the tool."
    # the prompt is the template's rendering of the messages with the tools
    assert qwen3.last_prompt() == qwen3.tok.encode(qwen3.tok.render_chat(ASK, tools=TOOLS), add_special=False)
    assert r.usage.prompt_tokens == len(qwen3.last_prompt())

    call = msg.tool_calls[0]
    history = ASK + [msg.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": '{"sky": "sunny", "temp": 21}'}]
    r2 = qwen3.chat(messages=history, tools=TOOLS)
    assert r2.choices[0].finish_reason == "stop" and not r2.choices[0].message.tool_calls
    assert r2.choices[0].message.content == "It is sunny in Paris."
    assert r2.choices[0].message.reasoning_content == "The tool says sunny."
    sent = with_dict_arguments(history)
    want = qwen3.tok.render_chat(sent, tools=TOOLS)
    assert qwen3.last_prompt() == qwen3.tok.encode(want, add_special=False)
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>'
            '<|im_end|>\n<|im_start|>user\n<tool_response>\n{"sky": "sunny", "temp": 21}\n</tool_response>') in want
    assert "<think>\nThe user wants the weather; I will call the tool.\n</think>" in want   # reasoning sent back


def test_qwen3_streamed_tool_calls(qwen3):
    qwen3.answer = lambda p: ("I will check both.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                              "{\"city\": \"Oslo\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", "
                              "\"arguments\": {}}\n</tool_call>")
    whole = qwen3.chat(messages=ASK, tools=TOOLS, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert whole.choices[0].message.content == "I will check both."
    reasoning, content, calls, finish, deltas = qwen3.stream(messages=ASK, tools=TOOLS,
                                                             extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert (reasoning, content, finish) == ("", "I will check both.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == calls_of(whole.choices[0].message)
    assert list(calls) == [0, 1] and all(c["id"].startswith("call_") for c in calls.values())
    firsts = [d.tool_calls[0] for d in deltas if d.tool_calls and d.tool_calls[0].id]
    assert [(t.index, t.type, t.function.name, t.function.arguments) for t in firsts] == \
        [(0, "function", "get_weather", ""), (1, "function", "get_time", "")]
    # content before the calls came as content deltas, none carrying any part of a call's marker
    assert all("<" not in (d.content or "") for d in deltas)


def test_qwen3_malformed_call_is_content(qwen3):
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>'
    qwen3.answer = lambda p: bad
    kw = {"messages": ASK, "tools": TOOLS, "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    r = qwen3.chat(**kw)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content == bad
    assert qwen3.stream(**kw)[1:4] == (bad, {}, "stop")


def test_qwen3_tool_choice(qwen3):
    """none: no tools in the prompt, nothing parsed; required and named: the prompt ends inside a
    call, so the answer goes on from it; parallel_tool_calls false keeps one call."""
    off = {"chat_template_kwargs": {"enable_thinking": False}}
    qwen3.answer = lambda p: '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    r = qwen3.chat(messages=ASK, tools=TOOLS, tool_choice="none", extra_body=off)
    assert r.choices[0].message.content == qwen3.answer("") and not r.choices[0].message.tool_calls
    assert "# Tools" not in qwen3.tok.decode(qwen3.last_prompt(), skip_special=False)

    qwen3.answer = lambda p: '{"name": "get_time", "arguments": {}}\n</tool_call>'
    r = qwen3.chat(messages=ASK, tools=TOOLS, tool_choice="required", extra_body=off)
    assert calls_of(r.choices[0].message) == [("get_time", {})] and r.choices[0].finish_reason == "tool_calls"
    assert qwen3.tok.decode(qwen3.last_prompt(), skip_special=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n")

    qwen3.answer = lambda p: '{"city": "Rome"}}\n</tool_call>'
    r = qwen3.chat(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Rome"})]
    assert qwen3.tok.decode(qwen3.last_prompt(), skip_special=False).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": ')
    calls = qwen3.stream(messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_weather"}})[2]
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [("get_weather", '{"city": "Rome"}')]

    qwen3.answer = lambda p: QWEN3_CALL + '\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    assert len(qwen3.chat(messages=ASK, tools=TOOLS).choices[0].message.tool_calls) == 2
    r = qwen3.chat(messages=ASK, tools=TOOLS, parallel_tool_calls=False)
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Paris", "days": 2})]


def test_qwen3_reasoning_and_enable_thinking(qwen3):
    qwen3.answer = lambda p: "<think>\nTwo and two.\n</think>\n\nFour."
    r = qwen3.chat(messages=[{"role": "user", "content": "2+2?"}])
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Two and two.", "Four.")
    reasoning, content, _, finish, deltas = qwen3.stream(messages=[{"role": "user", "content": "2+2?"}])
    assert (reasoning, content, finish) == ("Two and two.", "Four.", "stop")
    assert any(getattr(d, "reasoning_content", None) for d in deltas) and any(d.content for d in deltas)
    assert qwen3.tok.decode(qwen3.last_prompt(), skip_special=False).endswith("<|im_start|>assistant\n")

    # thinking off: the template closes an empty block in the prompt, and the answer is all content
    qwen3.answer = lambda p: "Four. <think>not a block here</think>"
    r = qwen3.chat(messages=[{"role": "user", "content": "2+2?"}],
                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert r.choices[0].message.content == "Four. <think>not a block here</think>"
    assert getattr(r.choices[0].message, "reasoning_content", None) is None
    assert qwen3.tok.decode(qwen3.last_prompt(), skip_special=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n")

    # OpenAI's reasoning_effort: "none" is thinking off, as above; any other effort is thinking on
    qwen3.chat(messages=[{"role": "user", "content": "2+2?"}], reasoning_effort="none")
    assert qwen3.tok.decode(qwen3.last_prompt(), skip_special=False).endswith("<think>\n\n</think>\n\n")
    qwen3.answer = lambda p: "<think>\nTwo and two.\n</think>\n\nFour."
    r = qwen3.chat(messages=[{"role": "user", "content": "2+2?"}], reasoning_effort="high")
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Two and two.", "Four.")
    assert qwen3.tok.decode(qwen3.last_prompt(), skip_special=False).endswith("<|im_start|>assistant\n")

    # the token limit inside the block: all reasoning so far, no content
    qwen3.answer = lambda p: "<think>\n" + "step " * 50
    r = qwen3.chat(messages=[{"role": "user", "content": "2+2?"}], max_tokens=20)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content is None
    assert r.choices[0].message.reasoning_content.startswith("step step")


def test_completions_are_not_parsed(qwen3):
    qwen3.answer = lambda p: QWEN3_CALL
    r = qwen3.client.completions.create(model="m", prompt="Weather?", max_tokens=200, temperature=0)
    assert r.choices[0].text == QWEN3_CALL


# -- Gemma 4 ----------------------------------------------------------------------------------------
Q = '<|"|>'
GEMMA4_CALL = f"<|tool_call>call:get_weather{{city:{Q}Paris{Q},days:2}}<tool_call|>"


def test_gemma4_tool_call_round_trip(gemma4):
    """The markers are special tokens: the answer is decoded with them, and `<|tool_response>` (an
    end-of-turn id of Gemma 4's) ends the call's turn."""
    gemma4.answer = lambda p: "It is sunny in Paris." if "<|tool_response>response:" in p else \
        GEMMA4_CALL + "<|tool_response>"
    r = gemma4.chat(messages=ASK, tools=TOOLS)
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    assert calls_of(r.choices[0].message) == [("get_weather", {"city": "Paris", "days": 2})]
    assert gemma4.last_prompt() == gemma4.tok.encode(gemma4.tok.render_chat(ASK, tools=TOOLS), add_special=False)
    assert "<|tool>declaration:get_weather{" in gemma4.tok.decode(gemma4.last_prompt(), skip_special=False)

    call = r.choices[0].message.tool_calls[0]
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "sunny"}]
    r2 = gemma4.chat(messages=history, tools=TOOLS)
    assert (r2.choices[0].message.content, r2.choices[0].finish_reason) == ("It is sunny in Paris.", "stop")
    want = gemma4.tok.render_chat(with_dict_arguments(history), tools=TOOLS)
    assert gemma4.last_prompt() == gemma4.tok.encode(want, add_special=False)
    assert want.endswith(f"{GEMMA4_CALL}<|tool_response>response:get_weather{{value:{Q}sunny{Q}}}<tool_response|>")


def test_gemma4_streamed_and_malformed_calls(gemma4):
    two = "Checking." + GEMMA4_CALL + "<|tool_call>call:get_time{}<tool_call|>"
    gemma4.answer = lambda p: two
    reasoning, content, calls, finish, _ = gemma4.stream(messages=ASK, tools=TOOLS)
    assert (reasoning, content, finish) == ("", "Checking.", "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == \
        [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {})]
    bad = f"<|tool_call>call:get_weather{{city:{Q}Paris}}<tool_call|>"        # the string never ends
    gemma4.answer = lambda p: bad
    r = gemma4.chat(messages=ASK, tools=TOOLS)
    assert (r.choices[0].message.content, r.choices[0].finish_reason) == (bad, "stop")
    assert gemma4.stream(messages=ASK, tools=TOOLS)[1:4] == (bad, {}, "stop")


def test_gemma4_thinking(gemma4):
    gemma4.answer = lambda p: "<|channel>thought\nAdd them.<channel|>Four."
    kw = {"messages": [{"role": "user", "content": "2+2?"}], "extra_body": {"chat_template_kwargs": {"enable_thinking": True}}}
    r = gemma4.chat(**kw)
    assert (r.choices[0].message.reasoning_content, r.choices[0].message.content) == ("Add them.", "Four.")
    assert "<|think|>" in gemma4.tok.decode(gemma4.last_prompt(), skip_special=False)
    assert gemma4.stream(**kw)[:2] == ("Add them.", "Four.")
    # thinking is off by default in Gemma 4's template; plain chat is decoded as before
    gemma4.answer = lambda p: "Four."
    r = gemma4.chat(messages=[{"role": "user", "content": "2+2?"}])
    assert r.choices[0].message.content == "Four." and getattr(r.choices[0].message, "reasoning_content", None) is None


# -- /tokenize, /detokenize, /v1/models -------------------------------------------------------------
def test_tokenize_and_detokenize(qwen3):
    text = "Hello <|im_start|> café 東京"
    r = qwen3.post("/tokenize", {"prompt": text}).json()
    assert r == {"count": len(r["tokens"]), "max_model_len": MAX_LEN, "tokens": qwen3.tok.encode(text),
                 "token_strs": None}
    assert qwen3.post("/detokenize", {"tokens": r["tokens"]}).json() == {"prompt": text}
    strs = qwen3.post("/tokenize", {"prompt": "ab", "return_token_strs": True, "model": "m"}).json()["token_strs"]
    assert strs == ["a", "b"]

    # a chat tokenizes as the chat route renders it: the count is the request's prompt_tokens
    qwen3.answer = lambda p: "Hi."
    body = {"messages": ASK, "tools": TOOLS, "chat_template_kwargs": {"enable_thinking": False}}
    r = qwen3.post("/tokenize", body).json()
    usage = qwen3.chat(messages=ASK, tools=TOOLS, extra_body={"chat_template_kwargs": {"enable_thinking": False}}).usage
    assert r["count"] == usage.prompt_tokens and r["tokens"] == qwen3.last_prompt()
    no_gen = qwen3.post("/tokenize", {**body, "add_generation_prompt": False}).json()
    assert qwen3.tok.decode(no_gen["tokens"], skip_special=False).endswith("Paris?<|im_end|>\n")

    models = qwen3.client.models.list().data
    assert [(m.id, m.max_model_len) for m in models] == [("m", MAX_LEN)]


# -- bad input: a 400 naming the problem, and the server keeps serving ------------------------------
CALLED = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
BAD = [  # (path, body, words the message must contain)
    ("/v1/chat/completions", {"messages": ASK, "tools": {"type": "function"}}, "'tools' must be a list"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {"name": "bad name!"}}]},
     "tools[0].function.name"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "retrieval"}]}, "tools[0]"),
    ("/v1/chat/completions", {"messages": ASK, "tools": WEATHER + WEATHER}, "a second function"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "strict": True}}]}, "strict"),
    ("/v1/chat/completions", {"messages": ASK, "tools": [{"type": "function", "function": {
        "name": "f", "parameterz": {}}}]}, "tools[0].function.parameterz"),
    ("/v1/chat/completions", {"messages": ASK, "tool_choice": "required"}, "needs 'tools'"),
    ("/v1/chat/completions", {"messages": ASK, "tools": WEATHER, "tool_choice": "always"}, "'tool_choice' must be"),
    ("/v1/chat/completions", {"messages": ASK, "tools": WEATHER,
                              "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "not in 'tools'"),
    ("/v1/chat/completions", {"messages": ASK, "tools": WEATHER, "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ("/v1/chat/completions", {"messages": ASK + [CALLED, {"role": "tool", "content": "x"}]}, "tool_call_id"),
    ("/v1/chat/completions", {"messages": ASK + [{**CALLED, "tool_calls": [{**CALLED["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": "{city"}}]}]}, "arguments must be a JSON object"),
    ("/v1/chat/completions", {"messages": ASK + [{"role": "tool", "tool_call_id": "c1", "content": 5}]},
     "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "tool_call_id": "c"}]},
     "unknown field 'tool_call_id'"),
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"enable_thinking": "no"}}, "enable_thinking"),
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": {"reasoning_effort": "high"}},
     "chat_template_kwargs.reasoning_effort"),
    ("/v1/chat/completions", {"messages": ASK, "chat_template_kwargs": []}, "'chat_template_kwargs' must be"),
    ("/v1/chat/completions", {"messages": ASK, "tools": WEATHER, "response_format": {"type": "json_object"}},
     "cannot be combined with 'tools'"),
    ("/tokenize", {"prompt": "x", "messages": ASK}, "one of 'prompt'"),
    ("/tokenize", {}, "one of 'prompt'"),
    ("/tokenize", {"prompt": ["x"]}, "'prompt' must be a string"),
    ("/tokenize", {"prompt": "x", "tools": WEATHER}, "'tools' applies to 'messages' only"),
    ("/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ("/tokenize", {"prompt": "x", "truncate": 4}, "unknown field 'truncate'"),
    ("/tokenize", {"messages": []}, "non-empty"),
    ("/detokenize", {"tokens": [1, 10 ** 6]}, "must lie in"),
    ("/detokenize", {"tokens": "1 2"}, "'tokens' must be a list"),
    ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, "unknown field 'skip_special_tokens'"),
]


@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_chat_input_gets_400(qwen3, case):
    path, body, words = BAD[case]
    r = qwen3.post(path, body)
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.json()
    qwen3.answer = lambda p: "Fine."
    assert qwen3.chat(messages=ASK, max_tokens=8).choices[0].message.content == "Fine."


def test_unknown_model_on_tokenize_is_404(qwen3):
    assert qwen3.post("/tokenize", {"prompt": "x", "model": "other"}).status_code == 404
    with pytest.raises(openai.NotFoundError):
        qwen3.client.chat.completions.create(model="other", messages=ASK)


def test_a_template_without_tools_refuses_them():
    """A Gemma 4 checkpoint without its own chat template gets the built-in turn-only one, which
    has no place for tools or thinking: both are refused rather than dropped."""
    from types import SimpleNamespace

    from jaxllm.model.families import gemma4
    from jaxllm.serve.chat import chat_prompt
    from jaxllm.serve.fields import ApiError
    from jaxllm.serve.output import chat_features
    from jaxllm.tokenizer import Tokenizer
    eng = SimpleNamespace(tokenizer=Tokenizer(None, chat_template=gemma4.CHAT_TEMPLATE))
    with pytest.raises(ApiError, match="does not render tools"):
        chat_prompt({"messages": ASK, "tools": WEATHER}, eng, chat_features("gemma4"))
    with pytest.raises(ApiError, match="does not read 'enable_thinking'"):
        chat_prompt({"messages": ASK, "chat_template_kwargs": {"enable_thinking": True}}, eng, chat_features("gemma4"))
