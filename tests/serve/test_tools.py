"""Reading chat answers: tool calls in the Qwen3 and Gemma 4 formats (well-formed, several, and
malformed ones, which come back as content), reasoning blocks, and the same parts whether the
text arrives whole, split at any character, or a character at a time."""
from __future__ import annotations

import json

import pytest

from jaxllm.serve.output import OutputPlan, chat_features
from jaxllm.serve.tools import tool_format

QWEN3, GEMMA4 = chat_features("qwen3"), chat_features("gemma4")
Q = '<|"|>'


def plan(features, tools=True, reasoning=False, **kw) -> OutputPlan:
    return OutputPlan(tools=features.tools if tools else None, reasoning=features.reasoning if reasoning else None,
                      **kw)


def summary(parts):
    return parts.reasoning, parts.content, [(c.name, json.loads(c.arguments)) for c in parts.calls]


def read(p: OutputPlan, pieces: list[str]):
    r = p.reader()
    out = r.push(pieces[0])
    for s in pieces[1:]:
        out.add(r.push(s))
    out.add(r.finish())
    return summary(out)


def check_streaming(p: OutputPlan, text: str):
    """Whole, split in two at every character, and a character at a time: the same parts."""
    whole = read(p, [text])
    for i in range(len(text) + 1):
        assert read(p, [text[:i], text[i:]]) == whole, i
    assert read(p, list(text) or [""]) == whole
    return whole


def qcall(name, args, raw=None) -> str:
    return "<tool_call>\n" + (raw or json.dumps({"name": name, "arguments": args})) + "\n</tool_call>"


QWEN3_CASES = [  # (output, content, calls)
    (qcall("get_weather", {"city": "Paris", "days": 2}), "", [("get_weather", {"city": "Paris", "days": 2})]),
    ("Let me look.\n\n" + qcall("a", {"x": [1, {"y": None}]}) + "\n" + qcall("b", {}) + "\n",
     "Let me look.", [("a", {"x": [1, {"y": None}]}), ("b", {})]),
    # arguments given as a JSON string are read as the object they hold
    (qcall("", {}, raw='{"name": "f", "arguments": "{\\"k\\": \\"v\\"}"}'), "", [("f", {"k": "v"})]),
    # malformed calls are content, unchanged
    (qcall("", {}, raw='{"name": "f", "arguments": {"k": }}'), qcall("", {}, raw='{"name": "f", "arguments": {"k": }}'),
     []),
    (qcall("", {}, raw='{"arguments": {}}'), qcall("", {}, raw='{"arguments": {}}'), []),
    (qcall("", {}, raw='{"name": "f", "arguments": [1]}'), qcall("", {}, raw='{"name": "f", "arguments": [1]}'), []),
    (qcall("", {}, raw='{"name": "f", "args": {}}'), qcall("", {}, raw='{"name": "f", "args": {}}'), []),
    ('Sure.\n<tool_call>\n{"name": "f", "arguments": {"k": 1}}', 'Sure.\n<tool_call>\n{"name": "f", "arguments": {"k": 1}}',
     []),                                                      # the output ended inside the call
    # a good call beside a broken one: the good one is a call, the broken one content
    (qcall("ok", {"n": 1}) + "\n" + qcall("", {}, raw="not json"), qcall("", {}, raw="not json"), [("ok", {"n": 1})]),
    ("No tools needed: 2 < 3 and <tool is a word.", "No tools needed: 2 < 3 and <tool is a word.", []),
]


@pytest.mark.parametrize("case", range(len(QWEN3_CASES)))
def test_qwen3_tool_calls(case):
    text, content, calls = QWEN3_CASES[case]
    assert check_streaming(plan(QWEN3), text) == ("", content, calls)


def gcall(name, body) -> str:
    return f"<|tool_call>call:{name}{{{body}}}<tool_call|>"


GEMMA4_CASES = [
    (gcall("get_weather", f"location:{Q}Paris, France{Q},unit:{Q}celsius{Q}"), "",
     [("get_weather", {"location": "Paris, France", "unit": "celsius"})]),
    # every kind of value, nested; keys quoted or bare; strings holding the syntax's own characters
    (gcall("f", f"n:42,x:-2.5,e:1e-05,t:true,f:false,z:null,s:{Q}a{{b}}:[c],d{Q},"
                f"xs:[1,{Q}two{Q},[3],{{k:{Q}v{Q}}}],o:{{{Q}inner key{Q}:{{deep:[]}}}},empty:{{}}"), "",
     [("f", {"n": 42, "x": -2.5, "e": 1e-05, "t": True, "f": False, "z": None, "s": "a{b}:[c],d",
             "xs": [1, "two", [3], {"k": "v"}], "o": {"inner key": {"deep": []}}, "empty": {}})]),
    ("Checking both." + gcall("a", f"q:{Q}x{Q}") + gcall("b-2.v", ""), "Checking both.",
     [("a", {"q": "x"}), ("b-2.v", {})]),
    (gcall("f", f"a:{Q}unterminated"), gcall("f", f"a:{Q}unterminated"), []),
    (gcall("f", "a:1,b"), gcall("f", "a:1,b"), []),                    # a key without a value
    ("<|tool_call>f{a:1}<tool_call|>", "<|tool_call>f{a:1}<tool_call|>", []),     # no call:
    (gcall("f", "a:{b:1") , gcall("f", "a:{b:1"), []),                 # an object left open
    ("<|tool_call>call:f{a:1}} trailing<tool_call|>", "<|tool_call>call:f{a:1}} trailing<tool_call|>", []),
    ("<|tool_call>call:f{a:1}", "<|tool_call>call:f{a:1}", []),        # the output ended inside the call
]


@pytest.mark.parametrize("case", range(len(GEMMA4_CASES)))
def test_gemma4_tool_calls(case):
    text, content, calls = GEMMA4_CASES[case]
    assert check_streaming(plan(GEMMA4), text) == ("", content, calls)


def test_only_the_first_call_without_parallel_calls():
    text = qcall("a", {}) + qcall("b", {"k": 1})
    assert read(plan(QWEN3, parallel=False), [text]) == ("", "", [("a", {})])
    assert read(plan(QWEN3), [text]) == ("", "", [("a", {}), ("b", {"k": 1})])


def test_forced_call_prefix_is_read_with_the_answer():
    """tool_choice "required" / named: the prompt ends inside a call; the answer goes on from there."""
    fmt = tool_format("qwen3")
    named = fmt.forced_prefix("get_weather")
    assert named == '<tool_call>\n{"name": "get_weather", "arguments": '
    assert check_streaming(plan(QWEN3, prefix=named), '{"city": "Oslo"}}\n</tool_call>') == \
        ("", "", [("get_weather", {"city": "Oslo"})])
    assert check_streaming(plan(QWEN3, prefix=fmt.forced_prefix(None)), '{"name": "f", "arguments": {}}\n</tool_call>') \
        == ("", "", [("f", {})])
    g = tool_format("gemma4")
    assert check_streaming(plan(GEMMA4, prefix=g.forced_prefix("f")), f"a:{Q}b{Q}}}<tool_call|>") == \
        ("", "", [("f", {"a": "b"})])


REASONING_CASES = [  # (features, output, open, reasoning, content)
    (QWEN3, "<think>\nFirst this.\n\nThen that.\n</think>\n\nThe answer.", False, "First this.\n\nThen that.",
     "The answer."),
    (QWEN3, "\n<think>\nShort.</think>Answer <think> stays.", False, "Short.", "Answer <think> stays."),
    (QWEN3, "Plain answer, no block.", False, "", "Plain answer, no block."),
    (QWEN3, "<thinking is a word", False, "", "<thinking is a word"),
    (QWEN3, "<think>\nCut off by the token limit\n", False, "Cut off by the token limit", ""),
    (QWEN3, "Already inside.\n</think>\n\nAnswer.", True, "Already inside.", "Answer."),   # the prompt opened it
    (GEMMA4, "<|channel>thought\nPlan it.<channel|>Done.", False, "Plan it.", "Done."),
    (GEMMA4, "<|channel>thoughtful\nword<channel|>x", False, "thoughtful\nword", "x"),
]


@pytest.mark.parametrize("case", range(len(REASONING_CASES)))
def test_reasoning(case):
    features, text, open_, reasoning, content = REASONING_CASES[case]
    p = plan(features, tools=False, reasoning=True, thinking_open=open_)
    assert check_streaming(p, text) == (reasoning, content, [])


def test_reasoning_then_tool_calls_then_trimmed_content():
    text = "<think>\nNeed data.\n</think>\n\nOne moment.\n" + qcall("f", {"a": 1}) + "\n\nAnd <tool_call>broken"
    assert check_streaming(plan(QWEN3, reasoning=True), text) == \
        ("Need data.", "One moment.\n\n\nAnd <tool_call>broken", [("f", {"a": 1})])
    # a call inside the reasoning is reasoning, not a call
    text = "<think>\n" + qcall("f", {}) + "\n</think>\n\nNo."
    assert check_streaming(plan(QWEN3, reasoning=True), text) == (qcall("f", {}), "No.", [])
