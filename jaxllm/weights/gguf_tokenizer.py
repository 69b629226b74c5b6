"""A GGUF file's tokenizer rebuilt as a `tokenizers` pipeline: that of the model's own
tokenizer.json, so that ids match its HF tokenizer's. For Gemma that is also what transformers builds
from the file (`integrations/gguf/gguf_tokenizer_mapping.py`); for Qwen transformers drops the NFC
normalization that Qwen2Tokenizer has, we keep it.

- "llama" (Gemma 3): SentencePiece-style BPE with byte fallback; the file has no merges, so they are
  rebuilt from the vocabulary.
- "gemma4": the same pipeline, with the merges the file carries.
- "gpt2" (Qwen3): byte-level BPE with the file's merges, text split by the pre-tokenizer's regex.
"""

from __future__ import annotations

import dataclasses
import re

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from jaxllm.errors import ModelError

# transformers' Qwen2Tokenizer PRETOKENIZE_REGEX, the split Qwen2's and Qwen3's merges were learned on
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# tokenizer.ggml.pre -> the split it names
PRE_TOKENIZER_SPLITS = {"qwen2": _QWEN2_SPLIT}

# Turn ends a chat stops on beside eos: Gemma 3's, Gemma 4's, Qwen3's, and Qwen's end of text, as
# their generation_config.json lists them.
_TURN_ENDS = ("<end_of_turn>", "<turn|>", "<|im_end|>", "<|endoftext|>")


@dataclasses.dataclass
class GGUFTokenizerInfo:
    tokenizer: Tokenizer  # encode() adds BOS when add_bos
    bos_id: int | None
    eos_ids: list[int]
    pad_id: int | None
    add_bos: bool
    chat_template: str | None
    chat_tuned: bool


# How llama.cpp's converter names an instruction tune (general.finetune "it" of gemma-3-270m-it,
# "Instruct" of Qwen2.5-7B-Instruct), as a word of the finetune, name or basename.
_CHAT_TUNE_WORDS = {"it", "instruct", "chat"}


def chat_tuned(meta: dict) -> bool:
    """Whether a GGUF's model is chat-tuned: the file carries a chat template, or its name says so."""
    if meta.get("tokenizer.chat_template"):
        return True
    words = {
        w
        for key in ("general.finetune", "general.name", "general.basename")
        for w in re.split(r"[^a-z0-9]+", str(meta.get(key) or "").lower())
    }
    return bool(words & _CHAT_TUNE_WORDS)


def merges_from_vocab(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
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


def _sentencepiece(vocab: dict[str, int], merges, unk: str | None) -> Tokenizer:
    """transformers' GemmaTokenizer pipeline: spaces as U+2581, split after each space (no prefix
    space), bytes of unknown characters as <0xNN> tokens."""
    tok = Tokenizer(BPE(vocab=vocab, merges=merges, unk_token=unk, fuse_unk=True, byte_fallback=True, dropout=None))
    tok.normalizer = normalizers.Replace(" ", "\u2581")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tok


def _byte_level(vocab: dict[str, int], merges, split: str) -> Tokenizer:
    """transformers' Qwen2Tokenizer pipeline: NFC, the regex split, then bytes as GPT-2's alphabet."""
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(split), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def build_tokenizer(meta: dict, shown: str) -> GGUFTokenizerInfo:
    """The tokenizer, ids and chat template of a GGUF's metadata (`shown`: the file, for errors)."""
    model = meta.get("tokenizer.ggml.model")
    file_tokens = meta.get("tokenizer.ggml.tokens")
    if file_tokens is None:
        raise ModelError(f"{shown}: GGUF file has no tokenizer.ggml.tokens")
    token_types = meta.get("tokenizer.ggml.token_type") or []
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges") or ()]

    def token_at(key: str, default: str | None = None) -> str | None:
        i = meta.get(key)
        return file_tokens[i] if i is not None and 0 <= i < len(file_tokens) else default

    if model in ("llama", "gemma4"):
        # Gemma 3's files spell tokens made only of 2+ spaces with real spaces, but the normalizer
        # turns spaces into U+2581 before lookup: respell them so they (and merges built from them)
        # can match. (Gemma 4's converter writes its tokenizer.json's spelling.)
        tokens = file_tokens
        if model == "llama":
            tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in file_tokens]
        vocab = {t: i for i, t in enumerate(tokens)}
        # Without merges in the file, rebuild them from the vocabulary, ranked by position in the
        # file (Gemma's scores do not follow merge order; its token order does).
        merges = merges or merges_from_vocab(vocab, {t: -i for i, t in enumerate(tokens)})
        tok = _sentencepiece(vocab, merges, token_at("tokenizer.ggml.unknown_token_id", "<unk>"))
        named = [  # GemmaTokenizer's named special tokens
            token_at("tokenizer.ggml.padding_token_id", "<pad>"),
            token_at("tokenizer.ggml.eos_token_id", "<eos>"),
            token_at("tokenizer.ggml.bos_token_id", "<bos>"),
            token_at("tokenizer.ggml.unknown_token_id", "<unk>"),
            "<mask>",  # its default; the file has no key for it
        ]
    elif model == "gpt2":
        pre = meta.get("tokenizer.ggml.pre")
        if pre not in PRE_TOKENIZER_SPLITS:
            supported = ", ".join(PRE_TOKENIZER_SPLITS)
            raise ModelError(f"{shown}: unsupported GGUF pre-tokenizer {pre!r} (supported: {supported})")
        vocab = {t: i for i, t in enumerate(file_tokens)}
        tok = _byte_level(vocab, merges, PRE_TOKENIZER_SPLITS[pre])
        named = []
    else:
        raise ModelError(f"{shown}: unsupported GGUF tokenizer model {model!r} (supported: gemma4, gpt2, llama)")

    # Special tokens, matched whole in raw text: the named ones plus everything the file marks
    # CONTROL; USER_DEFINED ones (Gemma's "\n"/space runs, Qwen3's <think>) as non-special added
    # tokens -- only those still spelled as in the vocab, which leaves out Gemma 3's respelled
    # space runs, exactly as transformers does.
    control = [t for t, ty in zip(file_tokens, token_types) if ty == TokenType.CONTROL]
    specials = list(dict.fromkeys(t for t in named + control if t in vocab))
    tok.add_special_tokens([AddedToken(t, normalized=False, special=True) for t in specials])
    user = [t for t, ty in zip(file_tokens, token_types) if ty == TokenType.USER_DEFINED and t in vocab]
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in user])

    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    eos_id = meta.get("tokenizer.ggml.eos_token_id")
    # transformers' default for a "llama" (SentencePiece) vocabulary that does not say: add BOS.
    # Unlike transformers, follow a gemma4 file's own add_bos_token (true), as llama.cpp does: a
    # raw prompt starts with <bos>, and a chat template writes it itself either way.
    add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", model == "llama")) and bos_id is not None
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

    eos_ids = list(dict.fromkeys(i for i in (eos_id, meta.get("tokenizer.ggml.eot_token_id")) if i is not None))
    eos_ids += [vocab[t] for t in _TURN_ENDS if t in vocab and vocab[t] not in eos_ids]
    return GGUFTokenizerInfo(
        tokenizer=tok,
        bos_id=bos_id,
        eos_ids=eos_ids,
        pad_id=meta.get("tokenizer.ggml.padding_token_id"),
        add_bos=add_bos,
        chat_template=meta.get("tokenizer.chat_template"),
        chat_tuned=chat_tuned(meta),
    )
