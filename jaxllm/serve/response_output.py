"""A Responses answer as it is generated (`Answer`): the engine's events for its request become
output items (`reasoning`, `message`, `function_call`) and the stream events that build them, each
with its `sequence_number`; a whole response is built by the same events, so it is what a stream
of the same answer adds up to. The request it answers is a `responses.Turn`."""

from __future__ import annotations

import json
import time
import uuid

from jaxllm.engine.jobs import Delta, Failed, Finished
from jaxllm.serve.answers import LogprobWriter
from jaxllm.serve.fields import ApiError
from jaxllm.serve.output import Parts
from jaxllm.serve.protocol import GenRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class Answer:
    """One response as it is generated: the engine's events for its request -> output items and
    the stream events that build them, each with its `sequence_number`. Items come in the order the
    answer writes them: reasoning, then its text as a message, each tool call as a function_call
    (text after a call, rare, a message of its own). A whole response is built by the same events."""

    def __init__(self, turn, req: GenRequest, tokenizer):  # turn: the `responses.Turn` it answers
        self.turn, self.req, self.tokenizer = turn, req, tokenizer
        self.reader = None if req.output is None else req.output.reader()
        self.writer = None if req.logprobs is None else LogprobWriter(req, tokenizer)
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written
        self.pending: list = []  # log-probabilities of tokens whose text is held back
        self.seq = 0
        self.finished: Finished | None = None
        self.completed_at: int | None = None
        self.error: ApiError | None = None

    @property
    def ended(self) -> bool:
        return self.finished is not None or self.error is not None

    @property
    def finish_reason(self) -> str:
        """As the chat route counts it: `tool_calls` when the answer called one."""
        called = any(it["type"] == "function_call" for it in self.items)
        return "tool_calls" if called else self.finished.finish_reason

    def start(self) -> list[dict]:
        return [
            self._event("response.created", response=self.response()),
            self._event("response.in_progress", response=self.response()),
        ]

    def on(self, ev) -> list[dict]:
        """An engine event (`Delta`, `Finished`, `Failed`; others carry nothing here) -> stream events."""
        if isinstance(ev, Delta):
            return self._parts(self.reader.push(ev.text) if self.reader else Parts(content=ev.text), ev.logprobs or [])
        if isinstance(ev, Finished):
            out = self._parts(self.reader.finish()) if self.reader else []
            self.finished, self.completed_at = ev, int(time.time())
            out += self._close()
            if not any(it["type"] in ("message", "function_call") for it in self.items):
                out += self._write("message", "") + self._close()  # an empty answer is an empty message
            obj = self.response()
            return out + [self._event("response." + obj["status"], response=obj)]
        if isinstance(ev, Failed):
            return self.fail(ApiError(ev.status, ev.message, type=ev.type))
        return []

    def fail(self, error: ApiError) -> list[dict]:
        self.error = error
        return [self._event("response.failed", response=self.response())]

    # -- items --------------------------------------------------------------------------------------
    def _event(self, kind: str, **fields) -> dict:
        self.seq += 1
        return {"type": kind, "sequence_number": self.seq - 1, **fields}

    def _parts(self, parts: Parts, entries=()) -> list[dict]:
        out = self._write("reasoning", parts.reasoning) if parts.reasoning else []
        if parts.content:
            out += self._write("message", parts.content, entries)
        elif parts.reasoning or parts.calls:
            self.pending = []  # those tokens wrote reasoning or calls, not text
        else:
            self.pending += entries
        for c in parts.calls:
            out += self._call(c)
        return out

    def _write(self, kind: str, text: str, entries=()) -> list[dict]:
        """Text of the reasoning or the message, opening that item (closing any other) first."""
        out = [] if self.open is not None and self.open["type"] == kind else self._close() + self._open(kind)
        item, where = self.open, {"item_id": self.open["id"], "output_index": len(self.items) - 1, "content_index": 0}
        part = item["content"][0]
        part["text"] += text
        if not text:
            return out
        if kind == "reasoning":
            return out + [self._event("response.reasoning_text.delta", **where, delta=text)]
        lp = self._logprobs(entries)
        part["logprobs"] += lp
        return out + [self._event("response.output_text.delta", **where, delta=text, logprobs=lp)]

    def _logprobs(self, entries) -> list[dict]:
        entries, self.pending = self.pending + list(entries), []
        return self.writer(entries)["content"] if self.writer is not None and entries else []

    def _open(self, kind: str) -> list[dict]:
        if kind == "reasoning":
            item = {
                "id": _id("rs"),
                "type": "reasoning",
                "summary": [],
                "status": "in_progress",
                "content": [{"type": "reasoning_text", "text": ""}],
            }
        else:
            item = {
                "id": _id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [{"type": "output_text", "text": "", "annotations": [], "logprobs": []}],
            }
        self.items.append(item)
        self.open = item
        where = {"item_id": item["id"], "output_index": len(self.items) - 1, "content_index": 0}
        return [
            self._event("response.output_item.added", output_index=len(self.items) - 1, item={**item, "content": []}),
            self._event("response.content_part.added", **where, part=dict(item["content"][0])),
        ]

    def _close(self) -> list[dict]:
        item, self.open = self.open, None
        if item is None:
            return []
        cut = self.finished is not None and self.finished.finish_reason == "length"
        item["status"] = "incomplete" if cut else "completed"
        part, index = item["content"][0], self.items.index(item)
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        done = (
            self._event("response.reasoning_text.done", **where, text=part["text"])
            if item["type"] == "reasoning"
            else self._event("response.output_text.done", **where, text=part["text"], logprobs=part["logprobs"])
        )
        return [
            done,
            self._event("response.content_part.done", **where, part=part),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _call(self, call) -> list[dict]:
        out = self._close()
        item = {
            "id": _id("fc"),
            "type": "function_call",
            "call_id": call.id,
            "name": call.name,
            "arguments": call.arguments,
            "status": "completed",
        }
        self.items.append(item)
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        return out + [
            self._event(
                "response.output_item.added",
                output_index=where["output_index"],
                item={**item, "arguments": "", "status": "in_progress"},
            ),
            self._event("response.function_call_arguments.delta", **where, delta=call.arguments),
            self._event("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments),
            self._event("response.output_item.done", output_index=where["output_index"], item=item),
        ]

    # -- the Response object ----------------------------------------------------------------------
    def usage(self) -> dict:
        f = self.finished
        reasoning = "".join(it["content"][0]["text"] for it in self.items if it["type"] == "reasoning")
        thought = len(self.tokenizer.encode(reasoning, add_special=False)) if reasoning else 0  # re-tokenized
        n_in = len(self.req.prompt_ids)
        return {
            "input_tokens": n_in,
            "input_tokens_details": {"cached_tokens": f.cached_tokens, "cache_write_tokens": 0},
            "output_tokens": f.completion_tokens,
            "output_tokens_details": {"reasoning_tokens": thought},
            "total_tokens": n_in + f.completion_tokens,
        }

    def response(self) -> dict:
        b, f = self.turn.body, self.finished
        status = (
            "failed"
            if self.error is not None
            else "in_progress"
            if f is None
            else "incomplete"
            if f.finish_reason == "length"
            else "completed"
        )
        return {
            "id": self.turn.id,
            "object": "response",
            "created_at": self.req.created,
            "status": status,
            "completed_at": self.completed_at,
            "background": False,
            "model": self.req.model,
            "output": self.items if f is not None or self.error is not None else [],
            "usage": self.usage() if f is not None else None,
            "error": None if self.error is None else {"code": "server_error", "message": self.error.message},
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "metadata": b.get("metadata") or {},
            "parallel_tool_calls": b.get("parallel_tool_calls") is not False,
            "previous_response_id": b.get("previous_response_id"),
            "reasoning": b.get("reasoning"),
            "temperature": _or(b.get("temperature"), 1.0),
            "top_p": _or(b.get("top_p"), 1.0),
            "text": b.get("text") or {"format": {"type": "text"}},
            "tool_choice": b.get("tool_choice") or "auto",
            "tools": [
                {"type": "function", "description": None, "parameters": None, "strict": None, **t}
                for t in b.get("tools") or []
            ],
            "top_logprobs": b.get("top_logprobs"),
            "truncation": b.get("truncation") or "disabled",
            "user": b.get("user"),
            "service_tier": b.get("service_tier"),
            "safety_identifier": b.get("safety_identifier"),
            "prompt_cache_key": b.get("prompt_cache_key"),
        }

    def conversation(self) -> list[dict]:
        """The conversation this response ends, as chat messages: its input and its output as one
        assistant message (text, reasoning, tool calls), as a chat client sends an answer back."""
        text = "".join(it["content"][0]["text"] for it in self.items if it["type"] == "message")
        msg = {"role": "assistant", "content": text}
        reasoning = "".join(it["content"][0]["text"] for it in self.items if it["type"] == "reasoning")
        if reasoning:
            msg["reasoning_content"] = reasoning
        calls = [
            {"id": it["call_id"], "type": "function", "function": {"name": it["name"], "arguments": it["arguments"]}}
            for it in self.items
            if it["type"] == "function_call"
        ]
        if calls:
            msg["tool_calls"] = calls
        return self.turn.history + [msg]


def _or(v, default):
    return default if v is None else v


def sse(event: dict) -> str:
    """One stream event as OpenAI sends it: its type as the SSE event name, the event as data."""
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"
