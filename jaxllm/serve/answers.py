"""The OpenAI response shapes the server writes: whole answers, stream chunks, usage, tool calls and
log-probabilities (`protocol` parses the requests they answer)."""

from __future__ import annotations

from jaxllm.serve.output import Parts
from jaxllm.serve.protocol import LOGPROB_FLOOR, GenRequest
from jaxllm.tokenizer import Tokenizer


def usage(n_prompt: int, n_completion: int, cached: int = 0) -> dict:
    """OpenAI's usage, with the prompt tokens whose KV came from the prefix cache."""
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_completion,
        "total_tokens": n_prompt + n_completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def tool_call_json(c) -> dict:
    return {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}


def chat_message(req: GenRequest, text: str, parts: Parts | None) -> dict:
    if req.output is None or parts is None:
        return {"role": "assistant", "content": text}
    msg = {"role": "assistant", "content": parts.content or None}
    if req.output.reasoning is not None:
        msg["reasoning_content"] = parts.reasoning or None
    if parts.calls:
        msg["tool_calls"] = [tool_call_json(c) for c in parts.calls]
    return msg


def choice(
    req: GenRequest, index: int, text: str, finish_reason: str, parts: Parts | None = None, logprobs: dict | None = None
) -> dict:
    """One answer of a response; `parts`: a chat answer read by its `OutputPlan`; `logprobs`: from
    `LogprobWriter`."""
    if req.kind == "completion":
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if parts is not None and parts.calls:
        finish_reason = "tool_calls"
    return {
        "index": index,
        "message": chat_message(req, text, parts),
        "logprobs": logprobs,
        "finish_reason": finish_reason,
    }


def full_response(req: GenRequest, choices: list[dict], n_completion: int, cached: int = 0) -> dict:
    """The whole response: its `choice`s, in index order, and the usage (the prompt counted once,
    the tokens of every answer)."""
    obj = "text_completion" if req.kind == "completion" else "chat.completion"
    return {
        "id": req.id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": choices,
        "usage": usage(len(req.prompt_ids), n_completion, cached),
    }


def stream_chunk(
    req: GenRequest,
    text: str | None,
    finish_reason: str | None = None,
    role: bool = False,
    delta: dict | None = None,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    """One SSE chunk of answer `index`, with a text delta (or a chat `delta`, the role announcement,
    or the finish reason), and the log-probabilities of the tokens it brings."""
    if req.kind == "completion":
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "text_completion"
    else:
        if delta is None:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        obj = "chat.completion.chunk"
    chunk = {"id": req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}
    if req.include_usage:
        chunk["usage"] = None
    return chunk


class LogprobWriter:
    """Token log-probabilities (`TokenLogprob`s; the prompt's first token has none) -> a response's
    `logprobs`, written as vLLM writes them: each token as its own decoded text, -inf as -9999.
    Completions: `tokens`, `token_logprobs`, `top_logprobs` ({text: logprob} of the token and the
    `logprobs` most likely ones), `text_offset` (running on across a stream's chunks); chat:
    `content`, each token with its `bytes` and the `top_logprobs` most likely ones."""

    def __init__(self, req: GenRequest, tokenizer):
        self.kind, self.n, self.tokenizer = req.kind, req.logprobs, tokenizer
        self.offset = 0

    def text(self, token_id: int) -> str:
        if isinstance(self.tokenizer, Tokenizer):
            return self.tokenizer.piece(token_id)
        return self.tokenizer.decode([token_id])  # stand-in tokenizers take only the ids

    def __call__(self, entries: list) -> dict:
        if self.kind == "chat":
            return {
                "content": [
                    {
                        **self._chat(e.token_id, e.logprob),
                        "top_logprobs": [self._chat(i, v) for i, v in e.top[: self.n]],
                    }
                    for e in entries
                ]
            }
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for e in entries:
            s = self.text(e.token_id)
            top = (
                None
                if e.logprob is None
                else {s: _floor(e.logprob), **{self.text(i): _floor(v) for i, v in e.top[: self.n]}}
            )
            out["tokens"].append(s)
            out["token_logprobs"].append(None if e.logprob is None else _floor(e.logprob))
            out["top_logprobs"].append(top)
            out["text_offset"].append(self.offset)
            self.offset += len(s)
        return out

    def _chat(self, token_id: int, logprob: float) -> dict:
        s = self.text(token_id)
        return {"token": s, "logprob": _floor(logprob), "bytes": list(s.encode("utf-8", errors="replace"))}


def prompt_logprobs_json(req: GenRequest, entries: list, tokenizer) -> list:
    """The prompt's TokenLogprobs as vLLM writes `prompt_logprobs`: None for the first token, then
    per token {token id: {logprob, rank, decoded_token}} for the token and the
    `prompt_logprobs` most likely ones (rank: 1 for the most likely; null for a prompt token
    below the alternatives listed, whose rank is not computed)."""
    text = LogprobWriter(req, tokenizer).text
    out = []
    for e in entries:
        if e.logprob is None:
            out.append(None)
            continue
        top = e.top[: req.shown_prompt_logprobs]
        rank = next((r for r, (i, _) in enumerate(e.top, 1) if i == e.token_id), None)
        row = {str(e.token_id): {"logprob": _floor(e.logprob), "rank": rank, "decoded_token": text(e.token_id)}}
        for r, (i, v) in enumerate(top, 1):
            row.setdefault(str(i), {"logprob": _floor(v), "rank": r, "decoded_token": text(i)})
        out.append(row)
    return out


def _floor(v: float) -> float:
    return max(float(v), LOGPROB_FLOOR)


class ChatDeltas:
    """A streamed chat answer's parts -> OpenAI deltas: reasoning and content as text, each tool
    call as a delta with its index, id and name, then one with its arguments."""

    def __init__(self):
        self.calls = 0

    def __call__(self, parts: Parts) -> list[dict]:
        out, d = [], {}
        if parts.reasoning:
            d["reasoning_content"] = parts.reasoning
        if parts.content:
            d["content"] = parts.content
        if d:
            out.append(d)
        for c in parts.calls:
            fn = {"name": c.name, "arguments": ""}
            out.append({"tool_calls": [{"index": self.calls, "id": c.id, "type": "function", "function": fn}]})
            out.append({"tool_calls": [{"index": self.calls, "function": {"arguments": c.arguments}}]})
            self.calls += 1
        return out


class AnswerStream:
    """Answer `index` of a streamed response -> its chunks: text, or chat deltas (reasoning and tool
    calls read as they come, by the request's `OutputPlan`), each with the log-probabilities of the
    tokens whose text it completes; then its finish chunk."""

    def __init__(self, req: GenRequest, index: int, tokenizer):
        self.req, self.index = req, index
        self.reader = None if req.output is None else req.output.reader()
        self.deltas = ChatDeltas()
        self.writer = LogprobWriter(req, tokenizer)

    def role(self) -> dict:
        return stream_chunk(self.req, None, role=True, index=self.index)

    def prompt_scores(self, scores: list) -> dict:
        """A chunk with no text carrying the prompt's `prompt_logprobs` (vLLM's first chunk has them)."""
        chunk = stream_chunk(self.req, None, delta={} if self.req.kind == "chat" else None, index=self.index)
        if self.req.kind == "chat":
            chunk["prompt_logprobs"] = scores
        else:
            chunk["choices"][0]["prompt_logprobs"] = scores
        return chunk

    def text(self, text: str, entries=None) -> list[dict]:
        if self.reader is not None:
            return self._parts(self.reader.push(text), entries)
        lp = self.writer(entries) if entries else None
        if self.req.kind == "chat":
            return [
                stream_chunk(self.req, None, delta={"content": text} if text else {}, logprobs=lp, index=self.index)
            ]
        return [stream_chunk(self.req, text, logprobs=lp, index=self.index)]

    def finish(self, reason: str) -> tuple[list[dict], str]:
        """-> (the last chunks, the finish chunk among them), the finish reason sent."""
        out = []
        if self.reader is not None:
            out = self._parts(self.reader.finish())
            reason = "tool_calls" if self.deltas.calls else reason
        return out + [stream_chunk(self.req, None, reason, index=self.index)], reason

    def _parts(self, parts: Parts, entries=None) -> list[dict]:
        lp = self.writer(entries) if entries else None
        ds = self.deltas(parts) or ([{}] if lp else [])
        return [
            stream_chunk(self.req, None, delta=d, logprobs=lp if i == 0 else None, index=self.index)
            for i, d in enumerate(ds)
        ]


def usage_chunk(req: GenRequest, n_completion: int, cached: int = 0) -> dict:
    obj = "text_completion" if req.kind == "completion" else "chat.completion.chunk"
    return {
        "id": req.id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": [],
        "usage": usage(len(req.prompt_ids), n_completion, cached),
    }
