"""Tokenizer (the `tokenizers` library) plus the chat template, rendered with jinja2."""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from jaxllm.errors import ModelError, RequestError


def _token_text(v) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised as a dict
        return v.get("content")
    return v


class Tokenizer:
    """`chat_tuned`: the model answers chat turns, so a prompt takes the chat template by default.
    Its files say so (a template of their own, or a GGUF named as an instruction tune); a template
    the family supplies for a model that has none (`fallback_template`) serves chat requests but
    does not make the model chat-tuned."""

    def __init__(
        self,
        tok,
        *,
        bos_id=None,
        eos_ids=(),
        add_bos=False,
        chat_template=None,
        bos_token=None,
        eos_token=None,
        chat_tuned=False,
    ):
        self.tok = tok
        self._pieces: dict[int, str] = {}
        self.bos_id = bos_id
        self.eos_ids = tuple(eos_ids)
        self.add_bos = add_bos
        self.chat_template = chat_template
        self.chat_tuned = chat_tuned
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template = None

    # -- construction ----------------------------------------------------------------------------
    @classmethod
    def from_hf_dir(cls, d: Path, fallback_template: str | None = None) -> Tokenizer | None:

        path = d / "tokenizer.json"
        if not path.exists():
            return None
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 (the tokenizers library raises plain Exception)
            raise ModelError(f"{path}: unreadable tokenizer ({str(e).splitlines()[0]})") from None
        tc = read_json(d / "tokenizer_config.json")
        template = tc.get("chat_template")
        if (d / "chat_template.jinja").exists():  # transformers >= 4.43 writes it apart
            template = (d / "chat_template.jinja").read_text()
        elif (d / "chat_template.json").exists():
            template = read_json(d / "chat_template.json").get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        bos, eos = _token_text(tc.get("bos_token")), _token_text(tc.get("eos_token"))
        gen = read_json(d / "generation_config.json")
        eos_ids = []
        for v in [gen.get("eos_token_id"), tok.token_to_id(eos) if eos else None]:
            for i in v if isinstance(v, list) else [v]:
                if i is not None and i not in eos_ids:
                    eos_ids.append(i)
        return cls(
            tok,
            bos_id=tok.token_to_id(bos) if bos else None,
            eos_ids=eos_ids,
            add_bos=bool(tc.get("add_bos_token", False)),
            chat_template=template or fallback_template,
            bos_token=bos,
            eos_token=eos,
            chat_tuned=bool(template),
        )

    # -- use -------------------------------------------------------------------------------------
    def encode(self, text: str, add_special: bool = True) -> list[int]:
        # `encode` holds the GIL throughout (a 3.5 MB text: 3 s on one CPU core, in which the event
        # loop and every other thread stand still); `encode_batch` gives the same ids without it
        if len(text) > LONG_TEXT:
            ids = self.tok.encode_batch([text], add_special_tokens=add_special)[0].ids
        else:
            ids = self.tok.encode(text, add_special_tokens=add_special).ids
        if add_special and self.add_bos and self.bos_id is not None and ids[:1] != [self.bos_id]:
            ids = [self.bos_id] + ids
        return ids

    @functools.cached_property
    def max_bytes_per_token(self) -> int | None:
        """The most UTF-8 bytes of text one token can stand for, so that a text longer than
        `n * max_bytes_per_token` bytes is known to take more than n tokens without tokenizing it;
        None where the tokenizer can drop or merge characters without bound (a normalizer that
        strips accents or spaces, a pre-tokenizer that removes what it splits on, fused unknowns).
        A token's own string (`▁the`, `Ġthe`, `<0x0A>`) is at least as long as the text it reads,
        as is its decoded text (which drops a leading space); Unicode normalizers and lowercasing
        shorten text at most 4-fold (a 4-byte mathematical letter to ASCII)."""
        spec = json.loads(self.tok.to_str())
        factor = _shrink_factor(spec.get("normalizer"))
        if factor is None or not _keeps_characters(spec.get("pre_tokenizer")):
            return None
        model = spec.get("model") or {}
        if model.get("type") not in ("BPE", "WordLevel") or (
            model.get("fuse_unk") and model.get("unk_token") and not model.get("byte_fallback")
        ):
            return None
        n = self.tok.get_vocab_size(with_added_tokens=True)
        longest = max(
            max(
                len((self.tok.id_to_token(i) or "").encode()),
                len(self.tok.decode([i], skip_special_tokens=False).encode()),
            )
            for i in range(n)
        )
        return max(longest, 1) * factor

    def decode(self, ids, skip_special: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special)

    def piece(self, token_id: int) -> str:
        """One token's own text, special tokens included (log-probabilities list every alternative
        this way), remembered: a served token's alternatives are mostly the same few thousand ids."""
        s = self._pieces.get(token_id)
        if s is None:
            s = self._pieces[token_id] = self.tok.decode([token_id], skip_special_tokens=False)
        return s

    def render_chat(
        self,
        messages: list[dict],
        add_generation_prompt: bool = True,
        tools: list[dict] | None = None,
        **template_kwargs,
    ) -> str:
        """The chat template applied as transformers' apply_chat_template does: `tools` (OpenAI
        function definitions) and keyword arguments such as `enable_thinking` reach the template."""
        if not self.chat_template:
            raise RequestError("this model has no chat template; send a raw prompt instead")
        try:
            if self._template is None:
                self._template = _environment().from_string(self.chat_template)
            return self._template.render(
                **template_kwargs,
                messages=messages,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as e:
            raise RequestError(f"chat template rejected the messages: {e}") from None

    def template_variables(self) -> set[str]:
        """The names the chat template reads (`tools`, `enable_thinking`, ...): a request's tools
        must not go to a template that would drop them."""
        if not self.chat_template:
            return set()
        try:
            return jinja2.meta.find_undeclared_variables(_environment().parse(self.chat_template))
        except jinja2.TemplateError:
            return set()

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, **template_kwargs) -> list[int]:
        # The template writes BOS itself, as transformers' apply_chat_template does.
        return self.encode(self.render_chat(messages, tools=tools, **template_kwargs), add_special=False)


LONG_TEXT = 16384  # characters from which `Tokenizer.encode` lets go of the GIL
UNICODE_NORMALIZERS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}


def _shrink_factor(n) -> int | None:
    """How many times a tokenizer.json normalizer can shorten a text's UTF-8 (None: without bound)."""
    if n is None:
        return 1
    kind = n.get("type")
    if kind == "Sequence":
        factors = [_shrink_factor(x) for x in n.get("normalizers", [])]
        return None if None in factors else max(factors, default=1)
    if kind == "Prepend":
        return 1
    if kind == "Replace":
        pattern = (n.get("pattern") or {}).get("String")
        return 1 if pattern is not None and len(n.get("content", "").encode()) >= len(pattern.encode()) else None
    return 4 if kind in UNICODE_NORMALIZERS else None


def _keeps_characters(p) -> bool:
    """Whether a tokenizer.json pre-tokenizer keeps every character of its text."""
    if p is None:
        return True
    if p.get("type") == "Sequence":
        return all(_keeps_characters(x) for x in p.get("pretokenizers", []))
    return (
        p.get("type") in ("ByteLevel", "Metaspace", "Split", "Digits", "Punctuation", "UnicodeScripts")
        and p.get("behavior") != "Removed"
    )


def _environment() -> ImmutableSandboxedEnvironment:
    """A sandbox like transformers' for chat templates."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.filters["tojson"] = _tojson
    return env


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    """transformers' tojson filter (tool schemas in templates are rendered with it)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(msg):
    raise jinja2.TemplateError(msg)


def read_json(p: Path) -> dict:
    """A checkpoint's JSON file as a dict ({} when absent); malformed JSON is a one-line ModelError."""
    if not p.exists():
        return {}
    try:
        return json.loads(p.read_text())
    except ValueError as e:
        raise ModelError(f"{p}: malformed JSON ({e})") from None


class IdsTokenizer:
    """What a model of random weights has for a tokenizer: prompts come as token ids, and generated
    ids read back as text, each as a space and its number (so a streamed text counts its tokens)."""

    chat_template = None
    chat_tuned = False
    bos_id = None
    eos_ids = ()

    def decode(self, ids) -> str:
        return "".join(f" {int(i)}" for i in ids)

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        try:
            return [int(t) for t in text.split()]
        except ValueError:
            raise RequestError("a model with random weights has no tokenizer: send token ids") from None

    def encode_chat(self, messages) -> list[int]:
        raise RequestError("a model with random weights has no chat template: use /v1/completions with token ids")


def shape_tokenizer(path: str, vocab_size: int) -> Tokenizer:
    """The tokenizer in directory `path`, for a model of random weights with `vocab_size` ids."""
    tok = Tokenizer.from_hf_dir(Path(path).expanduser())
    if tok is None:
        raise ModelError(f"{path}: no tokenizer.json")
    n = tok.tok.get_vocab_size()
    if n > vocab_size:
        raise ModelError(f"{path}: the tokenizer has {n} ids, more than the model's vocabulary of {vocab_size}")
    return tok
