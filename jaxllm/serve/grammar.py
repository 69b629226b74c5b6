"""Structured output: a request's constraint (`response_format` of type `json_object` or
`json_schema`, or vLLM's `guided_json`, `guided_regex`, `guided_grammar`, `guided_choice`) compiled
by llguidance into a matcher that tells, token by token, which tokens may come next.

Each constrained request holds a `Matcher` of its own. The scheduler feeds it every token the
request gets and, before the request's next step, writes the tokens it allows as the request's row
of a packed bitmask [rows, ceil(V / 32)] uint32, which the device applies to the logits
(`sampling.mask_tokens`). A row allows only text tokens of the tokenizer and the model's EOS
tokens: ids past the tokenizer's vocabulary (a model's logits may be wider) and special tokens are
never allowed, and EOS only where the grammar accepts (llguidance sets its bit exactly then). Once
the grammar can take nothing more, the answer ends (finish reason "stop").

Compiling is done off the engine thread (the request handler's thread pool), once per constraint:
`Grammars` keeps the compiled matchers by their spec and hands each request a copy.
"""
from __future__ import annotations

import collections
import json
import logging
import threading
import time
from dataclasses import dataclass

import llguidance
import numpy as np

from jaxllm.engine.grammar import Matcher, masks
from jaxllm.serve.fields import MAX_DEPTH, bad, too_deep

GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")       # vLLM's names
# JSON as json.dumps writes it: one space after ',' and ':', no other whitespace. The
# whitespace a schema allows otherwise lets a small model pad an answer with newlines until its
# token limit; a schema's "x-guidance" key can change this (llguidance's JSON options). `oneOf`
# is taken as `anyOf` (what schemas of tagged unions mean), which llguidance otherwise refuses.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": True}
ANY_OBJECT = {"type": "object"}
log = logging.getLogger("jaxllm.serve")


@dataclass(frozen=True)
class Constraint:
    """What one request's answer must match, as the request gave it."""
    field: str          # the request field it came from, named by its errors
    kind: str           # "json" | "regex" | "grammar" | "choice"
    spec: str           # the JSON schema (as JSON text), the regex, the grammar, the choices (a JSON list)


def constraint_field(body: dict) -> Constraint | None:
    """The request's constraint, None without one; at most one field may set one."""
    found = [c for c in [_response_format(body.get("response_format"))] +
             [_guided(name, body[name]) for name in GUIDED if body.get(name) is not None] if c is not None]
    if len(found) > 1:
        raise bad(f"'{found[0].field}' and '{found[1].field}' both constrain the answer; send at most one",
                  found[1].field)
    return found[0] if found else None


def _schema_text(schema, field: str, where: str | None = None) -> str:
    if not isinstance(schema, dict):
        raise bad(f"'{where or field}' must be a JSON Schema object", field)
    return json.dumps(schema, ensure_ascii=False)      # as sent: properties come in their order


def _response_format(v) -> Constraint | None:
    f = "response_format"
    if v is None:
        return None
    kind = v.get("type") if isinstance(v, dict) else None
    if kind not in ("text", "json_object", "json_schema"):
        raise bad(f"'{f}' must be {{'type': 'text' | 'json_object' | 'json_schema', ...}}", f)
    extra = sorted(set(v) - {"type", "json_schema"} if kind == "json_schema" else set(v) - {"type"})
    if extra:
        raise bad(f"'{f}' of type {kind!r} has unknown field '{extra[0]}'", f)
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint(f, "json", _schema_text(ANY_OBJECT, f))
    js = v.get("json_schema")
    if not isinstance(js, dict):
        raise bad(f"'{f}.json_schema' must be an object with 'name' and 'schema'", f)
    extra = sorted(set(js) - {"name", "schema", "strict", "description"})
    if extra:
        raise bad(f"'{f}.json_schema' has unknown field '{extra[0]}'", f)
    for key, types in (("name", str), ("description", str), ("strict", bool)):
        if js.get(key) is not None and not isinstance(js[key], types):
            raise bad(f"'{f}.json_schema.{key}' must be a {types.__name__}", f)
    if "schema" not in js:
        raise bad(f"'{f}.json_schema.schema' is required", f)
    return Constraint(f, "json", _schema_text(js["schema"], f, f"{f}.json_schema.schema"))


def _guided(name: str, v) -> Constraint:
    if name == "guided_json":
        if isinstance(v, str):
            try:
                v = json.loads(v)
            except ValueError as e:
                raise bad(f"'{name}' is not valid JSON ({e})", name) from None
            except RecursionError:
                raise bad(f"'{name}' is nested too deeply", name) from None
            if too_deep(v):
                raise bad(f"'{name}' is nested too deeply (more than {MAX_DEPTH} levels)", name)
        return Constraint(name, "json", _schema_text(v, name))
    if name == "guided_choice":
        if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
            raise bad(f"'{name}' must be a non-empty list of non-empty strings", name)
        return Constraint(name, "choice", json.dumps(v, ensure_ascii=False))
    if not isinstance(v, str) or not v:
        raise bad(f"'{name}' must be a non-empty string", name)
    return Constraint(name, "regex" if name == "guided_regex" else "grammar", v)


def _grammar(c: Constraint) -> str:
    """The constraint as llguidance's grammar (ValueError where it cannot be read at all)."""
    if c.kind == "json":
        return llguidance.LLMatcher.grammar_from_json_schema(c.spec, defaults=JSON_OPTIONS)
    if c.kind == "choice":
        return llguidance.grammar_from("choice", json.loads(c.spec))
    return llguidance.grammar_from("regex" if c.kind == "regex" else "grammar", c.spec)   # Lark, or GBNF


def one_line(message: str, limit: int = 300) -> str:
    """llguidance's error message (several lines, with a caret under the place) as one line: its
    first line and the line that says what is wrong."""
    lines = [s.strip() for s in message.strip().splitlines() if s.strip()]
    if not lines:
        return "rejected by the grammar engine"
    why = next((s for s in lines[1:] if s.lower().startswith("error")), "")
    out = lines[0] + (f" {why}" if why and why not in lines[0] else "")
    return out if len(out) <= limit else out[:limit - 3] + "..."


class Grammars:
    """llguidance's view of the model's tokenizer, and the constraints compiled so far."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids, cache_size: int = 128):
        self.hf = tokenizer.tok                 # a `tokenizers.Tokenizer`
        self.vocab_size, self.eos_ids = vocab_size, [int(i) for i in eos_ids]
        self.words = -(-vocab_size // 32)
        self.cache_size = cache_size
        self.compiled: collections.OrderedDict[tuple, llguidance.LLMatcher] = collections.OrderedDict()
        self.lock = threading.Lock()
        self._ll = None
        self.base: np.ndarray | None = None     # [words]: the tokens any grammar may allow
        self.unavailable: str | None = None     # why llguidance could not read the tokenizer

    @staticmethod
    def for_engine(engine) -> Grammars | None:
        """None where the model has no tokenizer (random weights served as token ids)."""
        if getattr(engine.tokenizer, "tok", None) is None:
            return None
        return Grammars(engine.tokenizer, engine.cfg.vocab_size, engine.cfg.eos_ids)

    def prepare(self) -> float:
        """Build llguidance's tokenizer (its token trie) if not built yet. -> seconds taken. It takes
        seconds for a vocabulary of 262144 tokens and holds the GIL meanwhile, so the server does
        it before it serves."""
        t0 = time.perf_counter()
        with self.lock:
            if self._ll is None and self.unavailable is None:
                try:
                    self._ll, self.base = self._tokenizer()
                except Exception as e:          # noqa: BLE001 (llguidance raises plain exceptions)
                    self.unavailable = one_line(str(e))
                    log.warning("structured output is off: llguidance cannot read the tokenizer (%s)",
                                self.unavailable)
        return time.perf_counter() - t0

    def _tokenizer(self):
        """(llguidance's tokenizer, the mask of the tokens a grammar may allow: the tokenizer's
        text tokens and the model's EOS tokens, below the model's vocabulary size)."""
        n = self.hf.get_vocab_size(with_added_tokens=True)
        V = min(n, self.vocab_size)
        eos = [i for i in self.eos_ids if i < V]
        ll = llguidance.LLTokenizer(self.hf.to_str(), n_vocab=n, eos_token=eos or None)
        text = np.zeros(self.words * 32, bool)
        text[:V] = [not ll.is_special_token(i) for i in range(V)]
        text[eos] = True
        return ll, np.packbits(text, bitorder="little").view(np.uint32)

    def matcher(self, c: Constraint) -> Matcher:
        """A fresh matcher of `c` for one request (compiled now if `c` is new); an invalid
        constraint is a 400 naming its field, with llguidance's reason."""
        self.prepare()
        if self.unavailable is not None:
            raise bad(f"'{c.field}': structured output is not available for this model's tokenizer "
                      f"({self.unavailable})", c.field)
        key = (c.kind, c.spec)
        with self.lock:
            template = self.compiled.get(key)
            if template is not None:
                self.compiled.move_to_end(key)
        if template is None:
            try:
                grammar = _grammar(c)
            except ValueError as e:
                raise bad(f"'{c.field}' is not a valid {_what(c)}: {one_line(str(e))}", c.field) from None
            template = llguidance.LLMatcher(self._ll, grammar, log_level=0)      # compiles without the GIL
            if template.is_error():
                raise bad(f"'{c.field}' is not a valid {_what(c)}: {one_line(template.get_error())}", c.field)
            with self.lock:
                self.compiled[key] = template
                while len(self.compiled) > self.cache_size:
                    self.compiled.popitem(last=False)
        m = Matcher(template.deep_copy(), self.base, -(-self.hf.get_vocab_size(with_added_tokens=True) // 32))
        if not masks([m], m.words).any():       # only special tokens could begin it (answers hold none)
            why = one_line(m.m.get_error()) if m.m.is_error() else "its first token would have to be a special token"
            raise bad(f"'{c.field}' allows no answer this model can write: {why}", c.field)
        return m


def _what(c: Constraint) -> str:
    return {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar",
            "choice": "list of choices"}[c.kind]
