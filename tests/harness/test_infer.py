"""`python -m jaxllm.infer` on a tiny chat-tuned checkpoint (a Qwen3 saved with its chat template):
a batch's rows sample with seeds of their own, and the chat template is applied by default."""
import json

import pytest
import tiny_chat

from jaxllm.cli import infer
from jaxllm.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return tiny_chat.make_qwen3(tmp_path_factory.mktemp("qwen3-chat"))


def infer_json(capsys, model, *args) -> list[dict]:
    infer.main(["--model-dir", str(model), "--max-ctx", "64", "--json", *args])
    return [json.loads(line) for line in capsys.readouterr().out.splitlines()]


def test_batch_rows_sample_apart_and_one_seed_reproduces_them(model, capsys):
    args = ("--raw-prompt", "--prompt", "Once upon a time", "--batch", "3", "--temperature", "1.0",
            "--max-tokens", "16")
    rows = [r["token_ids"] for r in infer_json(capsys, model, *args)]
    assert len(rows) == 3 and len({tuple(r) for r in rows}) == 3
    assert [r["token_ids"] for r in infer_json(capsys, model, *args)] == rows


def test_chat_tuned_model_takes_its_template_by_default(model, capsys):
    tok = Tokenizer.from_hf_dir(model)
    assert tok.chat_tuned
    prompt = "Why is the sky blue?"
    templated = tok.encode_chat([{"role": "user", "content": prompt}])
    assert len(templated) > len(tok.encode(prompt))
    (default,) = infer_json(capsys, model, "--prompt", prompt, "--max-tokens", "2")
    (raw,) = infer_json(capsys, model, "--raw-prompt", "--prompt", prompt, "--max-tokens", "2")
    assert default["num_prompt_tokens"] == len(templated)
    assert raw["num_prompt_tokens"] == len(tok.encode(prompt))
