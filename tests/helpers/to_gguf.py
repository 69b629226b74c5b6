"""Tiny HF checkpoints written as GGUF files the way llama.cpp's convert_hf_to_gguf.py writes them
(Qwen3Model, Qwen3MoeModel and Gemma4Model, over TextModel), through the gguf package's own
GGUFWriter, TensorNameMap, SpecialVocab, LlamaHfVocab and quantizers; plus tiny trained tokenizers
for them, and the file's tensors dequantized by the gguf package back under the HF model's names.

Neither architecture has its Q/K rows permuted: the converter does that for llama-style models only.
"""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from tokenizers import Regex, Tokenizer, models, normalizers, pre_tokenizers, trainers

Q = gguf.GGMLQuantizationType
T = gguf.MODEL_TENSOR
ARCH = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}

CORPUS = [
    "The quick brown fox jumps over the lazy dog. Hello, world! This is a plain English sentence.",
    "def f(x):\n    return {'a': [x ** 2 for _ in range(10)]}  # comment\n",
    "numbers 1234567890 3.14159 -42 1e-6 0xDEADBEEF and    multiple   spaces\ttabs\n\nnew lines",
    "Ünïcödé àccents — “quotes” … ½ ∑ ∞ ≠ ≈ and CJK 你好，世界 日本語のテキスト 한국어 emoji 😀🎉",
    "I've been told he's there, 'RE you sure? We'll see what they'd do. URL: https://example.com/a?q=1&b=2",
] * 4


# -- tokenizers --------------------------------------------------------------------------------
def qwen_tokenizer(size: int):
    """A byte-level BPE trained on CORPUS in Qwen2's pipeline, as transformers' Qwen2Tokenizer, its
    specials and <think> added after the vocabulary (`size` tokens in all)."""
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    extra = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    t = Tokenizer(models.BPE())
    t.normalizer = normalizers.NFC()
    t.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=size - len(extra), show_progress=False,
                                                     initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    spec = json.loads(t.to_str())["model"]
    tok = Qwen2Tokenizer(vocab=spec["vocab"], merges=[tuple(m) for m in spec["merges"]], eos_token="<|im_end|>",
                         additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.add_tokens(["<think>", "</think>"])
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    return tok


def gemma_tokenizer(size: int):
    """A SentencePiece-style BPE with byte fallback trained on CORPUS in Gemma's pipeline, as
    transformers' GemmaTokenizer: the named specials first, Gemma 4's turn markers, the 256 byte
    tokens, the trained pieces, and <unusedN> up to `size`."""
    from transformers import GemmaTokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<|turn>", "<turn|>", "<|channel>"]
    t = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    t.normalizer = normalizers.Replace(" ", "\u2581")
    t.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    t.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=size - 256 - len(specials) - 8,
                                                     show_progress=False))
    spec = json.loads(t.to_str())["model"]
    pieces = [p for p, _ in sorted(spec["vocab"].items(), key=lambda kv: kv[1])]
    order = specials + [f"<0x{b:02X}>" for b in range(256)] + pieces
    order += [f"<unused{i}>" for i in range(size - len(order))]
    tok = GemmaTokenizer(vocab={p: i for i, p in enumerate(order)}, merges=[tuple(m) for m in spec["merges"]],
                         additional_special_tokens=specials[5:])
    tok.chat_template = ("{{ bos_token }}{% for m in messages %}<|turn>{{ m['role'] }}\n{{ m['content'] }}<turn|>\n"
                         "{% endfor %}{% if add_generation_prompt %}<|turn>model\n{% endif %}")
    return tok


def _gpt2_vocab(tokenizer, n_vocab: int):
    """TextModel.get_vocab_base: every id up to the model's vocabulary, [PADn] where the tokenizer
    has none, added tokens CONTROL when special (or special-looking) and USER_DEFINED otherwise."""
    reverse = {i: t for t, i in tokenizer.get_vocab().items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, types = [], []
    for i in range(n_vocab):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        token = reverse[i]
        if token in added:
            special = decoder[i].special or (token.startswith("<|") and token.endswith("|>"))
            types.append(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(token)
    return tokens, types


def _write_vocab(w, arch: str, model_dir: Path, n_vocab: int) -> None:
    if arch == "gemma4":  # Gemma4Model.set_vocab
        vocab = gguf.LlamaHfVocab(model_dir)
        visible = {"<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>", "<|tool_response>", "<tool_response|>"}
        tokens, scores, types = [], [], []
        for text, score, ty in vocab.all_tokens():
            tokens.append(text)
            scores.append(score)
            types.append(gguf.TokenType.USER_DEFINED if text.decode() in visible else ty)
        w.add_tokenizer_model("gemma4")
        w.add_token_list(tokens)
        w.add_token_scores(scores)
        w.add_token_types(types)
    else:  # TextModel._set_vocab_gpt2; the pre-tokenizer is the one Qwen3's hash names
        from transformers import AutoTokenizer

        tokens, types = _gpt2_vocab(AutoTokenizer.from_pretrained(model_dir), n_vocab)
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
    gguf.SpecialVocab(model_dir, load_merges=True).add_to_gguf(w, quiet=True)
    if arch == "gemma4":
        w.add_add_space_prefix(False)
        w.add_add_bos_token(True)


# -- metadata ----------------------------------------------------------------------------------
def _write_params(w, arch: str, hp: dict) -> None:
    """TextModel.set_gguf_parameters, then Qwen2Moe's or Gemma3's and Gemma4's own."""
    rope = hp.get("rope_parameters") or {}
    w.add_block_count(hp["num_hidden_layers"])
    w.add_context_length(hp["max_position_embeddings"])
    w.add_embedding_length(hp["hidden_size"])
    w.add_feed_forward_length(hp["intermediate_size"])
    w.add_head_count(hp["num_attention_heads"])
    w.add_head_count_kv(hp["num_key_value_heads"])
    w.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    if "sliding_attention" in rope:
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_norm_eps"])
    if hp.get("num_local_experts") or hp.get("num_experts"):
        w.add_expert_count(hp.get("num_local_experts") or hp["num_experts"])
    if hp.get("num_experts_per_tok") or hp.get("top_k_experts"):
        w.add_expert_used_count(hp.get("num_experts_per_tok") or hp.get("top_k_experts"))
    w.add_key_length(hp["head_dim"])
    w.add_value_length(hp["head_dim"])
    if hp.get("moe_intermediate_size"):
        w.add_expert_feed_forward_length(hp["moe_intermediate_size"])
    if arch != "gemma4":
        return
    n, types = hp["num_hidden_layers"], hp["layer_types"]
    swa = [t == "sliding_attention" for t in types]
    if hp.get("final_logit_softcapping"):
        w.add_final_logit_softcapping(hp["final_logit_softcapping"])
    w.add_sliding_window(hp["sliding_window"])
    w.add_shared_kv_layers(hp.get("num_kv_shared_layers", 0))
    w.add_embedding_length_per_layer_input(hp.get("hidden_size_per_layer_input") or 0)
    w.add_sliding_window_pattern(swa)
    w.add_key_length(hp["global_head_dim"])
    w.add_value_length(hp["global_head_dim"])
    w.add_key_length_swa(hp["head_dim"])
    w.add_value_length_swa(hp["head_dim"])
    first_shared = n - hp.get("num_kv_shared_layers", 0)
    if hp.get("use_double_wide_mlp"):
        ff = hp["intermediate_size"]
        w.add_feed_forward_length([ff if i < first_shared else 2 * ff for i in range(n)])
    if hp.get("num_global_key_value_heads") is not None:
        kv, gkv = hp["num_key_value_heads"], hp["num_global_key_value_heads"]
        w.add_head_count_kv([kv if s else gkv for s in swa])
    w.add_rope_dimension_count(hp["global_head_dim"])
    w.add_rope_dimension_count_swa(hp["head_dim"])


# -- tensors -----------------------------------------------------------------------------------
def _tensors(arch: str, model, hp: dict):
    """(gguf name, float32 array, (HF name, piece, pieces) or None) in the converter's order."""
    tmap = gguf.get_tensor_name_map(ARCH[arch], hp["num_hidden_layers"])
    if arch == "gemma4":  # Gemma4Model.generate_extra_tensors: proportional RoPE as freq factors
        full = hp["rope_parameters"]["full_attention"]
        rot = int(hp["global_head_dim"] * full["partial_rotary_factor"] / 2)
        factors = [1.0] * rot + [1e30] * (hp["global_head_dim"] // 2 - rot)
        yield "rope_freqs.weight", np.array(factors, np.float32), None
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and hp.get("tie_word_embeddings"):
            continue  # not in the checkpoint the converter reads
        a = t.detach().float().numpy()
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        if name.endswith("router.scale"):
            yield f"{gguf.TENSOR_NAMES[T.FFN_GATE_INP].format(bid=bid)}.scale", a, (name, 0, 1)
        elif name.endswith("router.per_expert_scale"):
            yield f"{gguf.TENSOR_NAMES[T.FFN_DOWN_EXP].format(bid=bid)}.scale", a, (name, 0, 1)
        elif arch == "qwen3moe" and name.endswith("mlp.experts.gate_up_proj"):
            # the checkpoint's experts.<e>.gate_proj / up_proj, stacked per projection
            f = a.shape[1] // 2
            yield f"blk.{bid}.ffn_gate_exps.weight", a[:, :f], (name, 0, 2)
            yield f"blk.{bid}.ffn_up_exps.weight", a[:, f:], (name, 1, 2)
        else:
            g = tmap.get_name(name if name.endswith(".weight") else name + ".weight", try_suffixes=(".weight",))
            assert g is not None, name
            yield g, a, (name, 0, 1)


def random_kquant(shape, qtype, rng) -> np.ndarray:
    """Blocks of a K-quant drawn at random (gguf-py has no K-quant encoder), their scales d (and
    dmin) set so the values stay near the model's own (|w| <~ 0.3)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (*shape[:-1], shape[-1] // block, size), dtype=np.uint8)
    if qtype == Q.Q6_K:  # ql, qh, int8 scales, then d: d * scale * (q - 32)
        raw[..., -2:] = np.array([3e-5], np.float16).view(np.uint8)
    else:  # d, dmin first: d * scale * q - dmin * min
        d = {Q.Q4_K: 2.5e-4, Q.Q5_K: 1.2e-4}[qtype]
        raw[..., 0:2] = np.array([d], np.float16).view(np.uint8)
        raw[..., 2:4] = np.array([4 * d], np.float16).view(np.uint8)
    return raw.reshape(*shape[:-1], -1)


def write(path, arch: str, model, hp: dict, model_dir: Path, qtype=Q.F32, down_kquants=None) -> dict:
    """Write `model` (whose config.json and tokenizer lie in `model_dir`) as llama.cpp's converter
    does with --outtype `qtype`; `down_kquants`: the ffn_down of layer i as random blocks of
    down_kquants[i] instead. Returns gguf name -> (HF name, piece, pieces)."""
    w = gguf.GGUFWriter(str(path), arch)
    _write_params(w, arch, hp)
    recipe, rng = {}, np.random.default_rng(0)
    for name, a, source in _tensors(arch, model, hp):
        recipe[name] = source
        bid = next((int(p) for p in name.split(".") if p.isdecimal()), None)
        qt = qtype
        if a.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or ".ffn_gate_inp." in name:
            qt = Q.F32
        if down_kquants and name == f"blk.{bid}.ffn_down.weight":
            w.add_tensor(name, random_kquant(a.shape, down_kquants[bid], rng), raw_dtype=down_kquants[bid])
            continue
        try:
            data = gguf.quants.quantize(a, qt)
        except gguf.QuantError:  # rows not a whole number of blocks: the converter falls back to F16
            qt, data = Q.F16, gguf.quants.quantize(a, Q.F16)
        w.add_tensor(name, data, raw_dtype=qt)
    _write_vocab(w, arch, model_dir, hp["vocab_size"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return recipe


def dequantized(path) -> dict[str, np.ndarray]:
    """Every tensor of the file as the gguf package reads and dequantizes it, HF-shaped."""
    out = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = np.array(a, np.float32).reshape(tuple(int(d) for d in reversed(t.shape)))
    return out


def hf_state(path, recipe: dict) -> dict[str, np.ndarray]:
    """The file's tensors, dequantized by the gguf package, under the HF names they came from."""
    pieces: dict[str, dict] = {}
    for name, a in dequantized(path).items():
        if recipe[name] is not None:
            hf, k, _ = recipe[name]
            pieces.setdefault(hf, {})[k] = a
    return {hf: got[0] if len(got) == 1 else np.concatenate([got[k] for k in sorted(got)], axis=-2)
            for hf, got in pieces.items()}


def load_into(model, state: dict[str, np.ndarray]):
    """`model` with `state` in place of its weights (a tied head follows the embedding)."""
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(v) for k, v in state.items()}, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model
