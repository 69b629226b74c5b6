"""Tiny chat checkpoints and a server whose answers are scripted.

The checkpoints are tiny random models (`tiny.make`, `gemma4_refs.build`) saved with a byte-level
tokenizer that has the family's special tokens and the family's real chat template (tests/data):
Qwen3's as published in its tokenizer_config.json, Gemma 4's tool template from vLLM's examples.

`ScriptedEngine` is the real engine with its core swapped for `ScriptedCore`, which answers each
prompt with the token ids a test scripts for it, through the real scheduler and HTTP server; so a
tool call, a reasoning block or a malformed call comes out of the server exactly as scripted.
"""
from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import numpy as np
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

DATA = Path(__file__).parents[1] / "data"
QWEN3_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
QWEN3_TAGS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
GEMMA4_SPECIAL = ["<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool>", "<tool|>", "<|tool_call>",
                  "<tool_call|>", "<|tool_response>", "<tool_response|>", '<|"|>', "<|channel>", "<channel|>",
                  "<|think|>", "<|image|>", "<|audio|>", "<|video|>"]


def byte_tokenizer(special: list[str], tags: list[str] = ()) -> Tokenizer:
    """Ids 0.. for `special` (special tokens) and `tags` (added, not special), then one id per byte."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    added = [*special, *tags]
    vocab = {t: i for i, t in enumerate(added)} | {c: len(added) + i for i, c in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in tags])
    return tok


def _write_tokenizer(path: Path, tok: Tokenizer, template: str, config: dict, eos_ids: list[int]):
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "chat_template.jinja").write_text(template)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))


def make_qwen3(path: Path, seed: int = 0) -> Path:
    import tiny
    tok = byte_tokenizer(QWEN3_SPECIAL, QWEN3_TAGS)
    ids = {t: tok.token_to_id(t) for t in QWEN3_SPECIAL}
    tiny.make("qwen3", path, seed=seed, vocab_size=288, max_position_embeddings=4096, eos_token_id=ids["<|im_end|>"],
              bos_token_id=ids["<|endoftext|>"], pad_token_id=ids["<|endoftext|>"])
    _write_tokenizer(path, tok, (DATA / "qwen3_chat_template.jinja").read_text(),
                     {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
                      "add_bos_token": False},
                     [ids["<|im_end|>"], ids["<|endoftext|>"]])
    return path


def make_gemma4(path: Path, seed: int = 0) -> Path:
    import gemma4_refs
    tok = byte_tokenizer(GEMMA4_SPECIAL)
    assert [tok.token_to_id(t) for t in ("<pad>", "<eos>", "<bos>")] == [0, 1, 2]   # as gemma4_refs.BASE
    gemma4_refs.build("31b", seed=seed, vocab_size=288, max_position_embeddings=4096).save_pretrained(path)
    # Gemma 4 ends a turn at <turn|>, and a turn that called tools at <|tool_response>
    _write_tokenizer(path, tok, (DATA / "gemma4_chat_template.jinja").read_text(),
                     {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>", "add_bos_token": True},
                     [1, tok.token_to_id("<turn|>"), tok.token_to_id("<|tool_response>")])
    return path


# -- scripted generation ----------------------------------------------------------------------------
class ScriptedCore:
    """The engine core's interface (prefill pieces into slots, decode the live slots in blocks),
    answering each prompt with `reply(prompt_ids) -> token ids` (an EOS ends it early, the request's
    token limit cuts it). The prompts it was sent are kept in `prompts`. Its KV blocks are handed
    out as a real core's (`plan`), without a prefix cache: every prompt is sent whole."""

    def __init__(self, reply, num_slots: int, max_len: int, eos_ids, plan, step_s: float = 0.0):
        from jaxllm.engine.blocks import BlockManager
        self.reply, self.num_slots, self.max_len, self.eos = reply, num_slots, max_len, set(eos_ids)
        self.step_s = step_s                # seconds a decode step takes (a slow device)
        self.prompts: list[list[int]] = []
        self.plan = plan
        self.blocks = BlockManager(plan, num_slots, prefix_caching=False)
        self.reset()

    def reset(self):
        self.blocks.reset()
        self.filling = [[] for _ in range(self.num_slots)]
        self.queue = [[] for _ in range(self.num_slots)]

    def out_size(self, n_tokens: int) -> int:
        return n_tokens

    def spec_stats(self, rows=None):
        return None

    def _script(self, toks: list[int], ignore_eos: bool) -> list[int]:
        end = next((i for i, t in enumerate(toks) if t in self.eos), None)
        return toks if end is None or ignore_eos else toks[:end + 1]

    def prefill(self, pieces, targets=None, logprobs: int = 0):
        """(The server asks every call for log-probabilities; a scripted answer has none to give.)"""
        if targets is not None:
            raise ValueError("a scripted answer has no prompt log-probabilities")
        first = np.zeros(len(pieces.tokens), np.int32)
        for p, b in enumerate(np.asarray(pieces.rows)):
            if b >= self.num_slots:
                continue
            if pieces.start[p] == 0:
                self.filling[b] = []
            self.filling[b] += pieces.tokens[p, :pieces.length[p]].tolist()
            if pieces.final[p]:
                self.prompts.append(list(self.filling[b]))
                answer = self._script(list(self.reply(self.filling[b])), bool(pieces.ignore_eos[p]))
                answer = answer[:int(pieces.max_new[p])]
                first[p], self.queue[b] = answer[0], answer[1:]
        return first

    def decode(self, n_steps: int, max_steps: int, stop=None, rows: int | None = None, logprobs: int = 0,
               allowed=None):
        if allowed is not None:
            raise ValueError("a scripted answer has no grammar")
        rows = rows or self.num_slots
        n_steps = max_steps if n_steps is None else n_steps         # a fixed block runs them all
        time.sleep(self.step_s * n_steps)
        toks, count = np.zeros((rows, max_steps), np.int32), np.zeros(rows, np.int32)
        for b in range(rows):
            if stop is not None and stop[b]:
                self.queue[b] = []
            take, self.queue[b] = self.queue[b][:min(n_steps, max_steps)], self.queue[b][min(n_steps, max_steps):]
            toks[b, :len(take)], count[b] = take, len(take)
        return toks, count, None


class ScriptedEngine:
    """A loaded engine (config, tokenizer, layout) whose core answers from a script."""

    def __init__(self, engine, reply, step_s: float = 0.0):
        self._engine, self.reply, self.step_s, self.cores = engine, reply, step_s, []

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def core(self, num_slots: int, max_len: int, budget=None, span=None, prefix_caching=False,
             steady=None) -> ScriptedCore:
        plan = self._engine.pool_plan(num_slots, max_len, budget, span, steady)
        self.cores.append(ScriptedCore(self.reply, num_slots, max_len, self._engine.cfg.eos_ids, plan, self.step_s))
        return self.cores[-1]


# -- a live server in this process ------------------------------------------------------------------
class LiveServer:
    """`build_app(engine, opts)` served by uvicorn on a free loopback port, in a thread."""

    def __init__(self, engine, **opts):
        import socket

        import uvicorn

        from jaxllm.serve.app import ServeOptions, build_app
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = build_app(engine, ServeOptions(**{"served_name": "m", "warmup": False, **opts}))
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning",
                                                    lifespan="on"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        t0 = time.time()
        while not self.server.started:
            if not self.thread.is_alive() or time.time() - t0 > 300:
                raise RuntimeError("the server did not start")
            time.sleep(0.05)

    @property
    def scheduler(self):
        return self.app.state.server.scheduler

    def client(self, **kw):
        import openai
        return openai.OpenAI(base_url=self.url + "/v1", api_key=kw.pop("api_key", "none"), max_retries=0,
                             timeout=120, **kw)

    def stop(self):
        self.server.should_exit = True
        self.thread.join(60)
