"""GGUF files of Qwen3, Qwen3-MoE and Gemma 4 as llama.cpp's converter writes them (tests/helpers/
to_gguf.py, from tiny random transformers models with tiny trained tokenizers), in F32, Q8_0 and a
Q4_0 file whose ffn_down are Q4_K, Q5_K and Q6_K: each reads as the HF checkpoint it came from --
config, tensors equal to the gguf package's dequantization, logits of transformers run on those
tensors, and the tokenizer's ids."""
import copy
import unicodedata

import jax.numpy as jnp
import numpy as np
import pytest
import tiny
import to_gguf
from dequant import logits_on
from gemma4_refs import BASE, VARIANTS
from gemma4_refs import build as build_gemma4

import jaxllm
from jaxllm.config.runtime import Caches
from jaxllm.errors import ModelError
from jaxllm.model.families import family_for
from jaxllm.weights import gguf as gguf_mod
from jaxllm.weights import read_config
from jaxllm.weights.gguf import GGUFSource, iter_gguf_tensors, load_gguf_tokenizer, read_gguf_config
from jaxllm.weights.loader import load_model

Q = to_gguf.Q
TOL = 1e-4
LENS = (13, 9)                          # unequal, right-padded; longer than Gemma 4's window (4)
S, G = "sliding_attention", "full_attention"
KQUANTS = [Q.Q4_K, Q.Q5_K, Q.Q6_K]       # one ffn_down each, in the Q4_0 file
TEXTS = [
    "Hello, world! This is a plain English sentence.",
    "  leading spaces", "trailing spaces   ", "multiple   spaces    inside  the   text", " ", "",
    "line one\nline two\n\nline four\r\nwindows\n",
    "\ttabs\tand\t\tmore tabs\t",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment\n",
    "emoji 😀🎉👩‍👩‍👧 and CJK 你好，世界 日本語のテキスト 한국어",
    "rare bytes: \x00\x01\x07\x1b\x7f \u0080\u00ad \ufeff \U0001d518\U0001d52b \U0010fffd",
    "Ünïcödé àccents — “quotes” … ½ ∑ ∞ ≠ ≈ and NFD: e\u0301",
    "numbers 1234567890 3.14159 -42 1e-6 0xDEADBEEF",
    "I've been 'told he's there, 'RE you sure? URL: https://example.com/path?q=1&b=two#frag",
]
SPECIAL_TEXTS = {
    "qwen": "<|im_start|>user\nhi <think>x</think><|im_end|>\n<|endoftext|>",
    "gemma": "<|turn>user\nhi<turn|>\n<bos>literal<eos> <mask> <|channel>",
}


def _qwen(name, **overrides):
    def build(d):
        tok = to_gguf.qwen_tokenizer(320)
        ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_end|>")}
        model = tiny.make(name, d, seed=3, vocab_size=len(tok) + 3, bos_token_id=ids["<|endoftext|>"],
                          eos_token_id=ids["<|im_end|>"], pad_token_id=ids["<|endoftext|>"], **overrides)
        tok.save_pretrained(d)
        return model, model.config.to_dict(), tok
    return build


def _gemma4(variant, **overrides):
    def build(d):
        tok = to_gguf.gemma_tokenizer(512)
        hp = {**VARIANTS[variant], "vocab_size": len(tok), **overrides}
        if hp.get("hidden_size_per_layer_input"):
            hp["vocab_size_per_layer_input"] = len(tok)
        model = build_gemma4(variant, **hp)
        model.save_pretrained(d)
        tok.save_pretrained(d)
        return model, {**BASE, "num_kv_shared_layers": 0, **hp}, tok
    return build


CASES = {
    # dense, its MLP 256 wide so ffn_down rows hold whole K-quant blocks
    "qwen3": ("qwen3", "qwen", _qwen("qwen3", intermediate_size=256)),
    "qwen3moe": ("qwen3moe", "qwen", _qwen("qwen3_moe", num_hidden_layers=2)),
    # k_eq_v global layers with their own head size and KV heads, the MoE block beside the MLP
    "gemma4-moe": ("gemma4", "gemma", _gemma4("26b-a4b", num_hidden_layers=4, layer_types=[S, S, G, G])),
    # per-layer inputs, KV-shared layers with double-wide MLPs
    "gemma4-ple": ("gemma4", "gemma", _gemma4("e2b", num_hidden_layers=4, layer_types=[S, G, S, G],
                                             num_kv_shared_layers=2)),
}


class Case:
    """A tiny HF model, its GGUF files, the engine of its F32 file and a prompt batch."""

    def __init__(self, name, tmp):
        self.arch, self.tok_kind, build = CASES[name]
        self.dir = tmp / "hf"
        self.model, self.hp, self.hf_tok = build(self.dir)
        self.files, self.recipes = {}, {}
        kinds = {"F32": (Q.F32, None), "Q8_0": (Q.Q8_0, None)}
        if name == "qwen3":
            kinds["Q4_0+K"] = (Q.Q4_0, KQUANTS)
        for kind, (qtype, down) in kinds.items():
            self.files[kind] = tmp / f"{name}-{kind}.gguf"
            self.recipes[kind] = to_gguf.write(self.files[kind], self.arch, self.model, self.hp, self.dir, qtype, down)
        self.engine = jaxllm.load(self.files["F32"], quant="none", dtype="float32", max_ctx=32, caches=Caches())
        rng = np.random.default_rng(0)
        self.rows = [rng.integers(3, self.hp["vocab_size"], n).tolist() for n in LENS]
        self.ids = np.zeros((len(LENS), max(LENS)), np.int32)
        for b, r in enumerate(self.rows):
            self.ids[b, :len(r)] = r


_CASES: dict[str, Case] = {}


def get_case(name, tmp_path_factory) -> Case:
    if name not in _CASES:
        _CASES[name] = Case(name, tmp_path_factory.mktemp(name))
    return _CASES[name]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return get_case(request.param, tmp_path_factory)


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


def test_config_is_the_checkpoints(case):
    """The file's metadata maps to the ModelConfig of the HF checkpoint it was converted from
    (the ids a GGUF states come from its tokenizer, the same here; the file stores eps as float32)."""
    theirs = read_config(case.dir)
    theirs = theirs.replace(norm_eps=float(np.float32(theirs.norm_eps)))
    for kind in case.files:
        hf = read_gguf_config(case.files[kind])
        assert family_for(hf).config_from_hf(hf) == theirs, kind


# What each Gemma 4 file's metadata says beyond the shared fields: both have global layers of head
# size 32 with one KV head (k_eq_v's own count, or every layer's) and a quarter of each head rotated.
def _globals(*layers):
    return {str(i): {"head_dim": 32, "num_key_value_heads": 1} for i in layers}


GEMMA4_FIELDS = {
    "gemma4-moe": dict(per_layer_config=_globals(2, 3), attention_k_eq_v=True, enable_moe_block=True, num_experts=8, top_k_experts=3,
                       moe_intermediate_size=24, num_kv_shared_layers=0, use_double_wide_mlp=False,
                       hidden_size_per_layer_input=0, num_key_value_heads=2),
    "gemma4-ple": dict(per_layer_config=_globals(1, 3), attention_k_eq_v=False, enable_moe_block=False, num_kv_shared_layers=2,
                       use_double_wide_mlp=True, hidden_size_per_layer_input=8, vocab_size_per_layer_input=512,
                       num_key_value_heads=1),
}


@pytest.mark.parametrize("name", list(GEMMA4_FIELDS))
def test_gemma4_config_fields(name, tmp_path_factory):
    hf = read_gguf_config(get_case(name, tmp_path_factory).files["Q8_0"])
    assert {k: hf.get(k) for k in GEMMA4_FIELDS[name]} == GEMMA4_FIELDS[name]
    assert hf["rope_parameters"] == {S: {"rope_type": "default", "rope_theta": 10_000.0},
                                     G: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                         "rope_theta": 1_000_000.0}}
    assert hf["head_dim"] == 16 and hf["final_logit_softcapping"] == 30.0 and hf["sliding_window"] == 4


# ---------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------


def test_tensors_are_the_gguf_packages_dequantization(case):
    """Every HF tensor, under its HF name and shape, equal to what the gguf package dequantizes
    from the file (the experts of Qwen3-MoE joined as HF holds them)."""
    hf_names = set(case.model.state_dict()) - ({"lm_head.weight"} if case.hp.get("tie_word_embeddings") else set())
    for kind, path in case.files.items():
        ours = dict(iter_gguf_tensors(path))
        ref = to_gguf.hf_state(path, case.recipes[kind])
        assert set(ours) == set(ref) == hf_names, kind
        for name, w in ours.items():
            assert w.dtype == np.float32 and w.shape == tuple(case.model.state_dict()[name].shape), name
            np.testing.assert_array_equal(w, ref[name], err_msg=f"{kind} {name}")


def test_source_dequantizes_only_what_is_asked_for(case, monkeypatch):
    """The loader's source gives every shape from the tensor table, and reads a tensor (all its
    pieces, Qwen3-MoE's gate and up stacks) only when asked for it."""
    sd = case.model.state_dict()
    source = GGUFSource(case.files["Q8_0"])
    read = []
    dequantize = gguf_mod._dequantize
    monkeypatch.setattr(gguf_mod, "_dequantize", lambda data, qtype: read.append(qtype) or dequantize(data, qtype))
    assert {n: source.shape(n) for n in source.names()} == {n: tuple(sd[n].shape) for n in source.names()}
    assert read == []
    name = "model.layers.1.mlp.experts.gate_up_proj" if case.arch == "qwen3moe" else "model.layers.1.self_attn.q_proj.weight"
    assert source.get(name).shape == tuple(sd[name].shape) and len(read) == (2 if case.arch == "qwen3moe" else 1)


def test_file_types_as_the_converter_writes_them(case):
    """What the files hold: F32 norms, vectors and routers; the rest in the file's type, or F16
    where rows are not whole blocks; the Q4_0 file's ffn_down as K-quants."""
    from gguf import GGUFReader
    types = {kind: {t.name: t.tensor_type for t in GGUFReader(str(p)).tensors} for kind, p in case.files.items()}
    q8 = types["Q8_0"]
    assert q8["token_embd.weight"] == Q.Q8_0 and q8["output_norm.weight"] == Q.F32
    assert set(types["F32"].values()) == {Q.F32}
    if case.arch == "qwen3":
        assert [types["Q4_0+K"][f"blk.{i}.ffn_down.weight"] for i in range(3)] == KQUANTS
        assert types["Q4_0+K"]["blk.0.attn_q.weight"] == Q.Q4_0
    if case.arch == "qwen3moe":
        assert q8["blk.0.ffn_gate_inp.weight"] == Q.F32 and q8["blk.0.ffn_gate_exps.weight"] == Q.Q8_0
    if case.tok_kind == "gemma" and case.hp.get("enable_moe_block"):
        assert "blk.2.attn_v.weight" not in q8 and q8["blk.0.ffn_down_exps.weight"] == Q.F16   # rows of 24
        assert q8["blk.0.ffn_gate_inp.scale"] == q8["blk.0.ffn_down_exps.scale"] == Q.F32
    elif case.tok_kind == "gemma":
        assert q8["blk.0.proj.weight"] == Q.F16 and "blk.3.attn_k.weight" not in q8        # rows of 8; shared


# ---------------------------------------------------------------------------------------------
# Logits
# ---------------------------------------------------------------------------------------------


def test_logits_match_transformers_on_the_dequantized_weights(case):
    """jaxllm's model from each file against transformers' with the file's tensors (as the gguf
    package dequantizes them) in place of its own, float32."""
    for kind, path in case.files.items():
        hf = to_gguf.load_into(copy.deepcopy(case.model), to_gguf.hf_state(path, case.recipes[kind]))
        if kind == "F32":
            got = case.engine.logits(case.ids, lengths=list(LENS))
        else:
            _, _, weights, _, _ = load_model(path, jnp.float32, "none")
            got = logits_on(case.engine, weights, case.ids, list(LENS))
        for b, row in enumerate(case.rows):
            ref = tiny.hf_logits(hf, np.asarray([row]))[0]
            err = tiny.rel_err(np.asarray(got[b, :len(row)]), ref)
            assert err < TOL, f"{kind} row {b}: relative error {err:.2e}"


# ---------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------


def test_tokenizer_matches_the_checkpoints(case):
    info = load_gguf_tokenizer(case.files["Q8_0"])
    tok, ref = info.tokenizer, case.hf_tok
    for text in TEXTS + [SPECIAL_TEXTS[case.tok_kind]]:
        plain = tok.encode(text, add_special_tokens=False).ids
        assert plain == ref(text, add_special_tokens=False)["input_ids"], text
        # Unlike their HF tokenizer, Gemma 4 files add BOS (the converter says so, and llama.cpp does)
        assert tok.encode(text).ids == [info.bos_id] * info.add_bos + ref(text)["input_ids"], text
        assert tok.decode(plain, skip_special_tokens=False) == ref.decode(plain, skip_special_tokens=False), text
        if text in TEXTS:        # Qwen's normalizer composes characters (NFC)
            assert tok.decode(plain) == (unicodedata.normalize("NFC", text) if case.tok_kind == "qwen" else text)
    assert info.chat_template == ref.chat_template
    assert (info.bos_id, info.eos_ids[0]) == (case.model.config.bos_token_id, ref.eos_token_id)
    assert info.add_bos is (case.tok_kind == "gemma")
    end = "<|im_end|>" if case.tok_kind == "qwen" else "<turn|>"
    assert ref.convert_tokens_to_ids(end) in info.eos_ids


def test_engine_tokenizer_and_chat(case):
    """The engine built from the file speaks the checkpoint's chat template and stops on its turn end."""
    tok = case.engine.tokenizer
    msgs = [{"role": "user", "content": "hi there"}]
    text = case.hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    assert tok.encode_chat(msgs) == case.hf_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.chat_tuned


# ---------------------------------------------------------------------------------------------
# Refusals
# ---------------------------------------------------------------------------------------------


def _rewritten(case, tmp_path, edit):
    """The Q8_0 file rewritten with `edit(name, array, qtype)` -> [(name, array, qtype), ...]."""
    from gguf import GGUFReader, GGUFWriter
    src = GGUFReader(str(case.files["Q8_0"]))
    path = tmp_path / "edited.gguf"
    w = GGUFWriter(str(path), case.arch)
    for field in src.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        w.add_key_value(field.name, field.contents(), field.types[0], field.types[-1] if len(field.types) > 1 else None)
    for t in src.tensors:
        for name, data, qt in edit(t.name, np.array(t.data), t.tensor_type):
            w.add_tensor(name, data, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _refused(path, monkeypatch):
    """The one-line error a load gives, before any tensor is dequantized (or the device touched)."""
    monkeypatch.setattr(gguf_mod, "_dequantize", lambda *a: pytest.fail("dequantized before refusing"))
    with pytest.raises(ModelError) as exc:
        jaxllm.load(path, quant="none", dtype="float32", max_ctx=32, caches=Caches())
    msg = str(exc.value)
    assert msg and "\n" not in msg
    return msg


def test_unsupported_quantization_is_refused(tmp_path_factory, tmp_path, monkeypatch):
    case = get_case("qwen3", tmp_path_factory)

    def edit(name, data, qt):
        if name == "blk.1.attn_k.weight":       # Q8_0 blocks -> as many Q8_1 blocks
            blocks = data.shape[1] // to_gguf.gguf.GGML_QUANT_SIZES[Q.Q8_0][1]
            data = np.zeros((data.shape[0], blocks * to_gguf.gguf.GGML_QUANT_SIZES[Q.Q8_1][1]), np.uint8)
            qt = Q.Q8_1
        return [(name, data, qt)]
    msg = _refused(_rewritten(case, tmp_path, edit), monkeypatch)
    assert "'blk.1.attn_k.weight'" in msg and "Q8_1" in msg


@pytest.mark.parametrize("name", ["qwen3", "gemma4-ple"])
def test_unknown_tensor_is_refused(name, tmp_path_factory, tmp_path, monkeypatch):
    case = get_case(name, tmp_path_factory)

    def edit(name, data, qt):
        extra = [("blk.0.attn_q.bias", np.zeros(8, np.float32), Q.F32)] if name == "output_norm.weight" else []
        return [(name, data, qt)] + extra
    msg = _refused(_rewritten(case, tmp_path, edit), monkeypatch)
    assert "unexpected tensor 'blk.0.attn_q.bias'" in msg and case.arch in msg


def test_rope_freqs_outside_gemma4_is_refused(tmp_path_factory, tmp_path, monkeypatch):
    """llama.cpp scales RoPE by a rope_freqs tensor (Llama 3's scaling); jaxllm reads it as Gemma 4's
    proportional RoPE only, and refuses it elsewhere rather than run plain RoPE."""
    case = get_case("qwen3moe", tmp_path_factory)

    def edit(name, data, qt):
        extra = [("rope_freqs.weight", np.ones(8, np.float32), Q.F32)] if name == "output_norm.weight" else []
        return [(name, data, qt)] + extra
    assert "unexpected tensor 'rope_freqs.weight'" in _refused(_rewritten(case, tmp_path, edit), monkeypatch)
