"""Sliding-window perplexity against transformers, with the protocol written out here independently:
each window is [BOS] + up to W-1 text tokens, windows start every min(S, W-1) text tokens, and a
token is scored by the first window that contains it."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import hf_reference
import pytest
import torch

import jaxllm
from jaxllm.cli.perplexity import add_perplexity_args, check_perplexity_args, read_ppl_text, run_perplexity
from jaxllm.engine.perplexity import plan_windows
from jaxllm.errors import RequestError

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 +
        "Pack my box with five dozen liquor jugs! How vexingly quick daft zebras jump; "
        "sphinx of black quartz, judge my vow. 0123456789 " * 4)


_REFERENCE: dict = {}


def reference_ppl(model, ids: list[int], bos: int, window: int, stride: int) -> tuple[float, int]:
    """Mean NLL and scored-token count, computed window by window with transformers."""
    key = (id(model), len(ids), bos, window, stride)
    if key not in _REFERENCE:
        _REFERENCE[key] = _reference_ppl(model, ids, bos, window, stride)
    return _REFERENCE[key]


def _reference_ppl(model, ids, bos, window, stride):
    span, n = window - 1, len(ids)
    step = min(stride, span)
    total, count, begin, prev_end = 0.0, 0, 0, 0
    while True:
        end = min(begin + span, n)
        inp = torch.tensor([[bos] + ids[begin:end]])
        with torch.no_grad():
            logp = torch.log_softmax(model(inp).logits[0].double(), dim=-1)
        for t in range(max(prev_end, begin), end):
            total -= float(logp[t - begin, ids[t]])          # input row t-begin predicts text token t
            count += 1
        prev_end = end
        if end >= n:
            return total / count, count
        begin += step


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory):
    """A randomized tiny Gemma 3 with a small BPE tokenizer, saved as an HF directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    d = tmp_path_factory.mktemp("tiny_gemma3")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainers.BpeTrainer(
        vocab_size=160, special_tokens=["<pad>", "<eos>", "<bos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<bos>", "eos_token": "<eos>", "add_bos_token": True}))
    cfg = Gemma3TextConfig(vocab_size=tok.get_vocab_size(), hidden_size=48, intermediate_size=96,
                           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                           head_dim=16, sliding_window=6, query_pre_attn_scalar=16,
                           max_position_embeddings=2048, layer_types=["sliding_attention", "full_attention",
                                                                     "sliding_attention"],
                           final_logit_softcapping=30.0, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.save_pretrained(d)
    model = Gemma3ForCausalLM.from_pretrained(d, attn_implementation="eager", dtype=torch.float32).eval()
    ids = tok.encode(TEXT, add_special_tokens=False).ids
    return d, model, ids


def test_plan_windows_scores_every_token_once():
    for n, w, s, bos in [(100, 16, 8, True), (100, 16, 16, True), (7, 16, 8, True), (100, 16, 3, False),
                         (33, 4, 1, True), (50, 10, 10, False)]:
        wins = plan_windows(n, w, s, bos)
        scored = [t for x in wins for t in range(x.score_from, x.end)]
        assert scored == list(range(0 if bos else 1, n))
        assert all(x.end - x.begin <= (w - 1 if bos else w) for x in wins)
        assert wins[-1].end == n


@pytest.mark.parametrize("window,stride", [(24, 8), (24, 24), (1024, None)])
def test_matches_transformers_float32(tiny_gemma, window, stride):
    d, model, ids = tiny_gemma
    eng = jaxllm.load(str(d), quant="none", dtype="float32", max_ctx=64)
    res = eng.perplexity(TEXT, window=window, stride=stride)
    ref_nll, ref_n = reference_ppl(model, ids, 2, window, stride or window // 2)
    assert res.num_scored_tokens == ref_n == len(ids)
    assert res.window == window and res.stride == (stride or window // 2)
    assert abs(res.nll - ref_nll) < 1e-4 * ref_nll
    assert res.ppl == pytest.approx(math.exp(ref_nll), rel=1e-4)


def test_weight_formats_and_dtypes(tiny_gemma):
    d, model, ids = tiny_gemma
    ref_nll, _ = reference_ppl(model, ids, 2, 1024, 512)
    for quant, dtype, tol in [("int8", "float32", 0.02), ("none", "bfloat16", 0.03), ("int8", "bfloat16", 0.04)]:
        res = jaxllm.load(str(d), quant=quant, dtype=dtype).perplexity(TEXT, window=1024)
        assert abs(res.nll - ref_nll) < tol * ref_nll, (quant, dtype, res.nll, ref_nll)


def test_bad_inputs_are_one_line_errors(tiny_gemma, tmp_path):
    d, _, _ = tiny_gemma
    eng = jaxllm.load(str(d), quant="none", dtype="float32")
    for kw in [dict(window=1), dict(window=16, stride=17), dict(window=16, stride=0), dict(window="8")]:
        with pytest.raises(RequestError):
            eng.perplexity(TEXT, **kw)
    with pytest.raises(RequestError, match="empty"):
        eng.perplexity("  \n")
    p = argparse.ArgumentParser()
    add_perplexity_args(p)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n")
    for argv, msg in [(["--perplexity"], "needs --ppl-file"),
                      (["--perplexity", "--ppl-file", str(tmp_path / "nope.txt")], "no such file"),
                      (["--perplexity", "--ppl-file", str(empty)], "empty"),
                      (["--perplexity", "--ppl-file", str(empty), "--ppl-window", "1"], "window"),
                      (["--perplexity", "--ppl-file", str(empty), "--ppl-stride", "4096"], "stride")]:
        with pytest.raises(RequestError, match=msg) as e:
            read_ppl_text(p.parse_args(argv))
        assert "\n" not in str(e.value)


def test_cli_json_record(tiny_gemma, tmp_path, capsys):
    d, model, ids = tiny_gemma
    f = tmp_path / "text.txt"
    f.write_text(TEXT)
    p = argparse.ArgumentParser()
    add_perplexity_args(p)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(["--perplexity", "--ppl-file", str(f), "--ppl-window", "24", "--ppl-stride", "24", "--json"])
    check_perplexity_args(args)
    run_perplexity(args, jaxllm.load(str(d), quant="none", dtype="float32"))
    rec = json.loads(capsys.readouterr().out.strip())
    assert set(rec) == {"ppl", "nll", "num_scored_tokens", "window", "stride"}
    ref_nll, ref_n = reference_ppl(model, ids, 2, 24, 24)
    assert rec["num_scored_tokens"] == ref_n and rec["window"] == 24 and rec["stride"] == 24
    assert rec["ppl"] == pytest.approx(math.exp(ref_nll), rel=1e-4)


GPL3 = Path("/usr/share/common-licenses/GPL-3")


def gpl3_head(chars: int = 7000) -> str:
    """The first ~1500 Gemma tokens of GPL-3, cut at a paragraph break."""
    text = GPL3.read_text()
    return text[:text.rfind("\n\n", 0, chars)]


@pytest.mark.slow
def test_embedded_gemma3_270m_on_gpl3_matches_transformers(tmp_path_factory):
    """The embedded Gemma 3 270M against transformers loading the same GGUF. To bound CI time this
    scores the first ~1500 tokens of GPL-3 (two overlapping windows) with window 1024 / stride 512
    instead of the 2048 default."""
    text = gpl3_head()
    f32_engine = jaxllm.load(quant="none", dtype="float32")
    ids = f32_engine.tokenizer.encode(text, add_special=False)
    assert ids == hf_reference.load_tokenizer(tmp_path_factory)(text, add_special_tokens=False).input_ids
    model = hf_reference.load_model(tmp_path_factory)
    ref_nll, ref_n = reference_ppl(model, ids, f32_engine.tokenizer.bos_id, 1024, 512)
    f32 = f32_engine.perplexity(text, window=1024, stride=512)
    del f32_engine
    bf16 = jaxllm.load(dtype="bfloat16").perplexity(text, window=1024, stride=512)     # int8 weights
    ref = math.exp(ref_nll)
    print(f"GPL-3 head, {ref_n} tokens: transformers f32 {ref:.4f}, jaxllm f32 {f32.ppl:.4f}, "
          f"jaxllm bf16/int8 {bf16.ppl:.4f}")
    assert f32.num_scored_tokens == bf16.num_scored_tokens == ref_n > 1400
    assert abs(f32.ppl / ref - 1) < 0.005
    assert abs(bf16.ppl / ref - 1) < 0.01
