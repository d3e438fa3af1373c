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

import importlib
import importlib.util
import json
import re
import secrets
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from router.protocols.events import OutputEvent, TextDelta, ToolCallArguments, ToolCallEnd, ToolCallStart

IdFactory = Callable[[], str]


def new_call_id() -> str:
    """OpenAI's shape of call id: "call_" and 24 hex characters."""
    return "call_" + secrets.token_hex(12)


class UnknownToolParser(ValueError):
    def __init__(self, family: str):
        super().__init__(f"unknown tool_parser {family!r}; known: {', '.join(FAMILIES)}")
        self.family = family


# ---- shared machinery -----------------------------------------------------------------------------


def _held(buf: str, marker: str) -> int:
    """Length of the longest tail of `buf` that is a proper prefix of `marker` (it may grow into it)."""
    for n in range(min(len(buf), len(marker) - 1), 0, -1):
        if buf.endswith(marker[:n]):
            return n
    return 0


class _JsonEnd:
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


def _load(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


def _as_call(obj: Any, arg_keys: tuple[str, ...], *, strict: bool = False) -> tuple[str, dict] | None:
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
        args = _load(args) if args.strip() else {}
    if not isinstance(args, dict):
        return None
    return obj["name"].strip(), args


def _dump(args: Mapping) -> str:
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
        self._json_end = _JsonEnd()  # reset whenever text is consumed (by _text or _call)

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
        self._json_end = _JsonEnd()
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
        self._json_end = _JsonEnd()
        self._ws = ""
        i = self.calls
        self._out += [
            ToolCallStart(index=i, id=self._new_id(), name=name),
            ToolCallArguments(index=i, arguments=_dump(args)),
            ToolCallEnd(index=i),
        ]
        self.calls += 1
        self._after_call = True


class _MarkedParser(ToolParser):
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
                    keep = 0 if final else _held(self._buf, self.marker)
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


class HermesParser(_MarkedParser):
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
                if after.startswith(self.close) and (call := _as_call(_load(body[:end]), ("arguments", "parameters"))):
                    self._call(*call)
                    self._buf = after[len(self.close) :]
                    return 0
                if not final and self.close.startswith(after):  # the closing tag may still come
                    self._json_end = _JsonEnd()  # it stops at the object's end: scan again next time
                    return None
        j = self._buf.find(self.close)
        if j < 0:
            # A body without its closing tag (a stop string ate it, or EOS came first) still counts
            # if it is one complete call object; a truncated one stays text.
            if final and (call := _as_call(_load(self._buf), ("arguments", "parameters"))):
                self._call(*call)
                self._buf = ""
                return 0
            return None
        body = self._buf[:j]
        if call := _as_call(_load(body), ("arguments", "parameters")):
            self._call(*call)
        else:
            self._text(self.marker + body + self.close)
        self._buf = self._buf[j + len(self.close) :]
        return j


class MistralParser(_MarkedParser):
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
            calls = _load(body[:end])
            parsed = [_as_call(c, ("arguments", "parameters")) for c in calls] if isinstance(calls, list) else [None]
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
        call = _as_call({"name": name, "arguments": _load(args_text[:end])}, ("arguments",)) if end else None
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
            call = _as_call(_load(body[:end]), ("parameters", "arguments"), strict=True)
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


# ---- region-marked families: the call text between two markers, read whole ------------------------

_NAME = re.compile(r"[A-Za-z0-9_.:\-]+")

# (name, arguments). A model's own call id (Kimi's "functions.f:0") is not kept: it restarts each
# turn, and clients key results by id, so every call gets a fresh one.
ParsedCall = tuple[str, dict]


def _checked(found: Any) -> list[ParsedCall] | None:
    """A parse function's answer (a call dict, or a list of them) as calls, or None when any of
    them lacks a usable name or object arguments (the region is then text)."""
    items = found if isinstance(found, list) else [found]
    calls: list[ParsedCall] = []
    for item in items:
        if not isinstance(item, dict):
            return None
        name, args = item.get("name"), item.get("arguments", {})
        if isinstance(args, str):
            args = _load(args) if args.strip() else {}
        if not isinstance(name, str) or not _NAME.fullmatch(name.strip()) or not isinstance(args, dict):
            return None
        calls.append((name.strip(), args))
    return calls or None


class RegionParser(_MarkedParser):
    """A family whose calls sit between `marker` and `close`: text until the marker (held only while
    a tail may still become it), then the region is buffered until `close` arrives and read whole by
    `parse_region`. A region that does not read as calls, or that the output ends inside, is text,
    markers included. Several calls may share one region (Kimi's section, LFM2's list)."""

    close = ""

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        raise NotImplementedError

    def _call_text(self, final: bool) -> int | None:
        j = self._buf.find(self.close)
        if j < 0:
            return None  # undecided; at the end, _MarkedParser makes the marker and the rest text
        region = self._buf[:j]
        calls = self.parse_region(region)
        if calls:
            for name, args in calls:
                self._call(name, args)
        else:
            self._text(self.marker + region + self.close)
        self._buf = self._buf[j + len(self.close) :]
        return j


_MLX_PARSERS = "_orchard_mlx_lm_tool_parsers"


def mlx_parser_module(module: str) -> ModuleType:
    """mlx-lm's parser module `mlx_lm.tool_parsers.<module>`. Where mlx_lm is not imported yet (the
    ingress), its tool_parsers folder is loaded as a package of its own: importing `mlx_lm` itself
    would pull in MLX and transformers (seconds), and these modules need only `regex` and each other."""
    if "mlx_lm" in sys.modules:
        return importlib.import_module(f"mlx_lm.tool_parsers.{module}")
    if _MLX_PARSERS not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("mlx-lm is not installed: its tool-call parsers come with the engines extra")
        package = ModuleType(_MLX_PARSERS)
        package.__path__ = [str(Path(next(iter(spec.submodule_search_locations))) / "tool_parsers")]
        sys.modules[_MLX_PARSERS] = package
    return importlib.import_module(f"{_MLX_PARSERS}.{module}")


class MlxRegionParser(RegionParser):
    """A region read by mlx-lm's parser for the family (`mlx_lm.tool_parsers.<module>`, its markers
    and its `parse_tool_call(text, tools)`, which raises, or answers a non-call, for text that is no
    call)."""

    module = ""
    lib: ClassVar[ModuleType]

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        try:
            found = self.lib.parse_tool_call(region.strip(), self._tools)
        except Exception:  # the library's word that this is no call (ValueError, JSON, AST, regex misses)
            return None
        return _checked(found)


class Glm47Parser(MlxRegionParser):
    """mlx-lm's GLM reader falls back to a call named "unknown" (arguments {"raw": text}) for any
    text in the tags: that is text here, not a call."""

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        calls = super().parse_region(region)
        if calls and any(name == "unknown" and set(args) == {"raw"} for name, args in calls):
            return None
        return calls


class MissingLibrary(MlxRegionParser):
    """An mlx-lm family where mlx-lm is not installed (a router without the engines extra): the
    family is known, and asking for its parser says what is missing."""

    def __init__(self, new_id: IdFactory | None = None, tools: list[dict] | None = None):
        raise RuntimeError(f"the {self.family} tool-call family is read by mlx-lm's parser: install the engines extra (mlx-lm)")


def _mlx_family(family: str, module: str, base: type[MlxRegionParser] = MlxRegionParser) -> type[MlxRegionParser]:
    """The parser class of an mlx-lm family, its markers read from the library module itself."""
    try:
        lib = mlx_parser_module(module)
    except (ImportError, RuntimeError):
        return type(f"Missing{module.title().replace('_', '')}Parser", (MissingLibrary,), {"family": family, "module": module})
    start, end = lib.tool_call_start, lib.tool_call_end
    if not start or not end:
        raise ValueError(f"mlx-lm family {module} has no end marker: it needs a parser of its own")
    attrs = {"family": family, "module": module, "lib": lib, "marker": start, "close": end}
    return type(f"{module.title().replace('_', '')}Parser", (base,), attrs)


class DeepSeekParser(RegionParser):
    """DeepSeek V3 / V3.1 / R1 calls: a section of `<｜tool▁call▁begin｜>...<｜tool▁call▁end｜>`
    blocks, each `name<｜tool▁sep｜>{json}` (V3.1) or `function<｜tool▁sep｜>name` and a ```json fence
    (V3, R1). Only whitespace may lie between the blocks."""

    family = "deepseek"
    marker = "<｜tool▁calls▁begin｜>"
    close = "<｜tool▁calls▁end｜>"
    call_open, call_close, sep = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    _block = re.compile(re.escape(call_open) + "(.*?)" + re.escape(call_close), re.DOTALL)
    _fence = re.compile(r"\A(\S+)\s*```(?:json)?\s*(.*?)\s*```\s*\Z", re.DOTALL)

    def parse_region(self, region: str) -> list[ParsedCall] | None:
        if self._block.sub("", region).strip():
            return None
        calls: list[ParsedCall] = []
        for body in self._block.findall(region):
            head, sep, rest = body.partition(self.sep)
            if not sep:
                return None
            fenced = self._fence.match(rest.strip()) if head.strip() == "function" else None
            name, args_text = (fenced.group(1), fenced.group(2)) if fenced else (head.strip(), rest.strip())
            args = _load(args_text) if args_text else {}
            if not _NAME.fullmatch(name) or not isinstance(args, dict):
                return None
            calls.append((name, args))
        return calls or None


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
    "qwen3_coder": _mlx_family("qwen3_coder", "qwen3_coder"),
    "glm47": _mlx_family("glm47", "glm47", Glm47Parser),
    "laguna": _mlx_family("laguna", "laguna", Glm47Parser),
    "gemma4": _mlx_family("gemma4", "gemma4"),
    "function_gemma": _mlx_family("function_gemma", "function_gemma"),
    "kimi_k2": _mlx_family("kimi_k2", "kimi_k2"),
    "kimi_k3": _mlx_family("kimi_k3", "kimi_k3"),
    "minimax_m2": _mlx_family("minimax_m2", "minimax_m2"),
    "longcat": _mlx_family("longcat", "longcat"),
    "minicpm5": _mlx_family("minicpm5", "minicpm5"),
    "muse_spark": _mlx_family("muse_spark", "muse_spark"),
    "pythonic": _mlx_family("pythonic", "pythonic"),
}
ALIASES = {"json_tools": "hermes"}  # mlx-lm's names for syntaxes an Orchard parser reads
# Every family a registry entry may name: the parsers above and harmony (router.serving.output.harmony,
# which builds on this module's ToolParser, so it is imported when asked for).
FAMILIES: tuple[str, ...] = tuple(sorted([*PARSERS, "harmony"]))


def parser_class(family: str) -> type[ToolParser]:
    family = ALIASES.get(family, family)
    if family == "harmony":
        from router.serving.output.harmony import HarmonyParser

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
        arguments = _load(arguments) if arguments.strip() else {}
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
