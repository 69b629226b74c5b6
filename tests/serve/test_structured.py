"""Structured output: the grammar mask on the device (`sampling.mask_tokens`, the core's masked
prefill and decode, with and without speculation); the grammars of JSON schemas (the server's
bounds where a schema leaves the answer open, compact whitespace unless the schema asks for
flexible whitespace); and the server's `response_format` and `guided_*` fields through the official
openai client against a live server on the embedded Gemma 3 270M: 20 JSON schemas validated by
`jsonschema`, sampled at two temperatures, all at once beside a free request; a regex, a choice, a
grammar, JSON object mode; bad constraints answered with a 400.

Many schemas leave strings, integers, numbers, arrays and extra properties open, as users write
them; the server's bounds (`JsonBounds`) keep a weak model from running such an answer to its token
limit, so each must end with "stop" within `MAX_TOKENS`.
"""
from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jax
import jsonschema
import numpy as np
import pytest
from test_server import API_KEY, ServerProcess

import jaxllm

MAX_TOKENS = 300


def obj(required=None, closed=False, **props) -> dict:
    """An object schema of `props`, all required unless told otherwise; other properties allowed
    (JSON Schema's default) unless `closed`."""
    s = {"type": "object", "properties": props, "required": list(props) if required is None else required}
    return s | {"additionalProperties": False} if closed else s


STRING, INTEGER, NUMBER, BOOLEAN = {"type": "string"}, {"type": "integer"}, {"type": "number"}, {"type": "boolean"}
WORD = {"type": "string", "pattern": "^[a-z]{1,10}$"}
DIGIT = {"type": "integer", "minimum": 0, "maximum": 9}
SCHEMAS = [  # (what the prompt asks for, schema); arrays first: this model runs them to their bound
    ("a shopping cart", obj(items={"type": "array", "items": obj(
        sku={"type": "string", "pattern": "^[A-Z]{2}[0-9]$"}, qty=DIGIT)})),
    ("a post's tags", obj(tags={"type": "array", "items": {"type": "string", "maxLength": 20}})),
    ("a list of prices", obj(prices={"type": "array", "items": {"type": "number", "minimum": 0, "maximum": 10000}})),
    ("a week's temperatures", obj(temperatures={"type": "array", "items": INTEGER})),
    ("a small matrix", obj(rows={"type": "array", "maxItems": 3, "items": {"type": "array", "items": DIGIT}})),
    ("a city and its population", obj(city={"type": "string", "maxLength": 40}, population=INTEGER)),
    ("a setting", obj(enabled=BOOLEAN, ratio=NUMBER, owner=obj(name=STRING))),
    ("a person", obj(name={"type": "string", "pattern": "^[A-Z][a-z]{1,11}$"}, age={"type": "integer", "minimum": 0})),
    ("a color", obj(color={"enum": ["red", "green", "blue"]}, closed=True)),
    ("a pet", {"anyOf": [obj(cat=STRING), obj(dog=INTEGER)]}),
    ("a user and a status", obj(user=obj(id={"type": "integer", "minimum": 1}, name=WORD), ok=BOOLEAN)),
    ("a value or none", obj(value={"anyOf": [INTEGER, {"type": "string", "enum": ["none"]}]}, closed=True)),
    ("a birthday", obj(name=STRING, date={"type": "string", "format": "date"})),
    ("a flight and its price", obj(flight={"type": "string", "pattern": "^[A-Z]{2}[0-9]{2,4}$"}, price=NUMBER)),
    ("a server address", obj(ip={"type": "string", "format": "ipv4"},
                             port={"type": "integer", "minimum": 1, "maximum": 65535}, closed=True)),
    ("a test score", obj(score={"type": "number", "minimum": 0, "maximum": 10, "multipleOf": 0.5}, passed=BOOLEAN,
                         closed=True)),
    ("a line segment", {"$defs": {"pt": obj(x=INTEGER, y=INTEGER)},
                        **obj(start={"$ref": "#/$defs/pt"}, end={"$ref": "#/$defs/pt"})}),
    ("a versioned record", obj(version={"const": 2}, kind={"const": "item"}, label=STRING)),
    ("a middle initial, if any", obj(first=STRING, middle={"anyOf": [{"type": "string", "pattern": "^[A-Z]$"},
                                                                     {"type": "null"}]})),
    ("settings, some optional", obj(required=["code"], code={"type": "string", "minLength": 3, "maxLength": 5},
                                    note=STRING, dark=BOOLEAN, lang={"enum": ["en", "fr"]})),
]
SCHEMA = dict(SCHEMAS)
FREE = [{"role": "user", "content": "Name three rivers."}]


# -- the mask on the device -------------------------------------------------------------------------
def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [N, V] -> the packed mask [N, ceil(V / 32)] uint32 (bit j of word w: token 32 w + j)."""
    N, V = allowed.shape
    bits = np.zeros((N, -(-V // 32) * 32), bool)
    bits[:, :V] = allowed
    return np.packbits(bits, axis=1, bitorder="little").view(np.uint32)


def test_mask_tokens_keeps_exactly_the_allowed_tokens():
    import jax.numpy as jnp

    from jaxllm.engine.sampling import SamplingParams, mask_tokens, sample
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(3, 70)).astype(np.float32)
    allowed = rng.random((3, 70)) < 0.2
    allowed[2] = True                                   # a free row: its logits come back exactly
    got = np.asarray(mask_tokens(jnp.asarray(logits), jnp.asarray(pack(allowed))))
    np.testing.assert_array_equal(got, np.where(allowed, logits, -np.inf))
    greedy = np.asarray(sample(jnp.asarray(got), SamplingParams.make(3), 0))
    assert greedy.tolist() == np.argmax(np.where(allowed, logits, -np.inf), -1).tolist()
    drawn = np.asarray(sample(jnp.asarray(got), SamplingParams.make(3, temperature=1.0, seed=3), 0))
    assert all(allowed[b, t] for b, t in enumerate(drawn))


def test_masked_rows_sample_only_allowed_tokens_beside_speculation(tmp_path):
    """On a tiny random Qwen3 with n-gram speculation: row 0 is constrained to a few tokens from
    its first token on (the prefill samples it) and drafts nothing, one token a block; row 1 runs
    free beside it in the same blocks, takes drafts, and gets the greedy tokens of plain decoding."""
    import tiny

    from jaxllm.engine.engine import Engine
    from jaxllm.engine.sampling import SamplingParams
    from jaxllm.engine.slots import Pieces
    from jaxllm.engine.speculative import Speculation
    tiny.make("qwen3", tmp_path)
    base = jaxllm.load(str(tmp_path), quant="none", dtype="float32", max_ctx=256)
    eng = Engine(base.cfg, base.weights, base.tokenizer, dtype="float32", max_ctx=256,
                 speculation=Speculation("ngram", 3))
    prompt = [5, 6, 7, 8] * 6                            # repetitive: the n-gram lookup finds drafts
    free = base.generate_ids([prompt], max_tokens=12)[0].token_ids
    ok = np.zeros((2, eng.cfg.vocab_size), bool)
    ok[0, [11, 23, 42]] = True
    ok[1] = True
    allowed = pack(ok)
    core = eng.core(2, 64)
    first = core.prefill(Pieces.make(np.asarray([prompt, prompt], np.int32), 0, len(prompt), True, [0, 1],
                                     SamplingParams.make(2), 64, False, allowed=allowed))
    rows = [[int(t)] for t in eng.layout.get(first)]
    most = 0
    while len(rows[1]) < len(free):
        toks, count, _ = core.decode(1, core.out_size(1), allowed=allowed)
        toks, count = eng.layout.get(toks), eng.layout.get(count)
        assert count[0] == 1
        most = max(most, count[1])
        for b in range(2):
            rows[b] += toks[b, :count[b]].tolist()
    assert set(rows[0]) <= {11, 23, 42}
    assert rows[1][:len(free)] == free
    assert most > 1                                      # the free row took drafts


@pytest.mark.parametrize("temperature", [0.8, 0.0])
def test_step_split_in_forward_and_sampling_equals_one_call(tmp_path, temperature):
    """A constrained step as the server runs it, its forward launched apart from (and even twice
    before) its sampling, gives the tokens, counts and log-probabilities of the one-call step, for
    the first rows of a larger slot table; the slots past them stay as they were. Greedy rows take
    the sampling's greedy variant."""
    import tiny

    from jaxllm.engine.sampling import SamplingParams
    from jaxllm.engine.slots import Pieces
    tiny.make("qwen3", tmp_path)
    eng = jaxllm.load(str(tmp_path), quant="none", dtype="float32", max_ctx=128)
    ok = np.ones((2, eng.cfg.vocab_size), bool)
    ok[0] = False
    ok[0, [11, 23, 42, 57]] = True
    allowed = pack(ok)
    prompts = np.asarray([[5, 6, 7, 8, 9], [9, 3, 4, 1, 2]], np.int32)
    cores = []
    for _ in range(2):
        core = eng.core(4, 64)
        core.prefill(Pieces.make(prompts, 0, 5, True, [0, 1], SamplingParams.make(2, temperature, seed=3), 64, False,
                                 allowed=allowed))
        cores.append(core)
    one, split = cores
    for step in range(6):
        want = jax.tree_util.tree_map(eng.layout.get, one.decode(1, one.out_size(1), rows=2, logprobs=5,
                                                                 allowed=allowed))
        logits = split.decode_forward(rows=2)
        if step == 2:                      # a forward launched ahead and then dropped, launched again
            logits = split.decode_forward(rows=2)
        got = jax.tree_util.tree_map(eng.layout.get, split.decode_sample(logits, rows=2, logprobs=5, allowed=allowed,
                                                                         greedy=temperature == 0))
        assert got[0][:, 0].tolist() == want[0][:, 0].tolist() and got[1].tolist() == want[1].tolist() == [1, 1]
        assert got[0][0, 0] in (11, 23, 42, 57)
        np.testing.assert_allclose(got[2].token[:, 0], want[2].token[:, 0], atol=1e-5)
        assert got[2].top_ids[:, 0].tolist() == want[2].top_ids[:, 0].tolist()
    a, b = (jax.tree_util.tree_map(eng.layout.get, c.state.slots) for c in cores)
    assert a.pos.tolist() == b.pos.tolist() and a.last.tolist() == b.last.tolist()
    assert b.active.tolist() == [True, True, False, False]


def test_grammar_masks_allow_text_and_eos_only_where_the_grammar_ends():
    """On a byte-level tokenizer of 265 ids for a model of 288: a matcher's row allows the tokens its
    grammar takes next, EOS only where the grammar may end, never a special token or an id past the
    tokenizer; the answer is complete when the grammar can take nothing more. Compiled once per spec;
    an invalid one is a 400 naming its field."""
    from types import SimpleNamespace

    import tiny_chat

    from jaxllm.engine.grammar import masks
    from jaxllm.serve.fields import ApiError
    from jaxllm.serve.grammar import Constraint, Grammars
    tok = tiny_chat.byte_tokenizer(tiny_chat.QWEN3_SPECIAL, tiny_chat.QWEN3_TAGS)
    eos = tok.token_to_id("<|im_end|>")
    g = Grammars(SimpleNamespace(tok=tok), 288, [eos])
    c = Constraint("guided_regex", "regex", "ab{1,2}")
    m = g.matcher(c)
    a, b = (tok.encode(x).ids[0] for x in "ab")

    def allowed(row) -> set[int]:
        return set(np.nonzero(np.unpackbits(row.view(np.uint8), bitorder="little"))[0].tolist())
    rows = masks([m, None], g.words)
    assert rows.shape == (2, 9) and allowed(rows[0]) == {a} and allowed(rows[1]) == set(range(288))
    assert m.follow([a]) == (1, False) and allowed(masks([m], g.words)[0]) == {b}
    assert m.follow([b]) == (1, False) and allowed(masks([m], g.words)[0]) == {b, eos}
    assert m.follow([b, a]) == (1, True)                 # complete at the second b: the a is not taken
    with pytest.raises(ValueError, match="refused"):
        g.matcher(c).follow([b])
    assert len(g.compiled) == 1
    with pytest.raises(ApiError) as e:
        g.matcher(Constraint("guided_regex", "regex", "a("))
    assert e.value.status == 400 and e.value.param == "guided_regex" and "\n" not in e.value.message


def test_json_schema_grammars_bound_what_the_schema_leaves_open():
    """On a byte-level tokenizer: a JSON schema's grammar takes compact JSON only (json.dumps's
    separators, no other whitespace) unless its "x-guidance" asks for flexible whitespace; where
    the schema leaves them open, integers take 15 digits, numbers 8 decimals, strings 256
    characters, arrays 16 items, an object that lists its properties no others, and a free value
    nests 4 deep, while the schema's own bounds hold as stated; a bound llguidance refuses leaves
    the schema as sent."""
    from types import SimpleNamespace

    import tiny_chat

    from jaxllm.serve.grammar import Constraint, Grammars, JsonBounds
    tok = tiny_chat.byte_tokenizer(tiny_chat.QWEN3_SPECIAL, tiny_chat.QWEN3_TAGS)
    grammars = Grammars(SimpleNamespace(tok=tok), 288, [tok.token_to_id("<|im_end|>")])

    def takes(schema: dict, text: str, g=grammars) -> bool:
        m = g.matcher(Constraint("guided_json", "json", json.dumps(schema)))
        try:
            m.follow(tok.encode(text).ids)
        except ValueError:
            return False
        return m.m.is_accepting()
    point = obj(x=INTEGER, y={"type": "array", "items": INTEGER})
    flexible = {**point, "x-guidance": {"whitespace_flexible": True}}
    assert takes(point, '{"x": 1, "y": [2, 3]}') and takes(flexible, '{"x": 1, "y": [2, 3]}')
    for spaced in ['{"x":1,"y":[2,3]}', '{ "x": 1, "y": [2, 3] }', '{"x": 1,\n  "y": [2, 3]}', '{"x":  1, "y": []}']:
        assert not takes(point, spaced) and takes(flexible, spaced), spaced

    def one(schema, value) -> bool:
        return takes(obj(v=schema), json.dumps({"v": value}))
    assert one(INTEGER, -10 ** 15 + 1) and not one(INTEGER, 10 ** 15)
    assert one({"type": "integer", "minimum": 10 ** 15}, 2 * 10 ** 15 - 1) and not one(INTEGER, 2 * 10 ** 15)
    assert one({"type": "integer", "maximum": 10 ** 17}, 10 ** 16)
    assert one(NUMBER, 0.12345678) and not one(NUMBER, 0.123456789)
    assert one({"type": "number", "multipleOf": 1e-9}, 0.123456789) and not takes(obj(v=NUMBER), '{"v": 1e5}')
    assert one(STRING, "a" * 256) and not one(STRING, "a" * 257)
    assert one({"type": "string", "maxLength": 300}, "a" * 300)
    assert one({"type": "string", "minLength": 400}, "a" * 400)
    assert one({"type": "array", "items": INTEGER}, [1] * 16) and not one({"type": "array", "items": INTEGER}, [1] * 17)
    assert one({"type": "array", "maxItems": 20}, [1] * 20)
    assert not takes(point, '{"x": 1, "y": [], "z": 2}') and takes(point | {"additionalProperties": True},
                                                                   '{"x": 1, "y": [], "z": 2}')
    assert takes(obj(required=["x", "z"], x=INTEGER), '{"x": 1, "z": 2}')       # a required property not listed
    assert one({}, [[[[1]]]]) and not one({}, [[[[[1]]]]]) and not one({}, [1] * 17)
    assert takes({"type": "object"}, '{"a": 1, "b": {"c": "d"}}')
    assert not takes({"type": "object"}, '{"a": 1' + "0" * 15 + "}")
    assert not one(NUMBER, 0.1234567891) and takes(obj(v=NUMBER), '{"v": 0.1234567891}', Grammars(
        SimpleNamespace(tok=tok), 288, grammars.eos_ids, bounds=JsonBounds(decimals=12)))      # 1e-12: refused


# -- the server ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def server(tmp_path_factory):
    p = ServerProcess(None, tmp_path_factory.mktemp("structured_logs") / "server.log", "--max-num-seqs", "16",
                      "--max-model-len", "512", "--api-key", API_KEY)
    try:
        yield p.wait_ready()
        assert "Traceback" not in p.output(), p.output()[-3000:]
    finally:
        p.terminate()


@pytest.fixture(scope="module")
def client(server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=600)


@pytest.fixture(scope="module")
def model(client):
    return client.models.list().data[0].id


def ask(what: str) -> list[dict]:
    return [{"role": "user", "content": f"Reply with {what} as a JSON object."}]


def test_json_schemas_in_one_batch(client, model):
    """Each schema sampled (seeded) at temperatures 0.7 and 1.0, all 40 requests at once with a free
    request among them: every answer is valid JSON of its schema and ends with "stop" within
    `MAX_TOKENS`, where this model left open runs integers, strings, arrays and extra properties on
    to any limit; the free request gets the answer it gets alone."""
    def schema_request(i, temperature):
        what, schema = SCHEMAS[i]
        return client.chat.completions.create(
            model=model, messages=ask(what), max_tokens=MAX_TOKENS, temperature=temperature, seed=i,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}})

    def free_request():
        return client.chat.completions.create(model=model, messages=FREE, max_tokens=48, temperature=0)
    # first, alone: this also builds the client's response types, which pydantic builds lazily and
    # not safely from 41 threads at once
    alone = free_request()
    with ThreadPoolExecutor(41) as pool:
        free = pool.submit(free_request)
        answers = {(i, t): pool.submit(schema_request, i, t) for i in range(len(SCHEMAS)) for t in (0.7, 1.0)}
        answers = {k: f.result() for k, f in answers.items()}
        free = free.result()
    for (i, t), r in answers.items():
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop", (SCHEMAS[i][0], t, text)
        jsonschema.validate(json.loads(text), SCHEMAS[i][1])
    assert free.choices[0].message.content == alone.choices[0].message.content
    assert free.usage.completion_tokens == alone.usage.completion_tokens


def test_regex_choice_grammar_and_json_object(client, model):
    """The other constraints, all requests at once: `guided_regex` (greedy and sampled, on
    completions and chat), `guided_choice`, `guided_grammar` in Lark and in GBNF, `guided_json` as a
    string, JSON object mode, and a streamed schema."""
    phone = r"\(\d{3}\) \d{3}-\d{4}"
    date = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9])"
    choices = ["positive", "negative", "neutral"]
    lark = 'start: "The answer is " NUMBER "."\nNUMBER: /[0-9]{1,3}/'
    weather = obj(city=WORD, days={"type": "integer", "minimum": 1, "maximum": 7})
    color = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA["a color"]}}

    def complete(prompt, guided, temperature=0.0, max_tokens=32):
        r = client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=temperature,
                                      seed=5, extra_body=guided)
        return r.choices[0].text, r.choices[0].finish_reason

    def chat(content, max_tokens=32, **kw):
        r = client.chat.completions.create(model=model, messages=[{"role": "user", "content": content}],
                                           max_tokens=max_tokens, temperature=0, **kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    def streamed():
        chunks = client.chat.completions.create(model=model, messages=ask("a color"), max_tokens=32, temperature=0,
                                                stream=True, response_format=color)
        return "".join(c.choices[0].delta.content or "" for c in chunks), "stop"
    calls = {
        "phone": lambda: complete("Call me at", {"guided_regex": phone}),
        "phone sampled": lambda: complete("Call me at", {"guided_regex": phone}, temperature=1.0),
        "date": lambda: chat("When is the meeting?", extra_body={"guided_regex": date}),
        "choice": lambda: chat("I love it! Sentiment?", extra_body={"guided_choice": choices}),
        "lark": lambda: complete("What is 12 + 30?", {"guided_grammar": lark}),
        "gbnf": lambda: complete("Is water wet?", {"guided_grammar": 'root ::= ("yes" | "no") "!"'}),
        "json object": lambda: chat("Give me JSON.", max_tokens=64, response_format={"type": "json_object"}),
        "guided_json": lambda: complete("Weather query as JSON:", {"guided_json": json.dumps(weather)}, max_tokens=48),
        "stream": streamed,
    }
    with ThreadPoolExecutor(len(calls)) as pool:
        got = {k: f.result() for k, f in {k: pool.submit(f) for k, f in calls.items()}.items()}
    assert all(reason == "stop" for _, reason in got.values()), got
    assert re.fullmatch(phone, got["phone"][0]) and re.fullmatch(phone, got["phone sampled"][0])
    assert re.fullmatch(date, got["date"][0])
    assert got["choice"][0] in choices
    assert re.fullmatch(r"The answer is [0-9]{1,3}\.", got["lark"][0])
    assert got["gbnf"][0] in ("yes!", "no!")
    assert isinstance(json.loads(got["json object"][0]), dict)
    jsonschema.validate(json.loads(got["guided_json"][0]), weather)
    jsonschema.validate(json.loads(got["stream"][0]), SCHEMA["a color"])



def test_n_constrained_answers_are_the_requests_with_their_seeds(client, model):
    """`n` answers of a constrained request (the prompt prefilled once, its slot forked, each copy
    following its own grammar from its first token on): each is valid JSON of the schema and is
    what the request alone samples with seed + i."""
    what, schema = "a test score", SCHEMA["a test score"]
    kw = dict(model=model, messages=ask(what), max_tokens=MAX_TOKENS, temperature=1.0, seed=11,
              response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    with ThreadPoolExecutor(3) as pool:
        together = pool.submit(client.chat.completions.create, n=2, **kw)
        alone = [pool.submit(client.chat.completions.create, **{**kw, "seed": 11 + i}) for i in range(2)]
        r, alone = together.result(), [a.result().choices[0] for a in alone]
    assert [c.index for c in r.choices] == [0, 1]
    for c, a in zip(r.choices, alone):
        assert c.finish_reason == a.finish_reason == "stop"
        assert c.message.content == a.message.content
        jsonschema.validate(json.loads(c.message.content), schema)

BAD = [  # (route, body, param the 400 names, words of its message)
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "response_format", "not a valid JSON schema"),
    ("chat", {"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format",
     "schema' is required"),
    ("chat", {"response_format": {"type": "yaml"}}, "response_format", "must be"),
    ("completion", {"guided_regex": "(a"}, "guided_regex", "unclosed group"),
    ("completion", {"guided_grammar": 'start: "a" /[0-9]+'}, "guided_grammar", "not a valid grammar"),
    ("completion", {"guided_json": {"type": "integer", "minimum": 5, "maximum": 2}}, "guided_json", "Unsatisfiable"),
    ("completion", {"guided_json": {"type": "string", "format": "color"}}, "guided_json", "Unknown format"),
    ("completion", {"guided_choice": []}, "guided_choice", "non-empty list"),
    ("completion", {"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice", "at most one"),
    ("chat", {"guided_regex": "a+", "response_format": {"type": "json_object"}}, "guided_regex", "at most one"),
]


def test_bad_constraints_get_400_naming_the_field(server):
    """An invalid schema, regex or grammar, or two constraints, is a 400 naming the field with the
    grammar engine's reason on one line; the server goes on serving constrained requests."""
    h = {"Authorization": f"Bearer {API_KEY}"}
    for route, body, param, words in BAD:
        if route == "chat":
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], **body}
        else:
            path, body = "/v1/completions", {"prompt": "x", **body}
        r = httpx.post(server.url + path, json={"max_tokens": 4, **body}, headers=h, timeout=60)
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and words in err["message"] and "\n" not in err["message"], err
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "temperature": 0,
                                                          "guided_regex": "[a-z ]+"}, headers=h, timeout=60)
    assert ok.status_code == 200 and re.fullmatch("[a-z ]+", ok.json()["choices"][0]["text"])


def test_constrained_requests_compile_nothing_after_ready(server):
    """Every call the constrained requests of this module needed (prefills with grammar masks among
    them, and one of its own) was compiled before the server said ready: the scheduler counted no
    compiling."""
    from prometheus_client.parser import text_string_to_metric_families
    h = {"Authorization": f"Bearer {API_KEY}"}
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, timeout=120,       # one of its own
                   json={"messages": ask("a color"), "max_tokens": 16, "response_format": {"type": "json_object"}})
    assert r.status_code == 200, r.text
    text = httpx.get(server.url + "/metrics", headers=h, timeout=60).text
    parts = {(s.labels["thread"], s.labels["part"]): s.value for f in text_string_to_metric_families(text)
             if f.name == "jaxllm:scheduler_thread_seconds" for s in f.samples if s.name.endswith("_total")}
    assert parts[("engine", "prefill")] > 0 and parts[("engine", "sample")] > 0, parts
    assert ("engine", "compile") not in parts, parts
