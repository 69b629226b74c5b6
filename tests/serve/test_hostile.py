"""Hostile and edge-case requests against one server process on the embedded model: every one is
answered by a 4xx with OpenAI's error body (a one-line message, the field named where one is at
fault) or by a correct 200, never a 5xx; the server stays healthy and its log holds no traceback.
The named refusals of tests/serve/test_server.py's BAD table are not repeated here."""
from __future__ import annotations

import concurrent.futures
import time

import httpx
import pytest
from test_server import ServerProcess

MAX_LEN = 256
SECRET = "sk-do-not-log-7f3a"
HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    p = ServerProcess(None, tmp_path_factory.mktemp("hostile_logs") / "server.log", "--no-warmup",
                      "--max-num-seqs", "2", "--max-model-len", str(MAX_LEN), access_log=True)
    try:
        yield p.wait_ready()
    finally:
        p.terminate()
    log = p.log_path.read_text()          # read after exit: the access log is flushed then
    assert "Traceback" not in log, log[-3000:]
    assert SECRET not in log and "api_key=[redacted]" in log, log[-3000:]


class Case:
    """A request and what it must get: `status` (None: a 4xx or a correct 200), `param` (the field a
    400 names), `words` (in the message)."""

    def __init__(self, name, path, body, status=None, param=None, words=None, headers=None):
        self.name, self.path, self.body, self.status = name, path, body, status
        self.param, self.words, self.headers = param, words, headers


def comp(**kw):
    return {"prompt": "Hi", "max_tokens": 2, **kw}


def chat(**kw):
    return {"messages": HI, "max_tokens": 2, **kw}


def resp(**kw):
    return {"input": "Hi", "max_output_tokens": 2, **kw}


# -- generated: each field against values of every wrong type and range ----------------------------
WRONG = {"a string": "1", "a list": [1], "an object": {"a": 1}, "true": True, "a float": 1.5, "-1": -1,
         "2**64": 2 ** 64, "1e308": 1e308, "NUL": "\x00"}
FIELDS = {   # field -> the values above it takes (a 200)
    "max_tokens": (), "temperature": ("a float", "2**64", "1e308"), "top_p": (), "top_k": ("-1", "2**64"),
    "min_p": (), "seed": ("-1",), "n": (), "presence_penalty": ("-1", "a float"),
    "frequency_penalty": ("-1", "a float"), "repetition_penalty": ("a float", "2**64", "1e308"),
    "min_tokens": (), "stop": ("a string", "NUL"), "stop_token_ids": ("a list",), "logit_bias": (),
    "ignore_eos": ("true",), "skip_special_tokens": ("true",), "include_stop_str_in_output": ("true",),
    "spaces_between_special_tokens": ("true",), "truncate_prompt_tokens": ("-1", "2**64"), "prompt_logprobs": (),
    "user": ("a string", "NUL"), "response_format": (), "stream": ("true",), "stream_options": (),
    "guided_regex": ("a string", "NUL"), "guided_choice": (), "guided_grammar": (),
    "guided_json": ("an object",),     # {"a": 1}: a schema whose unknown keyword llguidance ignores
}
COMPLETION_ONLY = {"logprobs": (), "echo": ("true",), "best_of": (), "suffix": ()}
CHAT_ONLY = {"logprobs": ("true",), "top_logprobs": (), "max_completion_tokens": (), "tools": (), "tool_choice": (),
             "parallel_tool_calls": ("true",), "reasoning_effort": (), "chat_template_kwargs": (), "modalities": (),
             "metadata": (), "store": ("true",), "service_tier": ("a string", "NUL")}


def field_cases():
    out = []
    for route, base, fields in (("/v1/completions", comp, {**FIELDS, **COMPLETION_ONLY}),
                                ("/v1/chat/completions", chat, {**FIELDS, **CHAT_ONLY})):
        for field, ok in fields.items():
            for label, v in WRONG.items():
                if label in ok:
                    out.append(Case(f"{route}:{field}={label}", route, base(**{field: v}), 200))
                else:
                    out.append(Case(f"{route}:{field}={label}", route, base(**{field: v}), 400, param=field))
    return out


# -- hand-written -------------------------------------------------------------------------------------
C, K, R = "/v1/completions", "/v1/chat/completions", "/v1/responses"
NESTED = {"a": 1}
for _ in range(400):
    NESTED = {"a": NESTED}
DEEP_SCHEMA = {"type": "object"}
for _ in range(300):
    DEEP_SCHEMA = {"type": "object", "properties": {"a": DEEP_SCHEMA}}
SCHEMA_30 = {"type": "integer"}
for _ in range(30):
    SCHEMA_30 = {"type": "object", "properties": {"a": SCHEMA_30}, "required": ["a"]}
HUGE = "hello world, " * 40_000          # 520 KB: more than 256 tokens of any size can hold

CASES = [
    # prompts: token ids of the wrong kinds are not token ids (never "several prompts")
    Case("ids_float", C, comp(prompt=[1.5, 2.0]), 400, "prompt", "not a token id"),
    Case("ids_bool", C, comp(prompt=[True, False]), 400, "prompt", "not a token id"),
    Case("ids_mixed", C, comp(prompt=[1, "a"]), 400, "prompt", "not a token id"),
    Case("ids_null", C, comp(prompt=[1, None]), 400, "prompt", "not a token id"),
    Case("ids_nested_float", C, comp(prompt=[[1.5]]), 400, "prompt", "not a token id"),
    Case("ids_negative", C, comp(prompt=[-1]), 400, "prompt", "must lie in"),
    Case("ids_huge", C, comp(prompt=[2 ** 64]), 400, "prompt", "must lie in"),
    Case("ids_empty", C, comp(prompt=[]), 400, "prompt"),
    Case("ids_empty_nested", C, comp(prompt=[[]]), 400, "prompt"),
    Case("ids_batch", C, comp(prompt=[[1, 2], [3]]), 400, "prompt", "several prompts"),
    Case("strs_batch", C, comp(prompt=["a", "b"]), 400, "prompt", "several prompts"),
    Case("ids_ok", C, comp(prompt=[2, 9259]), 200),
    Case("ids_one_list", C, comp(prompt=[[2, 9259]]), 200),
    Case("ids_too_many", C, comp(prompt=[5] * (MAX_LEN + 1)), 400, "prompt", "context length"),
    Case("prompt_object", C, comp(prompt={"text": "x"}), 400, "prompt"),
    Case("prompt_null", C, comp(prompt=None), 400, "prompt"),
    Case("prompt_empty", C, comp(prompt=""), 200),       # BOS alone
    # text: every Unicode oddity that JSON can carry is served or named
    Case("nul", C, comp(prompt="a\x00b"), 200),
    Case("only_nul", C, comp(prompt="\x00" * 50), 200),
    Case("controls", C, comp(prompt="".join(map(chr, range(1, 32)))), 200),
    Case("bom", C, comp(prompt="\ufeffHi"), 200),
    Case("rtl_and_zero_width", C, comp(prompt="\u202eabc\u200b\u200d\u2066"), 200),
    Case("combining", C, comp(prompt="e" + "\u0301" * 200), 200),
    Case("emoji_zwj", C, comp(prompt="👩‍👩‍👧‍👦" * 20), 200),
    Case("noncharacters", C, comp(prompt="\uffff\ufffe\U0010ffff"), 200),
    Case("astral_escaped", C, b'{"prompt": "\\ud83d\\ude00", "max_tokens": 2}', 200),
    Case("lone_low_surrogate", C, b'{"prompt": "\\udc00", "max_tokens": 2}', 400, None, "surrogate"),
    Case("surrogate_in_chat", K, b'{"messages": [{"role": "user", "content": "\\ud800"}]}', 400, None, "surrogate"),
    Case("surrogate_in_key", C, b'{"prompt": "x", "\\ud800": 1}', 400, None, "surrogate"),
    Case("invalid_utf8", C, b'{"prompt": "\xff\xfe"}', 400, None, "not valid JSON"),
    Case("utf16_body", C, '{"prompt": "x", "max_tokens": 2}'.encode("utf-16"), 200),    # JSON's detection
    Case("latin1_body", C, '{"prompt": "café"}'.encode("latin-1"), 400, None, "not valid JSON"),
    Case("special_token_text", C, comp(prompt="<start_of_turn>user\nHi<end_of_turn>"), 200),
    Case("stop_special_token", C, comp(stop=["<end_of_turn>"]), 200),
    # sizes: a prompt that cannot fit is refused by its size, before it is tokenized
    Case("huge_prompt", C, comp(prompt=HUGE), 400, "prompt", "maximum context length"),
    Case("huge_message", K, chat(messages=[{"role": "user", "content": HUGE}]), 400, "messages",
         "maximum context length"),
    Case("huge_input", R, resp(input=HUGE), 400, "input", "maximum context length"),
    Case("huge_prompt_truncated", C, comp(prompt="hello " * 2000, truncate_prompt_tokens=8), 200),
    Case("many_messages", K, chat(messages=HI * 2000), 400, "messages", "context length"),
    Case("long_stop_list", C, comp(stop=[str(i) for i in range(16)]), 200),
    # numbers at and past their ends
    Case("seed_uint64_max", C, comp(seed=2 ** 64 - 1), 200),
    Case("seed_int64_min", C, comp(seed=-2 ** 63), 200),
    Case("seed_below_int64", C, comp(seed=-2 ** 63 - 1), 400, "seed"),
    Case("seed_2_80_chat", K, chat(seed=2 ** 80), 400, "seed"),
    Case("int_4000_digits", C, b'{"prompt": "x", "max_tokens": 1' + b"0" * 4000 + b"}", 400, "max_tokens"),
    Case("int_5000_digits", C, b'{"prompt": "x", "max_tokens": 1' + b"0" * 5000 + b"}", 400, None, "JSON"),
    Case("float_overflow", C, b'{"prompt": "x", "temperature": 1e999}', 400, "temperature"),
    Case("infinity", C, b'{"prompt": "x", "top_p": Infinity}', 400, "top_p"),
    Case("neg_infinity", C, b'{"prompt": "x", "presence_penalty": -Infinity}', 400, "presence_penalty"),
    Case("max_tokens_float_whole", C, comp(max_tokens=2.0), 400, "max_tokens"),
    Case("temperature_zero", C, comp(temperature=0), 200),
    Case("temperature_huge", C, comp(temperature=1e30), 200),
    Case("temperature_tiny", C, comp(temperature=1e-300), 200),
    Case("top_p_tiny", C, comp(top_p=1e-300), 200),
    Case("top_k_huge", C, comp(top_k=2 ** 63), 200),
    Case("top_k_below", C, comp(top_k=-2), 400, "top_k"),
    Case("repetition_penalty_huge", C, comp(repetition_penalty=1e300), 200),
    Case("max_tokens_exactly_fits", C, comp(prompt=[2], max_tokens=MAX_LEN - 1, ignore_eos=False,
                                            stop_token_ids=[1, 106], seed=0, temperature=0), 200),
    Case("max_tokens_one_over", C, comp(prompt=[2], max_tokens=MAX_LEN), 400, "max_tokens"),
    Case("min_tokens_equal", C, comp(min_tokens=2), 200),
    # logit_bias
    Case("bias_negative_key", C, comp(logit_bias={"-1": 1}), 400, "logit_bias"),
    Case("bias_space_key", C, comp(logit_bias={" 5": 1}), 400, "logit_bias"),
    Case("bias_float_key", C, comp(logit_bias={"5.0": 1}), 400, "logit_bias"),
    Case("bias_hex_key", C, comp(logit_bias={"0x10": 1}), 400, "logit_bias"),
    Case("bias_fullwidth_key", C, comp(logit_bias={"５": 1}), 400, "logit_bias"),
    Case("bias_empty_key", C, comp(logit_bias={"": 1}), 400, "logit_bias"),
    Case("bias_leading_zeros", C, comp(logit_bias={"0005": 1, "5": 2}), 400, "logit_bias", "twice"),
    Case("bias_bool_value", C, comp(logit_bias={"5": True}), 400, "logit_bias"),
    Case("bias_null_value", C, comp(logit_bias={"5": None}), 400, "logit_bias"),
    Case("bias_edges", C, comp(logit_bias={"0": -100, "262143": 100}), 200),
    Case("bias_5000_digits_chat", K, chat(logit_bias={"1" * 5000: 1}), 400, "logit_bias"),
    Case("bias_all_banned", C, comp(logit_bias={str(i): -100 for i in range(300)}), 200),
    # stop, n, logprobs
    Case("stop_null_in_list", C, comp(stop=["a", None]), 400, "stop"),
    Case("stop_nested", C, comp(stop=[["a"]]), 400, "stop"),
    Case("stop_duplicates", C, comp(stop=["a", "a"]), 200),
    Case("stop_unicode", C, comp(stop=["\x00", "🙂", "\u0301"]), 200),
    Case("n_two", C, comp(n=2, seed=1), 200),
    Case("n_two_stream", C, comp(n=2, stream=True), 200),
    Case("n_three", C, comp(n=3), 400, "n", "slots"),
    Case("logprobs_zero", C, comp(logprobs=0), 200),
    Case("logprobs_twenty", C, comp(logprobs=20, echo=True), 200),
    Case("chat_top_logprobs_twenty", K, chat(logprobs=True, top_logprobs=20), 200),
    Case("chat_top_logprobs_false", K, chat(logprobs=False, top_logprobs=3), 400, "top_logprobs"),
    Case("prompt_logprobs_echo_zero", C, comp(prompt_logprobs=20, echo=True, max_tokens=0), 200),
    Case("echo_stream_logprobs", C, comp(echo=True, stream=True, logprobs=2), 200),
    Case("stream_usage", K, chat(stream=True, stream_options={"include_usage": True}), 200),
    Case("stream_options_extra", K, chat(stream=True, stream_options={"include_usage": True, "x": 1}), 400,
         "stream_options"),
    # user, metadata and the other fields that change nothing
    Case("user_nested_chat", K, chat(user={"id": {"name": "x"}}), 400, "user"),
    Case("user_list", K, chat(user=["u"]), 400, "user"),
    Case("user_long", K, chat(user="u" * 10_000), 200),
    Case("metadata_17", K, chat(metadata={str(i): "v" for i in range(17)}), 400, "metadata"),
    # nesting: past 64 levels a body is refused whole (its schemas and messages are walked recursively)
    Case("metadata_nested", K, chat(metadata=NESTED), 400, None, "nested too deeply"),
    Case("deep_in_unknown_field", C, comp(x=NESTED), 400, None, "nested too deeply"),
    Case("deep_user", C, comp(user=NESTED), 400, None, "nested too deeply"),
    Case("deep_messages", K, chat(messages=[{"role": "user", "content": [NESTED]}]), 400, None, "nested too deeply"),
    Case("deep_tool_parameters", K, chat(tools=[{"type": "function", "function": {"name": "f", "parameters": NESTED}}]),
         400, None, "nested too deeply"),
    Case("deep_list_at_limit", C, comp(user=[[[[[[[[[[[]]]]]]]]]]]), 400, "user"),
    Case("schema_30_levels", K, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": SCHEMA_30}}, max_tokens=2), 200),
    # response_format and the guided fields
    Case("rf_text", K, chat(response_format={"type": "text"}), 200),
    Case("rf_json_object", K, chat(response_format={"type": "json_object"}, max_tokens=4), 200),
    Case("rf_string", K, chat(response_format="json"), 400, "response_format"),
    Case("rf_null_type", K, chat(response_format={"type": None}), 400, "response_format"),
    Case("rf_schema_missing", K, chat(response_format={"type": "json_schema"}), 400, "response_format"),
    Case("rf_schema_no_schema", K, chat(response_format={"type": "json_schema", "json_schema": {"name": "a"}}), 400,
         "response_format"),
    Case("rf_schema_list", K, chat(response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": []}}),
         400, "response_format"),
    Case("rf_schema_not", K, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"not": {"type": "string"}}}}), 400, "response_format"),
    Case("rf_schema_ok", K, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "strict": True, "schema": {"type": "object", "properties": {"a": {"type": "integer"}}}}},
        max_tokens=4), 200),
    Case("rf_schema_bad_ref", K, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"$ref": "#/$defs/nope"}}}), 400, "response_format"),
    Case("rf_schema_self_ref", K, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"$defs": {"n": {"type": "array", "items": {"$ref": "#/$defs/n"}}},
                                "$ref": "#/$defs/n"}}}, max_tokens=4), None),
    Case("rf_schema_deep", K, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": DEEP_SCHEMA}}, max_tokens=2), 400, None, "nested too deeply"),
    Case("rf_schema_bad_type", K, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "bogus"}}}), 400, "response_format"),
    Case("rf_schema_impossible", K, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "integer", "minimum": 5, "maximum": 1}}}), None),
    Case("rf_schema_huge_pattern", K, chat(response_format={"type": "json_schema", "json_schema": {
        "name": "a", "schema": {"type": "string", "pattern": "(a|b)*" * 200}}}), None),
    Case("rf_and_guided", K, chat(response_format={"type": "json_object"}, guided_regex="a"), 400),
    Case("guided_json_text", C, comp(guided_json='{"type": "integer"}', max_tokens=3), 200),
    Case("guided_json_bool", C, comp(guided_json=True), 400, "guided_json"),
    Case("guided_json_deep", C, comp(guided_json=DEEP_SCHEMA), 400, None, "nested too deeply"),
    Case("guided_json_nested_text", C, comp(guided_json="[" * 5000 + "]" * 5000), 400, "guided_json"),
    Case("guided_regex_ok", C, comp(guided_regex="[ab]{2}", max_tokens=3), 200),
    Case("guided_regex_bad", C, comp(guided_regex="(unclosed"), 400, "guided_regex"),
    Case("guided_regex_backref", C, comp(guided_regex=r"(a)\1"), 400, "guided_regex"),
    Case("guided_regex_lookahead", C, comp(guided_regex=r"(?=a)a"), 400, "guided_regex"),
    Case("guided_regex_empty_match", C, comp(guided_regex="a{0}"), None),
    Case("guided_regex_nul", C, comp(guided_regex="\x00", max_tokens=2), None),
    Case("guided_regex_blowup", C, comp(guided_regex="(a|aa)*" * 50 + "b{1000}"), None),
    Case("guided_regex_huge_count", C, comp(guided_regex="a{1000000}"), None),
    Case("guided_choice_ok", C, comp(guided_choice=["yes", "no"], max_tokens=3), 200),
    Case("guided_choice_empty", C, comp(guided_choice=[]), 400, "guided_choice"),
    Case("guided_choice_empty_str", C, comp(guided_choice=[""]), 400, "guided_choice"),
    Case("guided_choice_numbers", C, comp(guided_choice=[1, 2]), 400, "guided_choice"),
    Case("guided_choice_special", C, comp(guided_choice=["<start_of_turn>"], max_tokens=3), 400, "guided_choice",
         "allows no answer"),
    Case("guided_grammar_lark", C, comp(guided_grammar='start: "a" | "b"', max_tokens=3), 200),
    Case("guided_grammar_gbnf", C, comp(guided_grammar='root ::= "yes" | "no"', max_tokens=3), 200),
    Case("guided_grammar_special", C, comp(guided_grammar="start: <start_of_turn>"), 400, "guided_grammar",
         "allows no answer"),
    Case("guided_grammar_special_later", C, comp(guided_grammar='start: "a" <start_of_turn>', max_tokens=4), 400,
         None, "structured output failed"),
    Case("guided_grammar_special_alt", C, comp(guided_grammar='start: "a" | <end_of_turn>'), 200),
    Case("guided_grammar_eos_id", C, comp(guided_grammar="start: <[106]>"), 200),       # <end_of_turn> ends it
    Case("guided_grammar_eos", C, comp(guided_grammar='start: "a" <eos>'), 200),
    Case("guided_grammar_unknown_special", C, comp(guided_grammar="start: <no_such_token>"), 400, "guided_grammar"),
    Case("guided_grammar_bad", C, comp(guided_grammar="start: ((("), 400, "guided_grammar"),
    Case("guided_grammar_no_start", C, comp(guided_grammar='x: "a"'), 400, "guided_grammar"),
    Case("guided_grammar_recursive", C, comp(guided_grammar='start: start "a"'), None),
    Case("guided_grammar_empty_lang", C, comp(guided_grammar="start: /[^\\s\\S]/"), None),
    Case("guided_grammar_nul", C, comp(guided_grammar='start: "\x00"'), None),
    Case("guided_grammar_huge", C, comp(guided_grammar="start: " + " | ".join(f'"w{i}"' for i in range(3000))), None),
    # tools (Gemma 3 has no tool-call format) and tool_choice
    Case("tools_empty", K, chat(tools=[]), 200),
    Case("tools_not_list", K, chat(tools={"type": "function"}), 400, "tools"),
    Case("tools_item_str", K, chat(tools=["f"]), 400, "tools"),
    Case("tool_choice_none_alone", K, chat(tool_choice="none"), 200),
    Case("tool_choice_auto_alone", K, chat(tool_choice="auto"), 400, "tool_choice"),
    Case("tool_choice_required_alone", K, chat(tool_choice="required"), 400, "tool_choice"),
    Case("tool_choice_number", K, chat(tool_choice=1), 400, "tool_choice"),
    Case("tool_choice_bad_object", K, chat(tool_choice={"type": "function", "function": {"name": 5}}), 400,
         "tool_choice"),
    Case("tool_choice_unknown_fn", K, chat(tool_choice={"type": "function", "function": {"name": "f"}}), 400,
         "tool_choice"),
    Case("tool_choice_list", K, chat(tool_choice=["auto"]), 400, "tool_choice"),
    Case("assistant_tool_calls", K, chat(messages=HI + [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]), 400, "messages"),
    # messages
    Case("messages_object", K, chat(messages={"role": "user", "content": "x"}), 400, "messages"),
    Case("messages_strings", K, chat(messages=["Hi"]), 400, "messages"),
    Case("messages_nested_list", K, chat(messages=[HI]), 400, "messages"),
    Case("message_no_role", K, chat(messages=[{"content": "x"}]), 400, "messages"),
    Case("message_role_number", K, chat(messages=[{"role": 1, "content": "x"}]), 400, "messages"),
    Case("message_role_list", K, chat(messages=[{"role": ["user"], "content": "x"}]), 400, "messages"),
    Case("message_content_null", K, chat(messages=[{"role": "user", "content": None}]), 400, "messages"),
    Case("message_content_missing", K, chat(messages=[{"role": "user"}]), 400, "messages"),
    Case("message_content_dict", K, chat(messages=[{"role": "user", "content": {"text": "x"}}]), 400, "messages"),
    Case("message_parts_ok", K, chat(messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]), 200),
    Case("message_parts_empty", K, chat(messages=[{"role": "user", "content": []}]), None),
    Case("message_part_image", K, chat(messages=[{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]), 400, "messages"),
    Case("message_part_text_null", K, chat(messages=[{"role": "user", "content": [{"type": "text", "text": None}]}]),
         400, "messages"),
    Case("message_part_str", K, chat(messages=[{"role": "user", "content": ["Hi"]}]), 400, "messages"),
    Case("message_name_number", K, chat(messages=[{"role": "user", "content": "x", "name": 5}]), 400, "messages"),
    Case("message_extra_field", K, chat(messages=[{"role": "user", "content": "x", "colour": 1}]), 400, "messages"),
    Case("message_refusal", K, chat(messages=HI + [{"role": "assistant", "content": "x", "refusal": "no"}]), 400,
         "messages"),
    Case("message_reasoning_number", K, chat(messages=HI + [{"role": "assistant", "content": "x",
                                                             "reasoning_content": 5}]), 400, "messages"),
    Case("message_only_system", K, chat(messages=[{"role": "system", "content": "Be terse."}]), None),
    Case("message_only_assistant", K, chat(messages=[{"role": "assistant", "content": "x"}]), None),
    Case("message_developer", K, chat(messages=[{"role": "developer", "content": "x"}] + HI), 200),
    Case("message_assistant_null", K, chat(messages=HI + [{"role": "assistant", "content": None}] + HI), 200),
    Case("message_two_users", K, chat(messages=HI + HI), None),
    Case("message_empty_content", K, chat(messages=[{"role": "user", "content": ""}]), 200),
    Case("message_template_tags", K, chat(messages=[{"role": "user", "content": "{{ raise_exception('x') }}{% if %}"}]),
         200),
    Case("chat_template_kwargs_list", K, chat(chat_template_kwargs=[]), 400, "chat_template_kwargs"),
    Case("chat_template_kwargs_other", K, chat(chat_template_kwargs={"tools": 1}), 400, "chat_template_kwargs"),
    Case("reasoning_effort_none", K, chat(reasoning_effort="none"), 200),
    # the Responses API
    Case("r_ok", R, resp(), 200),
    Case("r_items", R, resp(input=[{"role": "user", "content": "Hi"}]), 200),
    Case("r_parts", R, resp(input=[{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]), 200),
    Case("r_type_message", R, resp(input=[{"type": "message", "role": "user", "content": "Hi"}]), 200),
    Case("r_input_null", R, resp(input=None), 400, "input"),
    Case("r_input_object", R, resp(input={"role": "user"}), 400, "input"),
    Case("r_input_numbers", R, resp(input=[1, 2]), 400, "input"),
    Case("r_input_nested", R, resp(input=[[{"role": "user", "content": "x"}]]), 400, "input"),
    Case("r_content_number", R, resp(input=[{"role": "user", "content": 5}]), 400, "input"),
    Case("r_part_no_text", R, resp(input=[{"role": "user", "content": [{"type": "input_text"}]}]), 400, "input"),
    Case("r_nul", R, resp(input="\x00"), 200),
    Case("r_surrogate", R, b'{"input": "\\udfff"}', 400, None, "surrogate"),
    Case("r_max_output_float", R, resp(max_output_tokens=2.5), 400, "max_output_tokens"),
    Case("r_max_output_str", R, resp(max_output_tokens="2"), 400, "max_output_tokens"),
    Case("r_top_logprobs", R, resp(top_logprobs=21), 400, "top_logprobs"),
    Case("r_top_logprobs_ok", R, resp(top_logprobs=3), 200),
    Case("r_seed_2_80", R, resp(seed=2 ** 80), 400),
    Case("r_unknown_previous", R, resp(previous_response_id="resp_nope"), 404),
    Case("r_instructions_nul", R, resp(instructions="\x00"), 200),
    Case("r_text_not_object", R, resp(text="json"), 400, "text"),
    Case("r_text_format_str", R, resp(text={"format": "json"}), 400, "text.format"),
    Case("r_json_schema_ok", R, resp(text={"format": {"type": "json_schema", "name": "a", "schema": {
        "type": "object", "properties": {"a": {"type": "boolean"}}}}}, max_output_tokens=6), 200),
    Case("r_json_schema_not", R, resp(text={"format": {"type": "json_schema", "name": "a", "schema": {"not": {}}}}), 400,
         "text.format"),
    Case("r_tools_not_list", R, resp(tools={"type": "function"}), 400, "tools"),
    Case("r_tool_choice_number", R, resp(tool_choice=5), 400, "tool_choice"),
    Case("r_reasoning_list", R, resp(reasoning=[]), 400, "reasoning"),
    Case("r_stream", R, resp(stream=True), 200),
    Case("r_user_object", R, resp(user={"id": 1}), 400, "user"),
    Case("r_body_list", R, [resp()], 400),
    # /tokenize and /detokenize
    Case("t_ok", "/tokenize", {"prompt": "Hi\x00"}, 200),
    Case("t_messages", "/tokenize", {"messages": HI}, 200),
    Case("t_prompt_ids", "/tokenize", {"prompt": [1, 2]}, 400, "prompt"),
    Case("t_neither", "/tokenize", {}, 400),
    Case("t_add_special_str", "/tokenize", {"prompt": "x", "add_special_tokens": "yes"}, 400, "add_special_tokens"),
    Case("t_gen_prompt_with_prompt", "/tokenize", {"prompt": "x", "add_generation_prompt": True}, 400,
         "add_generation_prompt"),
    Case("t_return_strs", "/tokenize", {"prompt": "<start_of_turn>é🙂", "return_token_strs": True}, 200),
    Case("t_messages_bad", "/tokenize", {"messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    Case("t_huge", "/tokenize", {"prompt": HUGE}, 200),
    Case("t_unknown", "/tokenize", {"prompt": "x", "truncate_prompt_tokens": 2}, 400, "truncate_prompt_tokens"),
    Case("d_ok", "/detokenize", {"tokens": [2, 106, 9259]}, 200),
    Case("d_empty", "/detokenize", {"tokens": []}, 200),
    Case("d_float", "/detokenize", {"tokens": [1.0]}, 400, "tokens"),
    Case("d_bool", "/detokenize", {"tokens": [True]}, 400, "tokens"),
    Case("d_negative", "/detokenize", {"tokens": [-1]}, 400, "tokens"),
    Case("d_huge", "/detokenize", {"tokens": [2 ** 80]}, 400, "tokens"),
    Case("d_string", "/detokenize", {"tokens": "2 3"}, 400, "tokens"),
    Case("d_nested", "/detokenize", {"tokens": [[2]]}, 400, "tokens"),
    Case("d_byte_pieces", "/detokenize", {"tokens": [240, 241]}, 200),
    Case("d_body_list", "/detokenize", [2], 400),
    # bodies and headers
    Case("ct_text_plain", C, comp(), 415, headers={"Content-Type": "text/plain"}),
    Case("ct_text_plain_chat", K, chat(), 415, headers={"Content-Type": "text/plain;charset=UTF-8"}),
    Case("ct_form", K, chat(), 415, headers={"Content-Type": "application/x-www-form-urlencoded"}),
    Case("ct_multipart", R, resp(), 415, headers={"Content-Type": "multipart/form-data; boundary=x"}),
    Case("ct_missing", "/tokenize", {"prompt": "x"}, 415, headers={"Content-Type": ""}),
    Case("ct_json_charset", C, comp(), 200, headers={"Content-Type": "application/json; charset=utf-8"}),
    Case("ct_json_upper", C, comp(), 200, headers={"Content-Type": "Application/JSON"}),
    Case("ct_text_plain_huge", C, {"prompt": "x" * 3_000_000}, 415, headers={"Content-Type": "text/plain"}),
    Case("body_null", C, b"null", 400),
    Case("body_string", C, b'"x"', 400),
    Case("body_number", C, b"5", 400),
    Case("body_whitespace", C, b" \n\t ", 400, None, "empty"),
    Case("body_trailing", C, b'{"prompt": "x"} {"prompt": "y"}', 400, None, "JSON"),
    Case("body_duplicate_keys", C, b'{"prompt": [1.5], "prompt": "Hi", "max_tokens": 2}', 200),
    Case("body_nul_byte", C, b'{"prompt": "x"}\x00', 400, None, "JSON"),
    Case("key_nul", C, comp(**{"\x00": 1}), 400, "\x00"),
]


def every_case():
    return field_cases() + CASES


def send(http: httpx.Client, case: Case) -> httpx.Response:
    h = {"Content-Type": "application/json", **(case.headers or {})}
    if not h["Content-Type"]:
        del h["Content-Type"]
    body = case.body if isinstance(case.body, bytes) else httpx.Request("POST", "/", json=case.body).content
    return http.post(case.path, content=body, headers=h)


def check(case: Case, r: httpx.Response) -> str | None:
    """What is wrong with the answer to `case`, or None."""
    if r.status_code >= 500:
        return f"{r.status_code}: {r.text[:300]}"
    if case.status is not None and r.status_code != case.status:
        return f"{r.status_code} instead of {case.status}: {r.text[:300]}"
    if r.status_code >= 400:
        err = r.json().get("error")
        if not isinstance(err, dict) or set(err) != {"message", "type", "param", "code"}:
            return f"not an OpenAI error body: {r.text[:300]}"
        if "\n" in err["message"] or not err["message"] or len(err["message"]) > 1000:
            return f"message not one short line: {err['message'][:300]!r}"
        if case.param is not None and err["param"] != case.param:
            return f"param {err['param']!r} instead of {case.param!r}: {err['message'][:200]}"
        if case.words is not None and case.words not in err["message"]:
            return f"{case.words!r} not in {err['message'][:300]!r}"
        return None
    if r.status_code != 200:
        return f"{r.status_code}: {r.text[:300]}"
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [x for x in r.text.split("\n\n") if x]
        if not events or any(not x.startswith(("data: ", "event: ")) for x in events) or '"error": {' in r.text \
                or '"error":{' in r.text:
            return f"not a clean stream: {r.text[-300:]}"
        return None
    body = r.json()
    if case.path in ("/v1/completions", "/v1/chat/completions"):
        n = case.body.get("n", 1) if isinstance(case.body, dict) else 1
        if len(body["choices"]) != n or body["usage"]["completion_tokens"] < 0:
            return f"wrong answer: {r.text[:300]}"
        for c in body["choices"]:
            text = c["text"] if "text" in c else c["message"]["content"]
            if not isinstance(text, str) or c["finish_reason"] not in ("stop", "length"):
                return f"wrong choice: {c}"
    elif case.path == "/v1/responses" and body["status"] not in ("completed", "incomplete"):
        return f"wrong response: {r.text[:300]}"
    return None


def test_hostile_requests_get_a_4xx_or_a_correct_200(server):
    cases = every_case()
    assert len({c.name for c in cases}) == len(cases)
    failures, counts = [], {}
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for case in cases:
            try:
                r = send(http, case)
            except httpx.TransportError as e:
                failures.append(f"{case.name}: no answer ({e!r})")
                continue
            counts[r.status_code // 100] = counts.get(r.status_code // 100, 0) + 1
            why = check(case, r)
            if why is not None:
                failures.append(f"{case.name}: {why}")
        load = http.get("/health").json()
    print(f"\nhostile requests: {len(cases)} cases, {counts.get(4, 0)} answered 4xx, {counts.get(2, 0)} 200")
    assert len(cases) >= 250 and not failures, "\n".join(failures)
    assert load["status"] == "ok" and load["running"] == 0 and load["waiting"] == 0, load


def test_query_secrets_stay_out_of_the_access_log(server):
    """`?api_key=` is not how this server takes a key, but clients send it: the access log writes it
    as [redacted] (the server fixture reads the log after the process exits)."""
    r = httpx.get(f"{server.url}/v1/models?api_key={SECRET}&x=1", timeout=30)
    assert r.status_code == 200
    r = httpx.get(f"{server.url}/health?api%5Fkey={SECRET}", timeout=30)
    assert r.status_code == 200


def test_a_small_request_does_not_wait_for_huge_prompts(server):
    """Two 3.5 MB prompts tokenize (truncated, so their size alone does not refuse them) while a
    small request comes: it is answered at once, not after them."""
    big = {"prompt": "hello world, this is text. " * 130_000, "max_tokens": 1, "truncate_prompt_tokens": 8}

    def post(body):
        t0 = time.monotonic()
        r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        return r.status_code, time.monotonic() - t0
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        bigs = [pool.submit(post, big) for _ in range(2)]
        time.sleep(0.5)
        small = pool.submit(post, comp(max_tokens=1)).result()
        done = [f.result() for f in bigs]
    print(f"\nsmall request {small[1]:.2f} s beside two 3.5 MB prompts of {max(t for _, t in done):.2f} s")
    assert small[0] == 200 and all(code == 200 for code, _ in done)
    assert small[1] < max(t for _, t in done) / 2, (small, done)
