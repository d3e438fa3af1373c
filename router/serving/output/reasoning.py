"""Splits a reasoning model's output into its reasoning and its answer, as the text streams.

Reasoning models (DeepSeek-R1 and its distills, QwQ, Qwen3) write their thinking between markers,
`<think>` and `</think>` by default, before the answer. Some chat templates already open the block
in the prompt (DeepSeek-R1's current template, Qwen3 "Thinking" checkpoints), so the output begins
inside the reasoning and only the end marker appears: `starts_inside`.

Decisions:
- The start marker opens reasoning only at the very beginning of the output (after whitespace), and
  the block closes once: a `<think>` the answer mentions later is answer text. With `starts_inside`
  a start marker the model writes anyway is dropped.
- Whitespace just inside the markers and right after the end marker (templates put `\\n` and
  `\\n\\n` there) is dropped; an output with no reasoning comes out byte for byte.
- A marker split across chunks is held only while the tail may still become it.
- Reasoning cut off before its end marker (max_tokens) is reasoning: there was no answer."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from router.protocols.events import ReasoningDelta, TextDelta


class ReasoningConfig(BaseModel):
    """A model's reasoning markers (the registry's `reasoning` field)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    start: str = Field("<think>", min_length=1)
    end: str = Field("</think>", min_length=1)
    starts_inside: bool = False  # the chat template opens the block in the prompt


def _held(buf: str, marker: str) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of `marker`."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


class ReasoningSplitter:
    """One generation's splitter: `feed(text)` and `finish()` return ReasoningDelta / TextDelta events."""

    def __init__(self, config: ReasoningConfig | None = None):
        self.config = config or ReasoningConfig()
        self._state = "before"  # before | inside | after
        self._buf = ""
        self._lead = True  # drop whitespace at the start of the current part
        self._done = False

    def feed(self, text: str) -> list[TextDelta | ReasoningDelta]:
        if self._done:
            raise RuntimeError("feed() after finish()")
        self._buf += text
        return self._step(final=False)

    def finish(self) -> list[TextDelta | ReasoningDelta]:
        if self._done:
            return []
        self._done = True
        return self._step(final=True)

    def _step(self, final: bool) -> list[TextDelta | ReasoningDelta]:
        out: list[TextDelta | ReasoningDelta] = []
        start, end = self.config.start, self.config.end
        while True:
            buf = self._buf
            if self._state == "before":
                body = buf.lstrip()
                if body.startswith(start):
                    self._state, self._buf, self._lead = "inside", body[len(start) :], True
                    continue
                if not final and (not body or start.startswith(body)):
                    return out  # whitespace, or a start marker in the making
                # No start marker: the answer; or, when the template opened the block, the reasoning.
                self._state, self._lead = ("inside", True) if self.config.starts_inside else ("after", False)
                continue
            if self._state == "inside":
                i = buf.find(end)
                if i >= 0:
                    self._reasoning(out, buf[:i].rstrip())
                    self._state, self._buf, self._lead = "after", buf[i + len(end) :], True
                    continue
                keep = 0 if final else _held(buf, end)
                part = buf[: len(buf) - keep].rstrip()  # trailing whitespace may precede the end marker
                self._reasoning(out, part)
                self._buf = "" if final else buf[len(part) :]
                return out
            # after: the answer
            if self._lead:
                buf = buf.lstrip()
                self._lead = not buf
            if buf:
                out.append(TextDelta(text=buf))
            self._buf = ""
            return out

    def _reasoning(self, out: list, text: str) -> None:
        if self._lead:
            text = text.lstrip()
            self._lead = not text
        if text:
            out.append(ReasoningDelta(text=text))
