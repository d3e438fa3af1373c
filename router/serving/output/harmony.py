"""gpt-oss's harmony format, read from the text stream: channels instead of call markers.

The chat template ends the prompt with `<|start|>assistant`; the model then writes one or more
messages, each a header and a body:
    <|channel|>analysis<|message|>...thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>The answer.<|return|>
(`to=` may also come before the channel: `<|start|>assistant to=functions.f<|channel|>commentary json`,
which is how the template writes past calls.) The analysis channel is reasoning, a commentary
message addressed to `functions.NAME` is a call of NAME with the body as its JSON arguments, and
final (or commentary without a recipient: a preamble the user may see) is answer text. `<|call|>`
and `<|return|>` end the generation (they are end-of-sequence tokens), so a call's body usually ends
with the output itself.

Why not openai-harmony (PyPI): its parser reads token ids with the o200k encoding, which it fetches
from the network on first use; the router sees text, and Orchard's nodes may be offline.

Rules, as for the other parsers: reasoning and text stream as they come (only a tail that may still
become a marker is held); a call is emitted whole once its body is complete and parses as a JSON
object; anything that does not read as harmony (no header at the start, a header that never reaches
`<|message|>`, a call body that is not JSON) is text, nothing lost; the result does not depend on
how the text was cut. Output that does not start with a header (a detokenizer that drops special
tokens, a plain answer) is the final channel as it is."""

from __future__ import annotations

import re

from router.protocols.events import ReasoningDelta, TextDelta
from router.serving.output.tool_parser_base import IdFactory, ToolParser, held, load_json

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
TO = " to="  # a header may open with the recipient, right after the prompt's `<|start|>assistant`
HEADS = (START, CHANNEL, TO)
ENDS = ("<|end|>", "<|call|>", "<|return|>", START)  # what ends a body (a new <|start|> too)
HEADER_MAX = 512  # a header longer than this without <|message|> is text
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([A-Za-z_]+)")


class HarmonyParser(ToolParser):
    """One generation's harmony reader: ReasoningDelta (analysis), TextDelta (final, preambles) and
    whole tool calls (commentary to=functions.NAME). With `calls=False` (the request enabled no
    tools) a call message comes out as the text it was."""

    family = "harmony"

    def __init__(self, new_id: IdFactory | None = None, tools: list[dict] | None = None, *, calls: bool = True):
        super().__init__(new_id, tools)
        self._calls_on = calls
        self._state = "start"  # start | header | body
        self._channel = "final"
        self._recipient: str | None = None
        self._header = ""  # the current message's header text, as written
        self._body = ""  # a call's body so far

    def _step(self, final: bool) -> None:
        while self._buf:
            if self._state == "start":
                body = self._buf
                if body.startswith(HEADS):
                    self._state = "header"
                    continue
                if not final and any(head.startswith(body) for head in HEADS):
                    return
                self._open("final", None, "")  # no header: a plain answer
                continue
            if self._state == "header":
                i = self._buf.find(MESSAGE)
                if i < 0:
                    if final or len(self._buf) > HEADER_MAX:
                        self._emit_text(self._buf)  # never became a header
                        self._buf = ""
                        self._open("final", None, "")
                    return
                header = self._buf[: i + len(MESSAGE)]
                self._buf = self._buf[i + len(MESSAGE) :]
                channel = _CHANNEL.search(header)
                recipient = _RECIPIENT.search(header)
                self._open(channel.group(1) if channel else "final", recipient.group(1) if recipient else None, header)
                continue
            # body: up to the first end marker, streamed except a call's
            ends = [j for j in (self._buf.find(m) for m in ENDS) if j >= 0]
            j = min(ends) if ends else -1
            if j < 0:
                keep = 0 if final else max(held(self._buf, m) for m in ENDS)
                self._part(self._buf[: len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep :]
                return
            self._part(self._buf[:j])
            rest = self._buf[j:]
            marker = next(m for m in ENDS if rest.startswith(m))
            self._close(marker)
            self._buf = rest if marker == START else rest[len(marker) :]
            self._state = "start"

    def finish(self) -> list:
        if not self._done:
            self._done = True
            self._step(final=True)
            if self._state == "body":
                self._close("")
            elif self._buf:
                self._emit_text(self._buf)
            self._buf = ""
        return self._take()

    def _open(self, channel: str, recipient: str | None, header: str) -> None:
        self._state, self._channel, self._recipient, self._header, self._body = "body", channel, recipient, header, ""

    def _is_call(self) -> bool:
        return self._recipient is not None

    def _part(self, text: str) -> None:
        if not text:
            return
        if self._is_call():
            self._body += text
        elif self._channel == "analysis":
            self._out.append(ReasoningDelta(text=text))
        else:
            self._emit_text(text)

    def _close(self, marker: str) -> None:
        """The message ended (`marker`, or "" at the end of the output): a call is decided now."""
        if not self._is_call():
            return
        name = (self._recipient or "").removeprefix(FUNCTIONS)
        args = load_json(self._body) if self._body.strip() else {}
        if self._calls_on and self._recipient and self._recipient.startswith(FUNCTIONS) and name and isinstance(args, dict):
            self._call(name, args)
        else:  # not a function call Orchard can answer (a built-in tool, bad JSON, tools off): its text
            self._emit_text(self._header + self._body + (marker if marker != START else ""))
        self._body = ""

    def _emit_text(self, text: str) -> None:
        if text:
            self._out.append(TextDelta(text=text))
