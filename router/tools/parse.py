"""`python -m router.tools parse`: what Orchard's output parser makes of a model's output.

When a client says "the tool call came back as text", the operator pastes the model's raw output
(the text the engine generated, special tokens included) into this command, with the family
(`--family F`) or the model (`--model M`: a model folder, or a name served by ray-config.yaml, whose
family and think blocks are found as serving finds them: the registry entry, else the chat template), and sees
the calls, the reasoning and the remaining text as JSON, parsed by the same chain the ingress runs.
`markers` lists the family's call markers that ended up in the text: a call that did not parse."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from deployments.tool_family import folder_template, infer_folder_family, infer_reasoning
from router.protocols.events import Finish, ReasoningDelta, TextDelta, ToolCallArguments, ToolCallStart
from router.serving.output.parsing import OutputConfig, OutputParser
from router.serving.output.reasoning import ReasoningConfig
from router.serving.output.tool_parsers import FAMILIES, PARSERS, UnknownToolParser

DEFAULT_FAMILY = "hermes"  # what serving falls back to (router/residency/registry.py, tool_family)


class ParseError(Exception):
    """A bad argument: printed as one line, exit status 2."""


def served_model(name: str, config: Path) -> tuple[str | None, Any, str]:
    """(family, reasoning, where it came from) of a model `config` (ray-config.yaml) serves, found as
    the app builder finds it (router/api/builder.py: `models:`, else the prepared set's manifest)."""
    import yaml

    from router.residency.registry import from_config, from_manifest

    if not config.is_file():
        raise ParseError(f"no model folder {name!r}, and no serve config at {config} to look the name up in")
    apps = yaml.safe_load(config.read_text()).get("applications") or [{}]
    args = apps[0].get("args") or {}
    models_dir = (config.parent / args.get("models_dir", "models")).resolve()
    models = args["models"] if args.get("models") is not None else from_manifest(models_dir, args.get("overrides"))
    _, entries = from_config(models, models_dir)
    if name not in entries:
        raise ParseError(f"model {name!r} is not served by {config}; served: {', '.join(sorted(entries))}")
    entry = entries[name]
    return entry.tool_parser, entry.reasoning, f"registry entry {name} ({config})"


def resolve(family: str | None, model: str | None, config: Path) -> tuple[str | None, Any, str]:
    """(family, reasoning, where the family came from) for the command line's choice."""
    if family is not None:
        if family not in FAMILIES and family not in ("json_tools",):
            raise ParseError(str(UnknownToolParser(family)))
        return family, None, "--family"
    assert model is not None
    folder = Path(model)
    if folder.is_dir():  # as the registry reads a folder (router/residency/registry.py)
        found = infer_folder_family(folder)
        reasoning = infer_reasoning(folder_template(folder))
        return (found or DEFAULT_FAMILY), reasoning, (f"chat template of {folder}" if found else f"{folder} names no family: serving's default")
    return served_model(model, config)


def parse_output(
    text: str, family: str | None, *, reasoning: Any = None, tools: list[dict] | None = None, tools_enabled: bool = True
) -> dict[str, Any]:
    """The parser chain's reading of `text` as one whole output that ended naturally."""
    parser = OutputParser(OutputConfig(tool_parser=family, reasoning=reasoning), tools=tools_enabled, tool_specs=tools)
    events = parser.feed({"text": text, "finish_reason": "stop"})
    calls: list[dict[str, Any]] = []
    answer, thought = [], []
    finish = None
    for e in events:
        if isinstance(e, TextDelta):
            answer.append(e.text)
        elif isinstance(e, ReasoningDelta):
            thought.append(e.text)
        elif isinstance(e, ToolCallStart):
            calls.append({"name": e.name, "arguments": None})
        elif isinstance(e, ToolCallArguments):
            calls[-1]["arguments"] = json.loads(e.arguments)
        elif isinstance(e, Finish):
            finish = e.reason
    remaining = "".join(answer)
    cls = PARSERS.get(family or "")
    known = ("<|channel|>", "<|message|>") if family == "harmony" else (getattr(cls, "marker", ""), getattr(cls, "close", ""))
    markers = [m for m in known if m and m in remaining]
    return {"family": family, "calls": calls, "reasoning": "".join(thought), "text": remaining, "finish_reason": finish, "markers": markers}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m router.tools parse", description=__doc__.splitlines()[0])
    which = ap.add_mutually_exclusive_group(required=True)
    which.add_argument("--family", help=f"the tool-call family: {', '.join(FAMILIES)}")
    which.add_argument("--model", help="a model folder (its chat template names the family) or a model name ray-config.yaml serves")
    ap.add_argument("--config", default="ray-config.yaml", help="the serve config a model name is looked up in (default: ray-config.yaml)")
    ap.add_argument("--tools", help="a JSON file with the request's tools (OpenAI shape): some families type arguments by them")
    ap.add_argument("--no-tools", action="store_true", help="parse as for a request without tools (calls stay text)")
    ap.add_argument("--reasoning", action="store_true", help="split <think>...</think> reasoning (the registry's reasoning: true)")
    ap.add_argument("--starts-inside", action="store_true", help="the template opened the reasoning block in the prompt")
    ap.add_argument("file", nargs="?", help="the model output (default: stdin)")
    args = ap.parse_args(argv)
    try:
        family, reasoning, source = resolve(args.family, args.model, Path(args.config))
        if args.reasoning or args.starts_inside:
            reasoning = ReasoningConfig(starts_inside=args.starts_inside)
        tools = None
        if args.tools:
            try:
                tools = json.loads(Path(args.tools).read_text())
            except (OSError, ValueError) as e:
                raise ParseError(f"--tools {args.tools}: {e}") from None
            if not isinstance(tools, list):
                raise ParseError("--tools must hold a JSON list of tools")
        text = Path(args.file).read_text() if args.file else sys.stdin.read()
        result = parse_output(text, family, reasoning=reasoning, tools=tools, tools_enabled=not args.no_tools)
    except (ParseError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result["family_from"] = source
    json.dump(result, sys.stdout, ensure_ascii=False, indent=2)
    sys.stdout.write("\n")
    return 0
