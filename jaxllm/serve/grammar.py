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

A JSON schema is compiled with bounds where it leaves the answer open (`JsonBounds`), so that a
weak model cannot run an answer on to its token limit (a number's digits, a string, an array, extra
properties, whitespace); the answer still matches the schema as sent.

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

GUIDED = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")  # vLLM's names
# JSON as json.dumps writes it: one space after ',' and ':', no other whitespace (a small model
# given whitespace pads an answer with newlines up to its token limit). `oneOf` is taken as `anyOf`
# (what schemas of tagged unions mean), which llguidance otherwise refuses. A schema's "x-guidance"
# key (llguidance's JSON options) that asks for flexible whitespace (`whitespace_flexible`, or a
# `whitespace_pattern`) gets llguidance's separators, "," and ":" with that whitespace around them.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "coerce_one_of": True}
FLEXIBLE_OPTIONS = {"coerce_one_of": True}
ANY_OBJECT = {"type": "object"}
log = logging.getLogger("jaxllm.serve")


@dataclass(frozen=True)
class Constraint:
    """What one request's answer must match, as the request gave it."""

    field: str  # the request field it came from, named by its errors
    kind: str  # "json" | "regex" | "grammar" | "choice"
    spec: str  # the JSON schema (as JSON text), the regex, the grammar, the choices (a JSON list)


def constraint_field(body: dict) -> Constraint | None:
    """The request's constraint, None without one; at most one field may set one."""
    found = [
        c
        for c in [_response_format(body.get("response_format"))]
        + [_guided(name, body[name]) for name in GUIDED if body.get(name) is not None]
        if c is not None
    ]
    if len(found) > 1:
        raise bad(
            f"'{found[0].field}' and '{found[1].field}' both constrain the answer; send at most one", found[1].field
        )
    return found[0] if found else None


def _schema_text(schema, field: str, where: str | None = None) -> str:
    if not isinstance(schema, dict):
        raise bad(f"'{where or field}' must be a JSON Schema object", field)
    return json.dumps(schema, ensure_ascii=False)  # as sent: properties come in their order


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


@dataclass(frozen=True)
class JsonBounds:
    """The server's bounds on what a JSON schema leaves open. Each applies only where the schema
    states no bound of that kind, so a schema allows more by saying so (its own `maxLength`,
    `maxItems`, `minimum`/`maximum`, `multipleOf`, `additionalProperties`, `maxProperties`)."""

    digits: int = 15  # an integer or number: within 10^15 - 1 of its one stated end (of 0 with none)
    decimals: int = 8  # a number's decimals, as `multipleOf` 10^-decimals (llguidance's most: 10)
    string: int = 256  # a string's `maxLength`, unless a pattern, format, enum or const fixes it
    items: int = 16  # an array's `maxItems`
    properties: int = 16  # `maxProperties` of a map: an object that lists no properties
    depth: int = 4  # arrays and objects nested in a value the schema leaves free
    # Beyond these, closed objects: an object that lists its properties takes no others (xgrammar's
    # default; OpenAI's strict mode requires it), and a value the schema leaves free (`{}`, `true`, an
    # array without `items`, a map's values) is any JSON value within the same bounds.


ANNOTATIONS = {
    "title",
    "description",
    "default",
    "examples",
    "$comment",
    "$schema",
    "$id",
    "$anchor",
    "$defs",
    "definitions",
    "deprecated",
    "readOnly",
    "writeOnly",
    "x-guidance",
}
SCALARS = ["null", "boolean", "number", "string"]
SAFE_NUMBER = 2**53  # bounds past this are not exact in llguidance's f64, so left as stated


def bounded(schema: dict, b: JsonBounds) -> dict:
    """`schema` with `b`'s bounds where it leaves the answer open; every answer of the result is an
    answer of `schema`. A schema that intersects subschemas (`allOf`, or `anyOf`/`oneOf`/`$ref`
    beside other keywords) comes back as it is: a bound in one part could contradict another part."""
    if _intersects(schema):
        return schema
    used = []

    def free(x) -> bool:  # a subschema that allows any value
        return x is True or (isinstance(x, dict) and set(x) <= ANNOTATIONS - {"$defs", "definitions"})

    def sub(x):
        if free(x):
            used.append(True)
            return _any_ref(b.depth)
        return walk(x) if isinstance(x, dict) else x

    def walk(s: dict) -> dict:
        s = dict(s)
        for key in ("properties", "patternProperties", "$defs", "definitions"):
            if isinstance(s.get(key), dict):
                s[key] = {k: sub(v) for k, v in s[key].items()}
        for key in ("items", "prefixItems", "anyOf", "oneOf", "allOf"):
            if isinstance(s.get(key), list):
                s[key] = [sub(v) for v in s[key]]
        for key in ("items", "additionalProperties"):  # not inside `not` or `if`: a bound there widens
            if isinstance(s.get(key), (dict, bool)) and s[key] is not False:
                s[key] = sub(s[key])
        types = s.get("type") if isinstance(s.get("type"), list) else [s.get("type")]
        if "integer" in types or "number" in types:
            s |= _number_bounds(s, b, "number" in types)
        if "string" in types and not {"maxLength", "pattern", "format", "enum", "const"} & set(s):
            s["maxLength"] = max(b.string, _int(s.get("minLength")) or 0)
        if "array" in types:
            if "maxItems" not in s:
                s["maxItems"] = max(b.items, _int(s.get("minItems")) or 0)
            if "items" not in s and not isinstance(s.get("prefixItems"), list) and "unevaluatedItems" not in s:
                s["items"] = sub(True)
        if "object" in types or "properties" in s:
            s |= _object_bounds(s, b, sub)
        return s

    out = sub(schema)
    if used:
        defs = out.get("$defs") if isinstance(out.get("$defs"), dict) else {}
        out = {**out, "$defs": {**defs, **{_any_name(d): walk(_any_value(d)) for d in range(b.depth + 1)}}}
        if "x-guidance" in schema:
            out["x-guidance"] = schema["x-guidance"]
    return out


def _any_name(depth: int) -> str:
    return f"jaxllm_any_{depth}"


def _any_ref(depth: int) -> dict:
    return {"$ref": f"#/$defs/{_any_name(depth)}"}


def _any_value(depth: int) -> dict:
    """Any JSON value with arrays and objects nested `depth` deep at most."""
    if depth == 0:
        return {"type": SCALARS}
    return {
        "type": [*SCALARS, "array", "object"],
        "items": _any_ref(depth - 1),
        "additionalProperties": _any_ref(depth - 1),
    }


def _number_bounds(s: dict, b: JsonBounds, fractional: bool) -> dict:
    """The keywords that bound a number's digits where `s` leaves them open: each missing end of its
    range 10^digits - 1 past the other end (past 0 without one), or past `multipleOf` if that is
    larger, so the range still holds a multiple; a number's decimals as `multipleOf` 10^-decimals,
    where the range is wider than that step."""
    lo = max((v for v in (_num(s.get("minimum")), _num(s.get("exclusiveMinimum"))) if v is not None), default=None)
    hi = min((v for v in (_num(s.get("maximum")), _num(s.get("exclusiveMaximum"))) if v is not None), default=None)
    if any(v is not None and abs(v) > SAFE_NUMBER for v in (lo, hi)):
        return {}
    step = _num(s.get("multipleOf"))
    span = max(10**b.digits - 1, int(step or 0) + 1)
    out = {}
    if hi is None:
        out["maximum"] = hi = max(lo, 0) + span if lo is not None else span
    if lo is None:
        out["minimum"] = lo = min(hi, 0) - span
    decimals = 10.0**-b.decimals
    if fractional and step is None and hi - lo > decimals:
        out["multipleOf"] = decimals
    return out if max(abs(lo), abs(hi)) <= SAFE_NUMBER else {}


def _object_bounds(s: dict, b: JsonBounds, sub) -> dict:
    """An object with no `additionalProperties`: closed where it lists properties (unless it requires
    one it does not list, or more than it lists), else its other properties any values; a map (no
    properties listed) at most `b.properties` of them."""
    props = s.get("properties") if isinstance(s.get("properties"), dict) else {}
    out = {}
    if not {"additionalProperties", "patternProperties", "unevaluatedProperties"} & set(s):
        required = s.get("required") if isinstance(s.get("required"), list) else []
        if props and set(required) <= set(props) and (_int(s.get("minProperties")) or 0) <= len(props):
            return {"additionalProperties": False}
        out["additionalProperties"] = sub(True)
    if not props and "maxProperties" not in s and s.get("additionalProperties") is not False:
        out["maxProperties"] = max(b.properties, _int(s.get("minProperties")) or 0)
    return out


def _intersects(schema) -> bool:
    """Whether some subschema of `schema` is an intersection: `allOf` of more than one, or a
    combinator or `$ref` beside keywords other than annotations."""
    if isinstance(schema, list):
        return any(_intersects(x) for x in schema)
    if not isinstance(schema, dict):
        return False
    combined = {"allOf", "anyOf", "oneOf", "$ref"} & set(schema)
    if (
        (isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1)
        or (combined and set(schema) - ANNOTATIONS - combined)
        or len(combined) > 1
    ):
        return True
    return any(
        _intersects(v) for k, v in schema.items() if k not in ("enum", "const", "x-guidance", "default", "examples")
    )


def _num(v) -> float | None:
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _json_options(schema: dict) -> dict:
    xg = schema.get("x-guidance")
    flexible = isinstance(xg, dict) and (xg.get("whitespace_flexible") or xg.get("whitespace_pattern") is not None)
    return FLEXIBLE_OPTIONS if flexible else JSON_OPTIONS


def _grammar(c: Constraint, bounds: JsonBounds | None = None) -> str:
    """The constraint as llguidance's grammar, a JSON schema with `bounds` where given (ValueError
    where it cannot be read at all)."""
    if c.kind == "json":
        schema = json.loads(c.spec)
        text = json.dumps(bounded(schema, bounds), ensure_ascii=False) if bounds is not None else c.spec
        return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=_json_options(schema))
    if c.kind == "choice":
        return llguidance.grammar_from("choice", json.loads(c.spec))
    return llguidance.grammar_from("regex" if c.kind == "regex" else "grammar", c.spec)  # Lark, or GBNF


def one_line(message: str, limit: int = 300) -> str:
    """llguidance's error message (several lines, with a caret under the place) as one line: its
    first line and the line that says what is wrong."""
    lines = [s.strip() for s in message.strip().splitlines() if s.strip()]
    if not lines:
        return "rejected by the grammar engine"
    why = next((s for s in lines[1:] if s.lower().startswith("error")), "")
    out = lines[0] + (f" {why}" if why and why not in lines[0] else "")
    return out if len(out) <= limit else out[: limit - 3] + "..."


class Grammars:
    """llguidance's view of the model's tokenizer, and the constraints compiled so far."""

    def __init__(
        self, tokenizer, vocab_size: int, eos_ids, cache_size: int = 128, bounds: JsonBounds | None = JsonBounds()
    ):
        self.hf = tokenizer.tok  # a `tokenizers.Tokenizer`
        self.bounds = bounds
        self.vocab_size, self.eos_ids = vocab_size, [int(i) for i in eos_ids]
        self.words = -(-vocab_size // 32)
        self.cache_size = cache_size
        self.compiled: collections.OrderedDict[tuple, llguidance.LLMatcher] = collections.OrderedDict()
        self.lock = threading.Lock()
        self._ll = None
        self.base: np.ndarray | None = None  # [words]: the tokens any grammar may allow
        self.unavailable: str | None = None  # why llguidance could not read the tokenizer

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
                except Exception as e:  # noqa: BLE001 (llguidance raises plain exceptions)
                    self.unavailable = one_line(str(e))
                    log.warning("structured output is off: llguidance cannot read the tokenizer (%s)", self.unavailable)
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
            raise bad(
                f"'{c.field}': structured output is not available for this model's tokenizer ({self.unavailable})",
                c.field,
            )
        key = (c.kind, c.spec)
        with self.lock:
            template = self.compiled.get(key)
            if template is not None:
                self.compiled.move_to_end(key)
        if template is None:
            template = self._compile(c)
            with self.lock:
                self.compiled[key] = template
                while len(self.compiled) > self.cache_size:
                    self.compiled.popitem(last=False)
        m = Matcher(template.deep_copy(), self.base, -(-self.hf.get_vocab_size(with_added_tokens=True) // 32))
        if not masks([m], m.words).any():  # only special tokens could begin it (answers hold none)
            why = one_line(m.m.get_error()) if m.m.is_error() else "its first token would have to be a special token"
            raise bad(f"'{c.field}' allows no answer this model can write: {why}", c.field)
        return m

    def _compile(self, c: Constraint) -> llguidance.LLMatcher:
        """`c` compiled (without the GIL), a JSON schema with the server's bounds; where the bounds
        are what llguidance refuses (a range past what it can write), the schema as sent."""
        if c.kind == "json" and self.bounds is not None:
            try:
                template = llguidance.LLMatcher(self._ll, _grammar(c, self.bounds), log_level=0)
                if not template.is_error():
                    return template
            except ValueError:
                pass
        try:
            template = llguidance.LLMatcher(self._ll, _grammar(c), log_level=0)
        except ValueError as e:
            raise bad(f"'{c.field}' is not a valid {_what(c)}: {one_line(str(e))}", c.field) from None
        if template.is_error():
            raise bad(f"'{c.field}' is not a valid {_what(c)}: {one_line(template.get_error())}", c.field)
        if c.kind == "json" and self.bounds is not None:
            log.info("a JSON schema compiled without the server's bounds, which llguidance refused with them")
        return template


def _what(c: Constraint) -> str:
    return {"json": "JSON schema", "regex": "regular expression", "grammar": "grammar", "choice": "list of choices"}[
        c.kind
    ]
