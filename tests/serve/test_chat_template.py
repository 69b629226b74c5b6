"""Chat templates render as transformers' apply_chat_template does, tools, tool calls, tool
results, reasoning and `enable_thinking` included, on Qwen3's and Gemma 4's real templates."""
from __future__ import annotations

from pathlib import Path

import pytest

from jaxllm.tokenizer import Tokenizer

DATA = Path(__file__).parents[1] / "data"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather — in \"a\" city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "where"},
                                                    "days": {"type": "integer"},
                                                    "units": {"type": "string", "enum": ["C", "F"]}},
                   "required": ["city"]}}}]
CALL = {"role": "assistant", "content": "", "reasoning_content": "Look it up.", "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}}]}
CONVERSATIONS = {
    "plain": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
              {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye"}],
    "call": [{"role": "user", "content": "Weather in Paris?"}, CALL],
    "result": [{"role": "system", "content": "Use tools."}, {"role": "user", "content": "Weather in Paris?"}, CALL,
               {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}],
}


def hf_render(template: str, messages, **kw) -> str:
    from tokenizers import Tokenizer as HFTok
    from tokenizers import models
    from transformers import PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=HFTok(models.WordLevel({"<unk>": 0}, unk_token="<unk>")),
                                  bos_token="<bos>", eos_token="<eos>")
    return tok.apply_chat_template(messages, chat_template=template, tokenize=False, **kw)


@pytest.mark.parametrize("family", ["qwen3", "gemma4"])
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
@pytest.mark.parametrize("kw", [{}, {"tools": TOOLS}, {"tools": TOOLS, "enable_thinking": False},
                                {"enable_thinking": True}], ids=["none", "tools", "tools-nothink", "think"])
def test_render_matches_transformers(family, conversation, kw):
    template = (DATA / f"{family}_chat_template.jinja").read_text()
    messages = CONVERSATIONS[conversation]
    ours = Tokenizer(None, chat_template=template, bos_token="<bos>", eos_token="<eos>").render_chat(messages, **kw)
    assert ours == hf_render(template, messages, add_generation_prompt=True, **kw)
    if conversation == "plain":                  # the tools reached the template
        assert ("get_weather" in ours) == ("tools" in kw)


def test_template_variables():
    for family in ("qwen3", "gemma4"):
        names = Tokenizer(None, chat_template=(DATA / f"{family}_chat_template.jinja").read_text()).template_variables()
        assert {"tools", "enable_thinking", "messages"} <= names
    assert "tools" not in Tokenizer(None, chat_template="{{ messages[0]['content'] }}").template_variables()
