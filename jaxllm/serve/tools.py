"""Tool calls in a model's output: each family's format, read as the text streams in.

A format names the markers around one call and reads the call between them:

- Qwen3 (its chat template asks for this): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call.
- Gemma 4 (its chat template's format_argument macro, and vLLM's gemma4 tool parser):
  `<|tool_call>call:NAME{key:value,...}<tool_call|>`, strings between `<|"|>` markers, keys bare,
  numbers, true/false and null bare, objects `{...}` and lists `[...]` nested; the markers are
  special tokens, so the output is decoded with them.

`ToolCallStream` serves streamed and whole responses alike, so a stream's deltas add up to the
whole response. A call is handed out once its end marker arrives and it parses; one that does not
parse (or never ends) is returned as content, never as an error.
"""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as OpenAI's function.arguments
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])


class ToolFormat(abc.ABC):
    family: str
    start: str
    end: str
    decode_special = False  # the markers are special tokens: decode the output with them

    @abc.abstractmethod
    def parse(self, body: str) -> tuple[str, dict] | None:
        """The text between the markers -> (function name, arguments), or None if malformed."""

    @abc.abstractmethod
    def forced_prefix(self, name: str | None) -> str:
        """The start of the answer that commits the model to a call (of `name`, if given)."""


class Qwen3Tools(ToolFormat):
    family, start, end = "qwen3", "<tool_call>", "</tool_call>"

    def parse(self, body):
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not set(obj) <= {"name", "arguments"}:
            return None
        name, args = obj.get("name"), obj.get("arguments", {})
        if isinstance(args, str):  # arguments sent as a JSON string
            try:
                args = json.loads(args)
            except ValueError:
                return None
        if not isinstance(name, str) or not name or not isinstance(args, dict):
            return None
        return name, args

    def forced_prefix(self, name):
        return "<tool_call>\n" + ("" if name is None else '{"name": ' + json.dumps(name) + ', "arguments": ')


class Gemma4Tools(ToolFormat):
    family, start, end = "gemma4", "<|tool_call>", "<tool_call|>"
    decode_special = True
    QUOTE = '<|"|>'
    NAME = re.compile(r"call:([\w.\-]+)\{")

    def parse(self, body):
        m = self.NAME.match(body.strip())
        if m is None:
            return None
        text = body.strip()
        try:
            args, i = self._object(text, m.end() - 1)
        except ValueError:
            return None
        return (m.group(1), args) if not text[i:].strip() else None

    def forced_prefix(self, name):
        return "<|tool_call>call:" + ("" if name is None else name + "{")

    # -- the argument syntax: a small recursive-descent reader ------------------------------------
    def _skip(self, s: str, i: int) -> int:
        while i < len(s) and s[i] in " \t\r\n":
            i += 1
        return i

    def _value(self, s: str, i: int):
        i = self._skip(s, i)
        if s.startswith(self.QUOTE, i):
            return self._string(s, i)
        if i < len(s) and s[i] == "{":
            return self._object(s, i)
        if i < len(s) and s[i] == "[":
            return self._list(s, i)
        m = re.compile(r"[^,}\]]+").match(s, i)
        if m is None or not m.group().strip() or self.QUOTE in m.group():
            raise ValueError("no value")
        return _scalar(m.group().strip()), m.end()

    def _string(self, s: str, i: int):
        j = s.find(self.QUOTE, i + len(self.QUOTE))
        if j < 0:
            raise ValueError("unterminated string")
        return s[i + len(self.QUOTE) : j], j + len(self.QUOTE)

    def _object(self, s: str, i: int):
        out, i = {}, self._skip(s, i + 1)
        if i < len(s) and s[i] == "}":
            return out, i + 1
        while True:
            i = self._skip(s, i)
            if s.startswith(self.QUOTE, i):
                key, i = self._string(s, i)
            else:
                m = re.compile(r"[^:,{}\[\]<>]+").match(s, i)
                if m is None or not m.group().strip():
                    raise ValueError("no key")
                key, i = m.group().strip(), m.end()
            i = self._skip(s, i)
            if i >= len(s) or s[i] != ":":
                raise ValueError("no ':' after a key")
            out[key], i = self._value(s, i + 1)
            i = self._skip(s, i)
            if i < len(s) and s[i] == ",":
                i += 1
            elif i < len(s) and s[i] == "}":
                return out, i + 1
            else:
                raise ValueError("unterminated object")

    def _list(self, s: str, i: int):
        out, i = [], self._skip(s, i + 1)
        if i < len(s) and s[i] == "]":
            return out, i + 1
        while True:
            v, i = self._value(s, i)
            out.append(v)
            i = self._skip(s, i)
            if i < len(s) and s[i] == ",":
                i += 1
            elif i < len(s) and s[i] == "]":
                return out, i + 1
            else:
                raise ValueError("unterminated list")


_NUMBER = re.compile(r"-?\d+(\.\d+)?([eE][+-]?\d+)?")


def _scalar(t: str):
    """A bare Gemma value: true/false, null (None in older templates), a number, else the word."""
    if t in ("true", "false"):
        return t == "true"
    if t in ("null", "None"):
        return None
    if _NUMBER.fullmatch(t):
        return float(t) if any(c in t for c in ".eE") else int(t)
    return t


FORMATS = {f.family: f for f in (Qwen3Tools(), Gemma4Tools())}


def tool_format(family: str) -> ToolFormat | None:
    """The tool-call format of a model family (None: the family has none)."""
    return FORMATS.get(family)


# -- reading the output as it streams ---------------------------------------------------------------
def partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


class ToolCallStream:
    """Splits text into content and tool calls as it arrives. push(text) and finish() return
    [("content", str) | ("call", ToolCall)]; content that could be the start of a call's marker is
    held back until the next text tells."""

    def __init__(self, fmt: ToolFormat, parallel: bool = True):
        self.fmt, self.parallel = fmt, parallel
        self.buf, self.inside, self.calls = "", False, 0

    def push(self, text: str) -> list[tuple[str, object]]:
        fmt, out = self.fmt, []
        self.buf += text
        while True:
            if not self.inside:
                i = self.buf.find(fmt.start)
                if i < 0:
                    cut = len(self.buf) - partial_suffix(self.buf, fmt.start)
                    out.append(("content", self.buf[:cut]))
                    self.buf = self.buf[cut:]
                    break
                out.append(("content", self.buf[:i]))
                self.buf, self.inside = self.buf[i + len(fmt.start) :], True
            else:
                j = self.buf.find(fmt.end)
                if j < 0:
                    break
                body, self.buf, self.inside = self.buf[:j], self.buf[j + len(fmt.end) :], False
                out.append(self._call(body))
        return [(k, v) for k, v in out if v]

    def finish(self) -> list[tuple[str, object]]:
        """The output ended: a call left open is content."""
        text = (self.fmt.start if self.inside else "") + self.buf
        self.buf, self.inside = "", False
        return [("content", text)] if text else []

    def _call(self, body: str) -> tuple[str, object]:
        parsed = self.fmt.parse(body)
        if parsed is None:
            return "content", self.fmt.start + body + self.fmt.end
        self.calls += 1
        if self.calls > 1 and not self.parallel:  # parallel_tool_calls: false keeps the first
            return "content", ""
        name, args = parsed
        return "call", ToolCall(name, json.dumps(args, ensure_ascii=False))
