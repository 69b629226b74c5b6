"""The embedded Gemma 3 270M (a real pretrained model) against transformers loading the same GGUF."""
import json
import os
import subprocess
import sys

import hf_reference
import numpy as np
import pytest
import xla_env

import jaxllm

pytestmark = pytest.mark.slow
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GPL = "/usr/share/common-licenses/GPL-3"
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
           open(GPL).read()[:2600]]          # about 600 tokens: past the 512-token sliding window
N_NEW = 32


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    return hf_reference.load_model(tmp_path_factory)


@pytest.fixture(scope="module")
def eng32():
    return jaxllm.load(quant="none", dtype="float32", max_ctx=1024)


def hf_greedy(model, ids, n):
    import torch
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, top_k=None, top_p=None)
    return out[0, len(ids):].tolist()


def test_long_prompt_is_past_the_window(eng32):
    assert len(eng32.tokenizer.encode(PROMPTS[2])) > eng32.cfg.attn[0].window


def test_float32_greedy_matches_transformers(eng32, hf_model):
    ids = [eng32.tokenizer.encode(p) for p in PROMPTS]
    ours = eng32.generate_ids(ids, max_tokens=N_NEW)
    for p, c in zip(ids, ours):
        ref = hf_greedy(hf_model, p, N_NEW)
        if ref and ref[-1] in eng32.cfg.eos_ids:
            ref = ref[:-1]
        assert c.token_ids == ref, (eng32.tokenizer.decode(c.token_ids), eng32.tokenizer.decode(ref))


def test_bfloat16_first_tokens_match(eng32, hf_model):
    eng16 = jaxllm.load(quant="none", dtype="bfloat16", max_ctx=1024)
    ids = [eng16.tokenizer.encode(p) for p in PROMPTS]
    for p, c in zip(ids, eng16.generate_ids(ids, max_tokens=8)):
        assert c.token_ids == hf_greedy(hf_model, p, 8)[:len(c.token_ids)]
        assert len(c.token_ids) == 8


def test_logits_match_transformers(eng32, hf_model):
    import torch
    ids = np.array([eng32.tokenizer.encode(PROMPTS[1])], np.int32)
    with torch.no_grad():
        ref = hf_model(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    got = eng32.logits(ids)
    assert np.abs(got - ref).max() / np.abs(ref).max() < 1e-4


def run_cli(*args):
    env = {**xla_env.full_speed(), "JAX_PLATFORMS": "cpu", "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-m", "jaxllm.infer", *args], capture_output=True, text=True,
                          timeout=600, env=env, cwd=ROOT)


def test_cli_continuation_and_json():
    r = run_cli("--raw-prompt", "--prompt", "The capital of France is", "--max-tokens", "16")
    assert r.returncode == 0, r.stderr
    words = r.stdout.split()
    assert len(words) >= 5 and any(w.strip(".,").lower() in ("paris", "france", "capital", "city") for w in words), r.stdout
    assert "TTFT" in r.stderr
    r = run_cli("--json", "--raw-prompt", "--prompt", "The capital of France is", "--prompt", "1, 2, 3,",
                "--max-tokens", "8")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert len(lines) == 2
    keys = {"prompt", "text", "token_ids", "num_prompt_tokens", "num_new_tokens", "ttft_ms", "decode_tok_s",
            "finish_reason", "load_s", "compile_s"}
    for line in lines:
        rec = json.loads(line)
        assert set(rec) == keys
        assert rec["num_new_tokens"] == len(rec["token_ids"]) > 0
        assert rec["finish_reason"] in ("stop", "length")


def infer_json(eng, capsys, *args):
    """`python -m jaxllm.infer --json ARGS` past loading, on a loaded engine -> (records, stderr)."""
    from jaxllm.cli import infer
    parsed = infer.build_parser().parse_args(["--json", *args])
    infer.check_args(parsed)
    infer.run_generate(parsed, eng)
    out = capsys.readouterr()
    return [json.loads(line) for line in out.out.splitlines()], out.err


def test_base_model_prompt_goes_in_raw_unless_chat_is_asked(eng32, capsys):
    """The embedded model is a base model (its GGUF has no chat template and no instruction-tuned
    name): a prompt goes in as written and the answer has no turn markers; `--chat` applies Gemma
    3's template, with a note."""
    tok, prompt = eng32.tokenizer, "Why is the sky blue?"
    assert not tok.chat_tuned and tok.chat_template          # the family's template, for chat requests
    assert eng32.encode_prompt(prompt) == tok.encode(prompt)
    (rec,), err = infer_json(eng32, capsys, "--prompt", prompt, "--max-tokens", "8")
    assert rec["num_prompt_tokens"] == len(tok.encode(prompt)) and "note" not in err
    answer = tok.decode(rec["token_ids"], skip_special=False)
    assert rec["token_ids"] and "<start_of_turn>" not in answer and "<end_of_turn>" not in answer
    assert not {"user", "model"} & {line.strip() for line in rec["text"].splitlines()}
    templated = eng32.encode_prompt(prompt, chat=True)
    text = tok.decode(templated, skip_special=False)
    assert "<start_of_turn>user" in text and text.rstrip().endswith("<start_of_turn>model")
    (rec,), err = infer_json(eng32, capsys, "--chat", "--prompt", prompt, "--max-tokens", "2")
    assert rec["num_prompt_tokens"] == len(templated) and "not chat-tuned" in err


def test_cli_long_context_prompt_file(tmp_path):
    """The design's own example: --max-ctx 131072 takes int8 global layers (the sliding ones keep
    their window); a prompt of a few thousand tokens from a file is answered."""
    f = tmp_path / "prompt.txt"
    f.write_text(open(GPL).read()[:9000] + "\n\nThe title of this license is")
    r = run_cli("--raw-prompt", "--prompt-file", str(f), "--max-ctx", "131072", "--max-tokens", "8", "--json")
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout.strip().splitlines()[-1])
    assert rec["num_prompt_tokens"] > 1500 and rec["num_new_tokens"] > 0 and rec["text"].strip()
    assert "131072" in r.stderr and "KV pool" in r.stderr       # trained-context warning and the pool's size
