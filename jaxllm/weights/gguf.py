"""GGUF loading for the `gemma3` architecture: config, weights and tokenizer.

Everything here reproduces what transformers (5.x) builds from the same file -- its legacy GGUF path
(`modeling_gguf_pytorch_utils.load_gguf_checkpoint` with `Gemma2TensorProcessor`, and
`integrations/gguf/gguf_tokenizer_mapping.gemma_tokenizer`) -- so that our model computes what
`AutoModelForCausalLM.from_pretrained(dir, gguf_file=...)` computes. transformers is not imported:
it is only the test-time reference. Deliberate differences are marked "Unlike transformers".
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from jaxllm.errors import ModelError
from jaxllm.weights.gguf_file import GGUFFile, SplitFile

SUPPORTED_ARCHITECTURES = ("gemma3",)

# llama.cpp hard-codes these for gemma3 instead of writing them to the file (llama-model.cpp):
# every 6th layer is global, local layers use theta 10k.
_GEMMA3_SLIDING_WINDOW_PATTERN = 6
_GEMMA3_LOCAL_ROPE_THETA = 10_000.0

# gguf tensor name (after `blk.N.`) -> HF module name (after `model.layers.N.`).
_LAYER_TENSORS = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",  # only present when the head is not tied to the embedding
}

# llama.cpp token types (gguf.TokenType)
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4


# ----------------------------------------------------------------------------------------------
# Reading the file
# ----------------------------------------------------------------------------------------------

# A load asks for config, tensors and tokenizer separately: keep the last few parsed files (each is
# a memmap plus parsed metadata, not the tensor data).
_reader_cache: dict = {}
_READER_CACHE_SIZE = 4


def _name(path) -> str:
    """A GGUF file's name (a `SplitFile` is named as its parts joined)."""
    return path.name if isinstance(path, SplitFile) else Path(path).name


def _reader(path):
    """A parsed `GGUFFile` for `path` (a file, or a `SplitFile`), or ModelError with a one-line reason."""
    parts = path.parts if isinstance(path, SplitFile) else (Path(path),)
    shown = path.name if isinstance(path, SplitFile) else parts[0]
    try:
        key = tuple((str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns) for p in parts)
        if key in _reader_cache:
            return _reader_cache[key]
        with open(parts[0], "rb") as f:
            magic = f.read(4)
    except OSError as err:
        raise ModelError(f"cannot read GGUF file {shown}: {err.strerror or err}") from None
    if magic != b"GGUF":
        raise ModelError(f"{shown}: not a GGUF file (it does not start with the GGUF magic)")
    try:
        reader = GGUFFile(path)
    except Exception as err:  # damaged files surface as ValueError/IndexError/struct errors
        reason = " ".join(str(err).split())[:120] or type(err).__name__  # one line, bounded
        raise ModelError(f"{shown}: truncated or corrupt GGUF file ({reason})") from None
    while len(_reader_cache) >= _READER_CACHE_SIZE:
        del _reader_cache[next(iter(_reader_cache))]  # oldest first (dicts keep insertion order)
    _reader_cache[key] = reader
    return reader


def _metadata(reader) -> dict:
    """All key/value fields as Python values (strings decoded, arrays as lists)."""
    return reader.meta


def _checked_metadata(path) -> tuple[object, dict]:
    reader = _reader(path)
    meta = _metadata(reader)
    arch = meta.get("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelError(
            f"unsupported GGUF architecture {arch!r} in {_name(path)} (supported: {', '.join(SUPPORTED_ARCHITECTURES)})"
        )
    return reader, meta


def _token_field(reader, path) -> list[str]:
    tokens = reader.meta.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise ModelError(f"{_name(path)}: GGUF file has no tokenizer.ggml.tokens")
    return tokens


def _required(meta: dict, key: str, path):
    if meta.get(key) is None:
        raise ModelError(f"{_name(path)}: GGUF metadata key {key!r} is missing")
    return meta[key]


# ----------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------


def read_gguf_config(path) -> dict:
    """An HF `config.json`-style dict (Gemma3TextConfig) for a gemma3 GGUF file."""
    reader, meta = _checked_metadata(path)

    def key(name):
        return _required(meta, f"gemma3.{name}", path)

    n_layers = int(key("block_count"))
    hidden = int(key("embedding_length"))
    n_heads = int(key("attention.head_count"))
    head_dim = int(key("attention.key_length"))

    # Which layers are sliding. Newer files may state the pattern; a bool list is per layer
    # (True = sliding). An int n follows llama.cpp: layer i is sliding iff n == 0 or i % n < n - 1,
    # which for n = 6 is Gemma3TextConfig's own rule ((i + 1) % 6 != 0 -> sliding).
    pattern = meta.get("gemma3.attention.sliding_window_pattern", _GEMMA3_SLIDING_WINDOW_PATTERN)
    if isinstance(pattern, list):
        sliding = [bool(s) for s in pattern]
        if len(sliding) != n_layers:
            raise ModelError(f"{_name(path)}: sliding_window_pattern has {len(sliding)} entries, not {n_layers}")
    else:
        n = int(pattern)
        sliding = [n == 0 or i % n < n - 1 for i in range(n_layers)]
    layer_types = ["sliding_attention" if s else "full_attention" for s in sliding]

    full_rope = {"rope_type": "default", "rope_theta": float(key("rope.freq_base"))}
    # Unlike transformers (whose gemma3 GGUF mapping ignores rope.scaling.*, so it would run a 4B+
    # file with plain RoPE), honour llama.cpp's linear scaling, which like HF applies to global
    # layers only. The embedded 270M file has none, so there both agree.
    if meta.get("gemma3.rope.scaling.type") == "linear" and meta.get("gemma3.rope.scaling.factor"):
        full_rope = {**full_rope, "rope_type": "linear", "factor": float(meta["gemma3.rope.scaling.factor"])}
    local_theta = float(meta.get("gemma3.rope.freq_base_swa", _GEMMA3_LOCAL_ROPE_THETA))

    # Unlike transformers, which leaves query_pre_attn_scalar at its default 256: that equals
    # head_dim for every Gemma 3 but 27B (62 layers), whose HF config has hidden/heads = 168.
    # llama.cpp special-cases 27B the same way; follow it so such a file is right too.
    query_pre_attn_scalar = hidden // n_heads if n_layers == 62 else head_dim

    tensor_names = {t.name for t in reader.tensors}
    config = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        # as transformers: the file's vocab_size key if any, else the number of tokens
        "vocab_size": int(meta.get("gemma3.vocab_size") or len(_token_field(reader, path))),
        "hidden_size": hidden,
        "intermediate_size": int(key("feed_forward_length")),
        "num_hidden_layers": n_layers,
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(key("attention.head_count_kv")),
        "head_dim": head_dim,
        # kept as the float32 the file stores (9.99999997e-07), as transformers does
        "rms_norm_eps": float(key("attention.layer_norm_rms_epsilon")),
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": local_theta},
            "full_attention": full_rope,
        },
        # the same thetas under the pre-`rope_parameters` names, for readers of older configs
        "rope_theta": full_rope["rope_theta"],
        "rope_local_base_freq": local_theta,
        "sliding_window": int(key("attention.sliding_window")),
        "layer_types": layer_types,
        "query_pre_attn_scalar": query_pre_attn_scalar,
        "max_position_embeddings": int(key("context_length")),
        "final_logit_softcapping": meta.get("gemma3.final_logit_softcapping"),
        "attn_logit_softcapping": meta.get("gemma3.attn_logit_softcapping"),
        "hidden_activation": "gelu_pytorch_tanh",
        "attention_bias": False,
        "use_bidirectional_attention": False,
        # llama.cpp writes output.weight only when the head is not the embedding matrix
        "tie_word_embeddings": "output.weight" not in tensor_names,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
    }
    if isinstance(pattern, int) and pattern > 0:
        config["sliding_window_pattern"] = pattern
    return config


# ----------------------------------------------------------------------------------------------
# Tensors
# ----------------------------------------------------------------------------------------------


def _hf_name(gguf_name: str) -> str | None:
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot:
        return None
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_TENSORS:
        return f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.{suffix}"
    if stem in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[stem]}.{suffix}"
    return None


_DEQUANT_CHUNK = 1 << 22  # elements a step: big enough that numpy's per-call cost vanishes


def _dequantize(data: np.ndarray, qtype) -> np.ndarray:
    """`gguf.quants.dequantize`, in chunks of rows a few MB each. gguf's own splits every tensor
    into groups of 16 rows, and that per-group overhead was most of a load's dequantization time;
    the values are the same (each block is dequantized on its own either way)."""
    from gguf import quants  # half a second: loaded only where a GGUF file is read

    kind = getattr(quants, "_type_traits", {}).get(qtype)
    if kind is None or data.ndim < 1 or data.dtype != np.uint8:
        return quants.dequantize(data, qtype)
    kind.init_grid()
    rows = data.reshape(-1, data.shape[-1])
    step = max(1, _DEQUANT_CHUNK // max(1, rows.shape[1]))
    out = np.empty((rows.shape[0], rows.shape[1] // kind.type_size * kind.block_size), np.float32)
    for i in range(0, rows.shape[0], step):
        out[i : i + step] = kind.dequantize_rows(rows[i : i + step])
    return out.reshape(*data.shape[:-1], out.shape[-1])


def iter_gguf_tensors(path) -> Iterator[tuple[str, np.ndarray]]:
    """Yield `(hf_name, float32 array)` for every tensor, one at a time, in file order.

    Shapes are HF's: `dequantize` returns numpy shape = reversed ggml `ne`, which for linears is
    already [out_features, in_features], so nothing is transposed. Gemma's llama.cpp converter does
    not permute q/k (only the llama one does), so there is nothing to undo there either.
    """
    reader, _ = _checked_metadata(path)
    for tensor in reader.tensors:
        name = _hf_name(tensor.name)
        if name is None:
            raise ModelError(f"{_name(path)}: unexpected tensor {tensor.name!r} for gemma3")
        try:
            weights = _dequantize(tensor.data, tensor.tensor_type)
        except NotImplementedError:
            raise ModelError(
                f"{_name(path)}: tensor {tensor.name!r} uses quantization "
                f"{tensor.tensor_type.name}, which gguf cannot dequantize"
            ) from None
        # copy: F32 comes back as a view of the read-only memmap
        weights = np.array(weights, dtype=np.float32).reshape(tuple(int(d) for d in reversed(tensor.shape)))
        if tensor.name.endswith("norm.weight"):
            # llama.cpp stores Gemma RMSNorm weights as (1 + w); HF's Gemma3RMSNorm multiplies by
            # (1 + w) itself, so take the 1 back off (transformers' Gemma2TensorProcessor does the
            # same; it subtracts in the stored dtype, we in float32 -- equal for F32 norms).
            weights -= 1.0
        yield name, weights


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class GGUFTokenizerInfo:
    tokenizer: "tokenizers.Tokenizer"  # noqa: F821 -- encode() adds BOS when add_bos
    bos_id: int | None
    eos_ids: list[int]
    pad_id: int | None
    add_bos: bool
    chat_template: str | None
    chat_tuned: bool


# How llama.cpp's converter names an instruction tune (general.finetune "it" of gemma-3-270m-it,
# "Instruct" of Qwen2.5-7B-Instruct), as a word of the finetune, name or basename.
_CHAT_TUNE_WORDS = {"it", "instruct", "chat"}


def _chat_tuned(meta: dict) -> bool:
    """Whether a GGUF's model is chat-tuned: the file carries a chat template, or its name says so."""
    if meta.get("tokenizer.chat_template"):
        return True
    words = {
        w
        for key in ("general.finetune", "general.name", "general.basename")
        for w in re.split(r"[^a-z0-9]+", str(meta.get(key) or "").lower())
    }
    return bool(words & _CHAT_TUNE_WORDS)


def _merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """transformers' `generate_merges(vocab, vocab_scores)`: every split of a token into two
    vocabulary pieces, best score first, then longer left piece, then longer right piece."""
    merges = []
    for piece, score in scores.items():
        local = [
            (piece[:i], piece[i:], score) for i in range(1, len(piece)) if piece[:i] in vocab and piece[i:] in vocab
        ]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges.extend(local)
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _token_strings(reader, path) -> list[str]:
    return _token_field(reader, path)


def load_gguf_tokenizer(path) -> GGUFTokenizerInfo:
    """Rebuild the file's SentencePiece-style vocabulary as a `tokenizers` BPE tokenizer, the way
    transformers' `gemma_tokenizer` + `GemmaTokenizer` do for a GGUF (`tokenizer.ggml.model` =
    "llama"), so ids match `AutoTokenizer.from_pretrained(dir, gguf_file=...)` exactly."""
    reader, meta = _checked_metadata(path)
    model = meta.get("tokenizer.ggml.model")
    if model != "llama":
        raise ModelError(f"{_name(path)}: unsupported GGUF tokenizer model {model!r} for gemma3 (expected 'llama')")
    file_tokens = _token_strings(reader, path)
    token_types = meta.get("tokenizer.ggml.token_type") or []

    # Tokens made only of 2+ spaces are stored with real spaces, but the normalizer turns spaces
    # into U+2581 before lookup: respell them so they (and merges built from them) can match.
    tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in file_tokens]
    vocab = {t: i for i, t in enumerate(tokens)}
    # The file has no merges. Rebuild them from the vocabulary, ranked by position in the file
    # (Gemma's scores do not follow merge order; its token order does).
    ranks = {t: -i for i, t in enumerate(tokens)}
    merges = _merges_from_vocab(vocab, ranks)

    def token_at(key: str, default: str | None = None) -> str | None:
        i = meta.get(key)
        return file_tokens[i] if i is not None and 0 <= i < len(file_tokens) else default

    unk = token_at("tokenizer.ggml.unknown_token_id", "<unk>")
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    # no Metaspace / prefix space: Gemma splits after each space and never prepends one
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])

    # Special tokens, matched whole in raw text: GemmaTokenizer's named ones (pad/eos/bos/unk/mask)
    # plus everything the file marks CONTROL; USER_DEFINED ones (the "\n"/space runs,
    # "[multimodal]") as non-special added tokens -- only those still spelled as in the vocab,
    # which leaves out the respelled space runs, exactly as transformers does.
    named = [
        token_at("tokenizer.ggml.padding_token_id", "<pad>"),
        token_at("tokenizer.ggml.eos_token_id", "<eos>"),
        token_at("tokenizer.ggml.bos_token_id", "<bos>"),
        token_at("tokenizer.ggml.unknown_token_id", "<unk>"),
        "<mask>",  # GemmaTokenizer's default; the file has no key for it
    ]
    control = [t for t, ty in zip(file_tokens, token_types) if ty == _TOKEN_CONTROL]
    specials = list(dict.fromkeys(t for t in named + control if t in vocab))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [t for t, ty in zip(file_tokens, token_types) if ty == _TOKEN_USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    # transformers' default for a "llama" (SentencePiece) vocabulary that does not say: add BOS
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True)) and bos_id is not None
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False)) and eos_id is not None
    # encode(text) adds them, encode(text, add_special_tokens=False) does not (as HF's template)
    ends = [(file_tokens[i], i) for i, on in ((bos_id, add_bos), (eos_id, add_eos)) if on]
    first = [ends[0][0]] if add_bos else []
    last = [ends[-1][0]] if add_eos else []
    tok.post_processor = processors.TemplateProcessing(
        single=first + ["$A"] + last,
        pair=first + ["$A"] + last + [f"{t}:1" for t in first] + ["$B:1"] + [f"{t}:1" for t in last],
        special_tokens=ends,
    )

    # Gemma 3 chat turns end with <end_of_turn>, not <eos>; HF's gemma-3 generation_config lists
    # both as eos_token_id ([1, 106]), so stop on either.
    eos_ids = [eos_id] if eos_id is not None else []
    end_of_turn = vocab.get("<end_of_turn>")
    if end_of_turn is not None and end_of_turn not in eos_ids:
        eos_ids.append(end_of_turn)

    return GGUFTokenizerInfo(
        tokenizer=tok,
        bos_id=bos_id,
        eos_ids=eos_ids,
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        add_bos=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
        chat_tuned=_chat_tuned(meta),
    )
