"""lm-evaluation-harness's `local-completions` model against a live server on the embedded Gemma 3
270M (float32, unquantized), on two small tasks written here: its scores must be the engine's own.

- multiple_choice: lm-eval scores each choice by the `echo` + `logprobs` of context + continuation;
  its accuracy (and every loglikelihood, within 1e-4) must equal the same sums taken from
  `Engine.logits` over the same tokens.
- generate_until: its answers must be the engine's greedy generations, and so its exact match.

local-completions asks for one generated token beside the echoed prompt and drops the last entry
as that token; the server lists no EOS it generates, so an item whose next token is an EOS would
lose its continuation's last token. After no item here is an EOS the most likely token (at best
the ninth), so every loglikelihood is exact.
"""
from __future__ import annotations

import json

import numpy as np
import pytest
from test_server import ServerProcess

import jaxllm

pytestmark = pytest.mark.slow          # the real embedded model

NAME = "gemma-3-270m"
RUNTIME = jaxllm.RuntimeConfig()   # the server's and the reference engine's code paths: the same, given to both
API_KEY = "lm-eval-key"
MAX_LEN = 32                   # the items' longest prompt + answer is 31 tokens
MAX_GEN = 8

# (question, choices, index of the answer); lm-eval asks "Question: ...\nAnswer:" + " " + choice
MULTIPLE_CHOICE = [
    ("What is the capital of France?", ["Paris", "London", "Rome", "Berlin"], 0),
    ("What is 2 + 3?", ["4", "5", "6"], 1),
    ("Which animal barks?", ["cat", "dog", "fish"], 1),
    ("What color is the sky on a clear day?", ["green", "blue", "red"], 1),
    ("How many legs does a spider have?", ["six", "eight", "four"], 1),
    ("What is the opposite of hot?", ["cold", "warm", "wet"], 0),
    ("Which planet do we live on?", ["Mars", "Earth", "Venus", "Jupiter"], 1),
    ("What is 10 minus 4?", ["6", "7", "5"], 0),
    ("What do bees make?", ["milk", "honey", "silk"], 1),
    ("Which is the largest ocean?", ["Atlantic", "Indian", "Pacific", "Arctic"], 2),
    ("What is frozen water called?", ["steam", "ice", "sand"], 1),
    ("How many days are in a week?", ["five", "seven", "ten"], 1),
    ("What is the capital of Japan?", ["Tokyo", "Beijing", "Seoul"], 0),
    ("Which month comes after January?", ["March", "February", "December"], 1),
    ("What is 3 times 4?", ["12", "7", "9", "16"], 0),
    ("Which gas do plants take in from the air?", ["oxygen", "carbon dioxide", "helium"], 1),
    ("Which of these is a fruit?", ["carrot", "apple", "potato"], 1),
    ("What is the first letter of the English alphabet?", ["A", "B", "Z"], 0),
    ("Who wrote Romeo and Juliet?", ["Shakespeare", "Dickens", "Tolkien"], 0),
    ("At how many degrees Celsius does water boil?", ["50", "100", "200"], 1),
    ("Which animal is called the king of the jungle?", ["lion", "mouse", "cow"], 0),
    ("How many continents are there?", ["five", "seven", "nine"], 1),
    ("What is the capital of Italy?", ["Madrid", "Rome", "Paris"], 1),
    ("What is 9 plus 1?", ["10", "11", "19"], 0),
    ("What is the chemical symbol for gold?", ["Au", "Ag", "Fe", "Go"], 0),
    ("Which shape has three sides?", ["square", "triangle", "circle"], 1),
    ("What language is spoken in Spain?", ["Spanish", "German", "Japanese"], 0),
    ("What is the square root of 81?", ["9", "8", "7"], 0),
    ("Which season is the coldest?", ["summer", "winter", "spring"], 1),
    ("Which is the fastest land animal?", ["cheetah", "turtle", "snail"], 0),
]

# (prompt, answer): the answer is the line the prompt's pattern asks for
GENERATE = [
    *((f"France: Paris\nJapan: Tokyo\n{c}:", a) for c, a in
      [("Italy", "Rome"), ("Germany", "Berlin"), ("Spain", "Madrid"), ("Egypt", "Cairo"), ("Russia", "Moscow")]),
    *((f"2 + 2 = 4\n3 + 5 = 8\n{q} =", a) for q, a in
      [("4 + 4", "8"), ("6 + 1", "7"), ("9 + 3", "12"), ("7 + 7", "14"), ("10 + 5", "15")]),
    *((f"up -> down\nbig -> small\n{w} ->", a) for w, a in
      [("hot", "cold"), ("day", "night"), ("fast", "slow"), ("open", "closed"), ("happy", "sad")]),
    *((f"cat -> cats\ndog -> dogs\n{w} ->", a) for w, a in [("bird", "birds"), ("box", "boxes"), ("mouse", "mice")]),
    *((f"Monday -> Tuesday\nTuesday -> Wednesday\n{d} ->", a) for d, a in [("Friday", "Saturday"),
                                                                          ("Sunday", "Monday")]),
]

MC_TASK = """\
task: jaxllm_mc
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}, cache_dir: {cache}}}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: choices
doc_to_target: answer
metric_list:
  - metric: acc
"""
GEN_TASK = """\
task: jaxllm_gen
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}, cache_dir: {cache}}}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: {max_gen}
  do_sample: false
filter_list:
  - name: strip
    filter:
      - function: remove_whitespace
      - function: take_first
metric_list:
  - metric: exact_match
"""


def write_tasks(d) -> None:
    d.mkdir()
    rows = {"mc": [{"question": q, "choices": c, "answer": a} for q, c, a in MULTIPLE_CHOICE],
            "gen": [{"prompt": p, "answer": a} for p, a in GENERATE]}
    for name, items in rows.items():
        (d / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in items))
    cache = d / "datasets_cache"
    (d / "jaxllm_mc.yaml").write_text(MC_TASK.format(data=d / "mc.jsonl", cache=cache))
    (d / "jaxllm_gen.yaml").write_text(GEN_TASK.format(data=d / "gen.jsonl", cache=cache, max_gen=MAX_GEN))


def write_hf_tokenizer(tok, d) -> None:
    """The embedded GGUF's tokenizer as a transformers directory, for lm-eval's `huggingface`
    tokenizer backend (which it needs to split each request into context and continuation)."""
    d.mkdir()
    tok.tok.save(str(d / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tok.bos_token,
              "eos_token": tok.tok.id_to_token(tok.eos_ids[0])}
    (d / "tokenizer_config.json").write_text(json.dumps(config))


# -- fixtures -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def started(tmp_path_factory):
    """The server starts while the reference engine loads. Without warm-up it compiles only the
    calls lm-eval's requests meet (most of them prefills that score the prompts), each at its first
    use, and 4 slots keep them few: 2 CPU cores gain nothing from more requests at once."""
    log = tmp_path_factory.mktemp("lm_eval_server") / "server.log"
    proc = ServerProcess(None, log, "--served-model-name", NAME, "--max-num-seqs", "4",
                         "--max-model-len", str(MAX_LEN), "--api-key", API_KEY, "--no-warmup",
                         "--kernels", RUNTIME.kernels, "--layer-scan", RUNTIME.layer_scan)
    yield proc
    proc.terminate()


@pytest.fixture(scope="module")
def engine(started):
    return jaxllm.load(None, max_ctx=MAX_LEN, quant="none", dtype="float32", runtime=RUNTIME)


@pytest.fixture(scope="module")
def server(started, engine):
    yield started.wait_ready()
    assert "Traceback" not in started.output(), started.output()[-3000:]


def model_args(url: str, tokenizer: str) -> str:
    """What docs/server.md tells a user to pass (`max_length`: the server's --max-model-len)."""
    return (f"model={NAME},base_url={url}/v1/completions,tokenizer_backend=huggingface,tokenizer={tokenizer},"
            f"add_bos_token=True,num_concurrent=4,max_length={MAX_LEN}")


@pytest.fixture(scope="module")
def lm_eval_run(server, engine, tmp_path_factory):
    """One lm-eval run of both tasks, with every request's response logged."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    root = tmp_path_factory.mktemp("lm_eval")
    write_tasks(root / "tasks")
    write_hf_tokenizer(engine.tokenizer, root / "tokenizer")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENAI_API_KEY", API_KEY)         # local-completions sends it as the bearer token
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        return lm_eval.simple_evaluate(
            model="local-completions", model_args=model_args(server.url, str(root / "tokenizer")),
            tasks=["jaxllm_mc", "jaxllm_gen"], task_manager=TaskManager(include_path=str(root / "tasks"),
                                                                        include_defaults=False),
            log_samples=True, bootstrap_iters=0)


def samples(run, task: str) -> list[dict]:
    return sorted(run["samples"][task], key=lambda s: s["doc_id"])


# -- references from the engine ---------------------------------------------------------------------
def encode_pair(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request (`TemplateLM._encode_pair`, with `add_bos_token`): the whole
    text encoded, the context's tokens cut off its front."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole, ctx = tok.encode(context + continuation), tok.encode(context)
    return ctx, whole[len(ctx):]


def engine_loglikelihoods(engine, pairs: list[tuple[list[int], list[int]]], batch: int = 8) -> list[float]:
    """Sum of log_softmax(Engine.logits) over each continuation's tokens, given its context. A
    continuation's tokens are scored at the positions before them, so the choices of one token
    share their context's row: one row per distinct context + continuation[:-1]."""
    rows = list(dict.fromkeys(tuple(c + x[:-1]) for c, x in pairs))
    T = max(map(len, rows))
    logp = {}
    for i in range(0, len(rows), batch):
        chunk = rows[i:i + batch]
        padded = chunk + [chunk[0]] * (batch - len(chunk))          # one compiled shape for every batch
        ids = np.array([list(r) + [0] * (T - len(r)) for r in padded], np.int32)
        logits = engine.logits(ids, [len(r) for r in padded])
        for b, r in enumerate(chunk):
            x = logits[b, :len(r)].astype(np.float64)
            x -= x.max(-1, keepdims=True)
            logp[r] = x - np.log(np.exp(x).sum(-1, keepdims=True))
    out = []
    for ctx, cont in pairs:
        row = logp[tuple(ctx + cont[:-1])]
        out.append(float(sum(row[len(ctx) + j - 1, t] for j, t in enumerate(cont))))
    return out


# -- tests ----------------------------------------------------------------------------------------
def test_multiple_choice_accuracy_is_the_engines(lm_eval_run, engine):
    tok = engine.tokenizer
    got = samples(lm_eval_run, "jaxllm_mc")
    assert [s["doc"]["question"] for s in got] == [q for q, _, _ in MULTIPLE_CHOICE]
    pairs = [encode_pair(tok, f"Question: {q}\nAnswer:", " " + c) for q, choices, _ in MULTIPLE_CHOICE for c in choices]
    ref = iter(engine_loglikelihoods(engine, pairs))

    correct = []
    for s, (q, choices, answer) in zip(got, MULTIPLE_CHOICE):
        ours = [next(ref) for _ in choices]
        theirs = [r[0][0] for r in s["resps"]]
        np.testing.assert_allclose(theirs, ours, atol=1e-4, err_msg=q)
        assert s["acc"] == float(np.argmax(theirs) == answer)
        correct.append(int(np.argmax(ours)) == answer)
    acc = lm_eval_run["results"]["jaxllm_mc"]["acc,none"]
    assert acc == np.mean(correct)
    assert acc > 0.5                # the model knows most of these: the scores are not noise


def test_generate_until_answers_are_the_engines(lm_eval_run, engine):
    got = samples(lm_eval_run, "jaxllm_gen")
    prompts = [p for p, _ in GENERATE]
    assert [s["doc"]["prompt"] for s in got] == prompts
    ref = [c.text for c in engine.generate(prompts, max_tokens=MAX_GEN, chat=False, stop=["\n"])]
    assert [s["resps"][0][0] for s in got] == ref
    matches = [r.strip() == a for r, (_, a) in zip(ref, GENERATE)]
    assert lm_eval_run["results"]["jaxllm_gen"]["exact_match,strip"] == np.mean(matches)
    assert 0 < np.mean(matches)
