"""Streaming tool-call parsers, one per model family's call syntax, and the inverse (`render_calls`).

A model makes a tool call by writing text in the syntax its chat template taught it; the router has
to find those calls in the stream so that each protocol can answer with structured calls. One parser
object serves one generation: `feed(text)` returns the events that text decides, `finish()` the rest.

Shared rules, whatever the family:
- Text that cannot be part of a call goes out as TextDelta at once. Only a tail that may still grow
  into a call marker (`<tool_c`, `[TOOL`) is held, and whitespace at the end of a text run is held
  until the next visible character, so that the newlines a model writes around its calls do not
  become answer text. Whitespace directly before or after a call is dropped; an answer without calls
  comes out byte for byte.
- A call is emitted whole (ToolCallStart, one ToolCallArguments with the complete arguments as
  compact JSON, ToolCallEnd) once its text is complete and valid: events cannot be taken back, so
  a call is never announced before it is known to parse. Arguments are not streamed piecemeal.
- Text that looked like a call but is not one (bad JSON, no name, cut off by max_tokens) comes out
  as TextDelta, marker included: nothing the model wrote is lost.
- The merged result does not depend on how the text was cut into chunks.

Families (the registry's `tool_parser` field names one):
- "hermes" (Hermes 2 Pro / 3, Qwen2.5, Qwen3): `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  possibly several, with text before them.
- "llama3" (Llama 3.1 / 3.2 / 3.3 JSON calls): `{"name": ..., "parameters": {...}}` as the whole
  answer, optionally after `<|python_tag|>`, several separated by `;`.
- "mistral" (Mistral 7B v0.3, Mixtral, Nemo): `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`;
  the parser also reads the newer `[TOOL_CALLS]name[ARGS]{...}` form.
- "mistral_v11" (Mistral Small 3.2, Magistral, Devstral: tokenizer v11+): the same parser, but calls
  are rendered (and forced) as `[TOOL_CALLS]name[ARGS]{...}`.
- "deepseek" (DeepSeek V3, V3.1, R1): `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}
  <｜tool▁call▁end｜>...<｜tool▁calls▁end｜>` (V3 / R1 write `function<｜tool▁sep｜>name` and the arguments
  in a ```json fence); no library reads it, so it is read here.
- mlx-lm's families (`mlx_lm.tool_parsers`): qwen3_coder (Qwen3-Coder, Qwen3.5+ `<function=...>` XML),
  glm47 and laguna (GLM 4.5-4.7 `<arg_key>` / `<arg_value>`), gemma4, function_gemma, kimi_k2, kimi_k3,
  minimax_m2, longcat, minicpm5, muse_spark, pythonic (LFM2 `[f(a=1)]`). Orchard finds the region
  between the family's markers in the stream (`RegionParser`); mlx-lm's `parse_tool_call` turns the
  complete region into calls, with the request's tool schemas for the parsers that type values by them.
- "harmony" (gpt-oss): channels, not call markers; router.serving.output.harmony.

A region-marked call is complete when its end marker arrives: one cut off before it (max_tokens)
is text. mlx-lm's "json_tools" is the Hermes syntax, read by "hermes"; "mistral" is Orchard's own
parser (mlx-lm's reads the same two forms, but needs the whole output to find where a call ends)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from router.protocols.events import OutputEvent
from router.serving.output.harmony import HarmonyParser
from router.serving.output.region_parsers import DeepSeekParser, Glm47Parser, mlx_family
from router.serving.output.tool_parser_base import IdFactory, JsonEnd, MarkedParser, ToolParser, as_call, load_json


class UnknownToolParser(ValueError):
    def __init__(self, family: str):
        super().__init__(f"unknown tool_parser {family!r}; known: {', '.join(FAMILIES)}")
        self.family = family


class HermesParser(MarkedParser):
    family = "hermes"
    marker = "<tool_call>"
    close = "</tool_call>"

    def _call_text(self, final: bool) -> int | None:
        body = self._buf.lstrip()
        if body.startswith("{"):  # a call object: its end is found string-aware, so a "</tool_call>"
            end = self._json_end(body)  # inside an argument value does not close the block
            if end is None and not final:
                return None
            if end is not None:
                after = body[end:].lstrip()
                if after.startswith(self.close) and (call := as_call(load_json(body[:end]), ("arguments", "parameters"))):
                    self._call(*call)
                    self._buf = after[len(self.close) :]
                    return 0
                if not final and self.close.startswith(after):  # the closing tag may still come
                    self._json_end = JsonEnd()  # it stops at the object's end: scan again next time
                    return None
        j = self._buf.find(self.close)
        if j < 0:
            # A body without its closing tag (a stop string ate it, or EOS came first) still counts
            # if it is one complete call object; a truncated one stays text.
            if final and (call := as_call(load_json(self._buf), ("arguments", "parameters"))):
                self._call(*call)
                self._buf = ""
                return 0
            return None
        body = self._buf[:j]
        if call := as_call(load_json(body), ("arguments", "parameters")):
            self._call(*call)
        else:
            self._text(self.marker + body + self.close)
        self._buf = self._buf[j + len(self.close) :]
        return j


class MistralParser(MarkedParser):
    """Both Mistral forms: `[TOOL_CALLS] [{...}, {...}]` (v3 tokenizer: the array is all-or-nothing,
    since a later bad element could not take back earlier calls) and `[TOOL_CALLS]name[ARGS]{...}`
    (v11+, one call per marker; an optional `[CALL_ID]id` before `[ARGS]` is ignored)."""

    family = "mistral"
    marker = "[TOOL_CALLS]"
    args_marker = "[ARGS]"
    id_marker = "[CALL_ID]"
    name_re = re.compile(r"[A-Za-z0-9_.:\-]+")

    def _call_text(self, final: bool) -> int | None:
        buf = self._buf
        body = buf.lstrip()
        if not body:
            return None
        lead = len(buf) - len(body)
        if body[0] == "[":
            end = self._json_end(body)
            if end is None:
                return None
            calls = load_json(body[:end])
            parsed = [as_call(c, ("arguments", "parameters")) for c in calls] if isinstance(calls, list) else [None]
            if parsed and all(parsed):
                for name_args in filter(None, parsed):
                    self._call(*name_args)
            else:
                self._text(self.marker + buf[: lead + end])
            self._buf = buf[lead + end :]
            return lead + end
        j = buf.find(self.args_marker)
        head = (buf if j < 0 else buf[:j]).partition("[")[0].strip()
        if head and not self.name_re.fullmatch(head):  # not a function name: the marker was text
            self._text(self.marker)
            return 0
        if j < 0:
            return None
        name = buf[:j].partition(self.id_marker)[0].strip()
        rest = buf[j + len(self.args_marker) :]
        args_text = rest.lstrip()
        if not args_text:
            return None
        end = self._json_end(args_text) if args_text[0] == "{" else 0
        if end is None:
            return None
        used = len(buf) - len(args_text) + end
        call = as_call({"name": name, "arguments": load_json(args_text[:end])}, ("arguments",)) if end else None
        if call and self.name_re.fullmatch(name):
            self._call(*call)
        else:
            self._text(self.marker + buf[:used])
        self._buf = buf[used:]
        return used


class Llama3Parser(ToolParser):
    """Llama 3.x JSON calls have no marker of their own: the answer is a call when it starts with
    `{` (after whitespace and an optional `<|python_tag|>`) and the object is `{"name", "parameters"}`
    and nothing else. Any other answer is text from its first visible character on. Each call goes
    out as soon as its object closes; what follows it must be `;` and another call, or it is text."""

    family = "llama3"
    tag = "<|python_tag|>"

    def __init__(self, new_id: IdFactory | None = None, tools: list[dict] | None = None):
        super().__init__(new_id, tools)
        self._mode = "start"  # start | calls | text
        self._raw = ""  # consumed but not yet emitted (whitespace, the tag, a `;`), text if no call follows

    def _step(self, final: bool) -> None:
        while self._buf:
            if self._mode == "text":
                self._text(self._raw + self._buf)
                self._raw = self._buf = ""
                return
            body = self._buf.lstrip()
            if not body:
                return
            lead = self._buf[: len(self._buf) - len(body)]
            if self._mode == "start" and not self.calls and not self._raw:
                if body.startswith(self.tag):
                    self._raw, self._buf = lead + self.tag, body[len(self.tag) :]
                    continue
                if self.tag.startswith(body) and not final:
                    return
            elif self.calls and body[0] == ";" and not self._raw.strip():
                self._raw, self._buf = self._raw + lead + ";", body[1:]
                continue
            if body[0] != "{":
                self._mode = "text"
                continue
            end = self._json_end(body)
            if end is None:
                return
            call = as_call(load_json(body[:end]), ("parameters", "arguments"), strict=True)
            if call is None:
                self._mode = "text"
                continue
            self._call(*call)
            self._raw, self._buf, self._mode = "", body[end:], "calls"

    def finish(self) -> list[OutputEvent]:
        if not self._done:
            self._buf, self._raw = self._raw + self._buf, ""
            self._mode = "text"
        return super().finish()


# ---- rendering: the text a model of each family would have written ----------------------------------


def _dumps(value: Any) -> str:
    """JSON as the chat templates write it (Jinja's tojson: `, ` and `: ` separators, non-ASCII kept)."""
    return json.dumps(value, ensure_ascii=False)


@dataclass(frozen=True)
class CallSyntax:
    """A family's call text, piece by piece, shared by `render_calls` and the forced-call grammar so
    that what the grammar admits is exactly what the parser reads back:
    prefix + sep.join(open(name) + <arguments JSON> + close) + suffix."""

    prefix: str
    open: Callable[[str], str]
    close: str
    sep: str
    suffix: str


SYNTAX: dict[str, CallSyntax] = {
    "hermes": CallSyntax("", lambda n: '<tool_call>\n{"name": ' + _dumps(n) + ', "arguments": ', "}\n</tool_call>", "\n", ""),
    "llama3": CallSyntax("", lambda n: '{"name": ' + _dumps(n) + ', "parameters": ', "}", "; ", ""),
    "mistral": CallSyntax("[TOOL_CALLS] [", lambda n: '{"name": ' + _dumps(n) + ', "arguments": ', "}", ", ", "]"),
    "mistral_v11": CallSyntax("", lambda n: "[TOOL_CALLS]" + n + "[ARGS]", "", "", ""),
}

PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesParser,
    "llama3": Llama3Parser,
    "mistral": MistralParser,
    "mistral_v11": MistralParser,
    "deepseek": DeepSeekParser,
    "qwen3_coder": mlx_family("qwen3_coder", "qwen3_coder"),
    "glm47": mlx_family("glm47", "glm47", Glm47Parser),
    "laguna": mlx_family("laguna", "laguna", Glm47Parser),
    "gemma4": mlx_family("gemma4", "gemma4"),
    "function_gemma": mlx_family("function_gemma", "function_gemma"),
    "kimi_k2": mlx_family("kimi_k2", "kimi_k2"),
    "kimi_k3": mlx_family("kimi_k3", "kimi_k3"),
    "minimax_m2": mlx_family("minimax_m2", "minimax_m2"),
    "longcat": mlx_family("longcat", "longcat"),
    "minicpm5": mlx_family("minicpm5", "minicpm5"),
    "muse_spark": mlx_family("muse_spark", "muse_spark"),
    "pythonic": mlx_family("pythonic", "pythonic"),
}
ALIASES = {"json_tools": "hermes"}  # mlx-lm's names for syntaxes an Orchard parser reads
# Every family a registry entry may name: the parsers above and harmony (router.serving.output.harmony:
# channels, not call markers, so it has no call syntax to render).
FAMILIES: tuple[str, ...] = tuple(sorted([*PARSERS, "harmony"]))


def parser_class(family: str) -> type[ToolParser]:
    family = ALIASES.get(family, family)
    if family == "harmony":
        return HarmonyParser
    if family not in PARSERS:
        raise UnknownToolParser(family)
    return PARSERS[family]


def get_parser(family: str, new_id: IdFactory | None = None, tools: list[dict] | None = None) -> ToolParser:
    """A fresh parser for one generation; `tools` are the request's tools (OpenAI shape)."""
    return parser_class(family)(new_id, tools)


def _arguments(arguments: Mapping | str | None) -> dict:
    if arguments is None:
        return {}
    if isinstance(arguments, str):  # OpenAI history carries arguments as a JSON string
        arguments = load_json(arguments) if arguments.strip() else {}
        if not isinstance(arguments, dict):
            raise ValueError("tool call arguments must be a JSON object")
    return dict(arguments)


def render_calls(family: str, calls: Iterable[tuple[str, Mapping | str | None]]) -> str:
    """The text a model of `family` writes for these calls, in one turn: what the parser reads back,
    and what a past assistant turn looks like when put back into a prompt."""
    if family not in SYNTAX:
        raise UnknownToolParser(family)
    s = SYNTAX[family]
    body = s.sep.join(s.open(name) + _dumps(_arguments(args)) + s.close for name, args in calls)
    return s.prefix + body + s.suffix


def render_call(family: str, name: str, arguments: Mapping | str | None) -> str:
    return render_calls(family, [(name, arguments)])
