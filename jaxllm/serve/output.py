"""A chat answer's text -> OpenAI message parts: reasoning, content, tool calls.

What a family's output holds is fixed once at server start (`chat_features`): Qwen3 thinks in
`<think>` ... `</think>` unless `enable_thinking` is false; Gemma 4 thinks in `<|channel>thought\\n`
... `<channel|>` when `enable_thinking` is true; both call tools in their own format (`tools.py`).

`ChatOutput` reads the text as it streams, and a whole answer is read the same way, so a stream's
deltas add up to the whole response. Text that could be the start of a marker is held back until
the next text tells; reasoning loses the newlines around it, and with tools the content loses the
whitespace around it, as the families' templates write them back.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from jaxllm.serve.tools import ToolCall, ToolCallStream, ToolFormat, partial_suffix, tool_format


@dataclass(frozen=True)
class Reasoning:
    start: str
    end: str
    label: str = ""  # a word the model writes first inside the block (not reasoning)
    default: bool = True  # the template thinks unless told `enable_thinking: false`
    decode_special: bool = False  # the markers are special tokens


@dataclass(frozen=True)
class ChatFeatures:
    tools: ToolFormat | None = None
    reasoning: Reasoning | None = None


FEATURES = {
    "qwen3": ChatFeatures(tool_format("qwen3"), Reasoning("<think>", "</think>")),
    "gemma4": ChatFeatures(
        tool_format("gemma4"), Reasoning("<|channel>", "<channel|>", "thought", default=False, decode_special=True)
    ),
}


def chat_features(family: str) -> ChatFeatures:
    return FEATURES.get(family, ChatFeatures())


@dataclass(frozen=True)
class OutputPlan:
    """How one request's answer is read (`None` parts are not looked for)."""

    tools: ToolFormat | None = None
    reasoning: Reasoning | None = None
    prefix: str = ""  # the answer's start, written into the prompt (a forced tool call)
    parallel: bool = True
    thinking_open: bool = False  # the prompt ends inside the reasoning block

    def reader(self) -> ChatOutput:
        return ChatOutput(self)


@dataclass
class Parts:
    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __bool__(self):
        return bool(self.reasoning or self.content or self.calls)

    def add(self, other: Parts):
        self.reasoning += other.reasoning
        self.content += other.content
        self.calls += other.calls


class ChatOutput:
    def __init__(self, plan: OutputPlan):
        self.plan = plan
        self.think = None if plan.reasoning is None else ReasoningStream(plan.reasoning, plan.thinking_open)
        self.tools = None if plan.tools is None else ToolCallStream(plan.tools, plan.parallel)
        self.trim = Trim() if plan.tools is not None else None
        self.pending = plan.prefix

    def push(self, text: str) -> Parts:
        text, self.pending = self.pending + text, ""
        if self.think is None:
            return self._content(text, final=False)
        return self._split(self.think.push(text), final=False)

    def finish(self) -> Parts:
        text, self.pending = self.pending, ""
        if self.think is None:
            return self._content(text, final=True)
        return self._split(self.think.push(text) + self.think.finish(), final=True)

    def _split(self, pieces: list[tuple[str, str]], final: bool) -> Parts:
        out = Parts()
        for kind, s in pieces:
            if kind == "reasoning":
                out.reasoning += s
            else:
                out.add(self._content(s, final=False))
        if final:
            out.add(self._content("", final=True))
        return out

    def _content(self, text: str, final: bool) -> Parts:
        if self.tools is None:
            return Parts(content=text)
        out = Parts()
        for kind, v in self.tools.push(text) + (self.tools.finish() if final else []):
            if kind == "call":
                out.calls.append(v)
            else:
                out.content += self.trim.push(v)
        return out


class Trim:
    """Content without the whitespace at its ends: leading whitespace is dropped, trailing
    whitespace waits for more text and is dropped if none comes."""

    def __init__(self):
        self.started, self.held = False, ""

    def push(self, text: str) -> str:
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        if not text:
            return ""
        body = text.rstrip()
        out = (self.held + body) if body else ""
        self.held = (self.held if not body else "") + text[len(body) :]
        return out


class ReasoningStream:
    """Splits an answer into reasoning (inside the family's markers, at its start) and content.
    push(text) and finish() return [("reasoning" | "content", str)]."""

    def __init__(self, fmt: Reasoning, open_: bool = False):
        self.fmt = fmt
        self.state = "label" if open_ else "head"  # head -> label -> reasoning -> after -> content
        self.buf = ""
        self.held = ""  # reasoning newlines that may end the block

    def push(self, text: str) -> list[tuple[str, str]]:
        self.buf += text
        out: list[tuple[str, str]] = []
        while self.buf:
            before = (self.state, len(self.buf))
            getattr(self, "_" + self.state)(out)
            if (self.state, len(self.buf)) == before:
                break  # waiting for more text
        return [(k, s) for k, s in out if s]

    def finish(self) -> list[tuple[str, str]]:
        if self.state in ("head", "after", "content"):
            out = [("content", self.buf.lstrip() if self.state == "after" else self.buf)]
        else:  # the block never closed: it is all reasoning
            text = self.buf
            if self.state == "label":
                text = text.lstrip("\n")
            out = [("reasoning", (self.held + text).rstrip("\n"))]
        self.buf, self.held = "", ""
        return [(k, s) for k, s in out if s]

    def _head(self, out):
        """Before anything: the block starts here, or there is none."""
        lead = self.buf.lstrip()
        if lead.startswith(self.fmt.start):
            self.buf, self.state = lead[len(self.fmt.start) :], "label"
        elif lead and not self.fmt.start.startswith(lead):
            self.state = "content"

    def _label(self, out):
        """Just inside the block: newlines and the family's label word are not reasoning."""
        want = self.fmt.label + "\n" if self.fmt.label else ""
        if want and want.startswith(self.buf):
            return  # the label may still be arriving
        if want and self.buf.startswith(want):
            self.buf = self.buf[len(want) :]
        self.buf = self.buf.lstrip("\n")
        if self.buf:
            self.state = "reasoning"

    def _reasoning(self, out):
        i = self.buf.find(self.fmt.end)
        if i >= 0:
            out.append(("reasoning", self._hold(self.buf[:i], final=True)))
            self.buf, self.state = self.buf[i + len(self.fmt.end) :], "after"
            return
        cut = len(self.buf) - partial_suffix(self.buf, self.fmt.end)
        out.append(("reasoning", self._hold(self.buf[:cut], final=False)))
        self.buf = self.buf[cut:]

    def _hold(self, text: str, final: bool) -> str:
        """Reasoning text, its trailing newlines held until more reasoning follows them."""
        text, self.held = self.held + text, ""
        if final:
            return text.rstrip("\n")
        body = text.rstrip("\n")
        self.held = text[len(body) :]
        return body

    def _after(self, out):
        """After the block: the answer starts at its first non-blank character."""
        self.buf = self.buf.lstrip()
        if self.buf:
            self.state = "content"

    def _content(self, out):
        out.append(("content", self.buf))
        self.buf = ""
