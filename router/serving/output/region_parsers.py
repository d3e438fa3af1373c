"""Region-marked tool-call families: the call text between two markers, buffered until the end marker
and read whole (`RegionParser`); mlx-lm's families, read by its own `parse_tool_call` (`MlxRegionParser`,
`mlx_family`), and DeepSeek's, read here."""

from __future__ import annotations

import importlib
import importlib.util
import re
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, ClassVar

from router.serving.output.tool_parser_base import IdFactory, MarkedParser, load_json

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
            args = load_json(args) if args.strip() else {}
        if not isinstance(name, str) or not _NAME.fullmatch(name.strip()) or not isinstance(args, dict):
            return None
        calls.append((name.strip(), args))
    return calls or None


class RegionParser(MarkedParser):
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
            return None  # undecided; at the end, MarkedParser makes the marker and the rest text
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


def mlx_family(family: str, module: str, base: type[MlxRegionParser] = MlxRegionParser) -> type[MlxRegionParser]:
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
            args = load_json(args_text) if args_text else {}
            if not _NAME.fullmatch(name) or not isinstance(args, dict):
                return None
            calls.append((name, args))
        return calls or None
