"""What every streaming tool-call parser shares (the rules are in router/serving/output/tool_parsers.py's
doc): `ToolParser`, the base of every family (event output, whitespace around calls, call numbering),
`MarkedParser` for the families whose calls open with a marker, and the JSON helpers they read calls
with."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Mapping
from typing import Any

from router.protocols.events import OutputEvent, TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart

IdFactory = Callable[[], str]


def new_call_id() -> str:
    """OpenAI's shape of call id: "call_" and 24 hex characters."""
    return "call_" + secrets.token_hex(12)


def held(buf: str, marker: str) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of `marker` (it may grow into it)."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


class JsonEnd:
    """Finds the index just past the JSON object or array that opens at s[0], resuming where the last
    call stopped (the text only grows between calls), so a long call costs O(n) over the stream.
    Only brackets and strings are tracked; json.loads judges the span afterwards."""

    def __init__(self):
        self.pos, self.depth, self.in_str, self.esc = 0, 0, False, False

    def __call__(self, s: str) -> int | None:
        for i in range(self.pos, len(s)):
            c = s[i]
            if self.in_str:
                if self.esc:
                    self.esc = False
                elif c == "\\":
                    self.esc = True
                elif c == '"':
                    self.in_str = False
            elif c == '"':
                self.in_str = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        self.pos = len(s)
        return None


def load_json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def as_call(obj: Any, arg_keys: tuple[str, ...], *, strict: bool = False) -> tuple[str, dict] | None:
    """(name, arguments) when `obj` is a call object, else None. Arguments may be an object or a JSON
    string of one (some fine-tunes quote them). `strict` (for syntaxes without a marker, where any
    JSON answer could look like a call): the arguments key is required and no other keys allowed."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"].strip():
        return None
    keys = [k for k in arg_keys if k in obj]
    if len(keys) > 1:
        return None
    if strict and (not keys or set(obj) - {"name", "type", *keys} or obj.get("type", "function") != "function"):
        return None
    args = obj[keys[0]] if keys else {}
    if isinstance(args, str):
        args = load_json(args) if args.strip() else {}
    if not isinstance(args, dict):
        return None
    return obj["name"].strip(), args


def dump_arguments(args: Mapping) -> str:
    """The arguments string the protocols send: compact, non-ASCII kept."""
    return json.dumps(args, ensure_ascii=False, separators=(",", ":"))


class ToolParser:
    """The base of every family: event output, whitespace handling around calls, call numbering.
    Subclasses implement `_step(final)`, which consumes `self._buf` as far as it can decide."""

    family = ""

    def __init__(self, new_id: IdFactory | None = None, tools: list[dict] | None = None):
        self._new_id = new_id or new_call_id
        self._tools = tools  # the request's tools (OpenAI shape): some families type argument values by them
        self._buf = ""
        self._out: list[OutputEvent] = []
        self._ws = ""  # whitespace held at the end of a text run
        self._after_call = False  # drop whitespace until the next visible character
        self.calls = 0  # complete calls emitted so far
        self._done = False
        self._json_end = JsonEnd()  # reset whenever text is consumed (by _text or _call)

    def feed(self, text: str) -> list[OutputEvent]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        self._step(final=False)
        return self._take()

    def finish(self) -> list[OutputEvent]:
        """Everything still held: a call completed by the end of the text, else plain text."""
        if not self._done:
            self._done = True
            self._step(final=True)
            if self._buf:
                self._text(self._buf)
                self._buf = ""
            if self._ws:
                self._out.append(TextDelta(text=self._ws))
                self._ws = ""
        return self._take()

    def _step(self, final: bool) -> None:
        raise NotImplementedError

    def _take(self) -> list[OutputEvent]:
        out, self._out = self._out, []
        return out

    def _text(self, s: str) -> None:
        self._json_end = JsonEnd()
        if self._after_call:
            s = s.lstrip()
            if not s:
                return
            self._after_call = False
        s = self._ws + s
        body = s.rstrip()
        self._ws = s[len(body) :]
        if body:
            self._out.append(TextDelta(text=body))

    def _call(self, name: str, args: dict) -> None:
        self._json_end = JsonEnd()
        self._ws = ""
        i = self.calls
        self._out += [
            ToolCallStart(index=i, id=self._new_id(), name=name),
            ToolCallArguments(index=i, arguments=dump_arguments(args)),
            ToolCallEnd(index=i),
        ]
        self.calls += 1
        self._after_call = True


class MarkedParser(ToolParser):
    """Families whose calls open with a marker string: text until the marker, held only while its
    tail may still become the marker; then `_call_text` consumes the call."""

    marker = ""

    def __init__(self, new_id: IdFactory | None = None, tools: list[dict] | None = None):
        super().__init__(new_id, tools)
        self._in_call = False

    def _step(self, final: bool) -> None:
        while True:
            if not self._in_call:
                i = self._buf.find(self.marker)
                if i < 0:
                    keep = 0 if final else held(self._buf, self.marker)
                    self._text(self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    return
                self._text(self._buf[:i])
                self._buf = self._buf[i + len(self.marker) :]
                self._in_call = True
            used = self._call_text(final)
            if used is None:
                if final:  # unterminated: the marker and everything after it is text
                    self._text(self.marker + self._buf)
                    self._buf = ""
                    self._in_call = False
                return
            self._in_call = False

    def _call_text(self, final: bool) -> int | None:
        """Consume the call after the marker from self._buf (emitting the call, or the marker and
        its text when invalid); None while undecided."""
        raise NotImplementedError
