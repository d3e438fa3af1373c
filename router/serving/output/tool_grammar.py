"""Grammars that force a tool call (tool_choice "required" or a named function), for llguidance.

With tool_choice "auto" the model decides and the parser finds its calls afterwards; "required" or
a named function must hold whatever the model prefers, so the engine constrains decoding with the
grammar built here. It admits exactly the text `render_calls` writes for that family (same pieces,
router.serving.output.tool_parsers.SYNTAX), so every output parses back into calls: the name one of the allowed
tools, the arguments valid against that tool's JSON schema (`%json`, llguidance's JSON-schema
compiler).

Decisions:
- No free whitespace anywhere: the separators are fixed to the ones the chat templates write
  (`, ` and `: `, Jinja's tojson), so the constrained text is what the model saw in training, and a
  model that "wants" whitespace (a random-weight one, say) cannot loop on it.
- Properties come in the schema's order (llguidance's rule), which is also how models write them.
- A reasoning model may think first: with `reasoning` given, the grammar admits a free reasoning
  block before the calls (required when the template opened the block in the prompt, since the end
  marker must come before any answer), ended by the end marker and a blank line.
- The output is the Lark text; `grammar_error` checks it with llguidance (imported lazily: the
  router needs no llguidance to build a grammar, only to check one)."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping

from router.serving.output.reasoning import ReasoningConfig
from router.serving.output.tool_parsers import FAMILIES, SYNTAX, MistralParser, UnknownToolParser

JSON_FORMAT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def _lit(text: str) -> str:
    """A Lark string literal (JSON string escapes are Lark's)."""
    return json.dumps(text, ensure_ascii=False)


def tool_function(tool: dict) -> tuple[str, dict]:
    """(name, parameters schema) of a tool in OpenAI's shape ({"type": "function", "function": {...}}),
    the flat shape ({"name", "parameters"}) or Anthropic's ({"name", "input_schema"})."""
    fn = tool.get("function", tool) if tool.get("type", "function") == "function" else tool
    name = fn.get("name")
    if not isinstance(name, str) or not MistralParser.name_re.fullmatch(name):
        raise ValueError(f"tool name {name!r} must be letters, digits, '_', '-', '.' or ':'")
    schema = fn.get("parameters", fn.get("input_schema"))
    if schema is None:
        schema = {"type": "object", "properties": {}}
    if not isinstance(schema, dict):
        raise ValueError(f"tool {name}: parameters must be a JSON schema object")
    if schema.get("type", "object") != "object":
        raise ValueError(f"tool {name}: parameters must describe an object, not {schema['type']!r}")
    return name, {"type": "object", **schema}  # arguments are an object even when the schema forgets to say so


def forced_call_grammar(
    family: str,
    tools: list[dict],
    choice: str = "required",
    parallel: bool = False,
    reasoning: ReasoningConfig | None = None,
    special_tokens: Mapping[str, int] | None = None,
) -> str:
    """A Lark grammar admitting one call (several when `parallel`) in `family`'s syntax, to any of
    `tools` when `choice` is "required", else to the function named `choice`.

    `special_tokens` maps markers that are special tokens in the model's tokenizer to their ids
    (Mistral's `{"[TOOL_CALLS]": 5}`): llguidance never lets a special token stand for literal text,
    so without the map the model must spell the marker out of ordinary tokens; with it the grammar
    admits the marker's own token too. Either way the detokenized text is the same."""
    if family not in SYNTAX:
        if family in FAMILIES:  # parsed, but no grammar writes its syntax yet (docs/tool-calls.md)
            raise ValueError(
                f"a forced call (tool_choice 'required' or a named function) is not available for the {family} family; forcible: {', '.join(sorted(SYNTAX))}"
            )
        raise UnknownToolParser(family)
    functions = dict(tool_function(t) for t in tools)
    if not functions:
        raise ValueError("a forced tool call needs at least one tool")
    if choice != "required":
        if choice not in functions:
            raise ValueError(f"tool_choice names {choice!r}, which is not among the tools")
        functions = {choice: functions[choice]}
    syntax = SYNTAX[family]
    special = dict(special_tokens or {})

    def lit(text: str) -> str:  # a literal, each special marker in it also admitted as its token
        parts = re.split("(" + "|".join(map(re.escape, special)) + ")", text) if special else [text]
        return _seq(*(f"({_lit(p)} | <[{int(special[p])}]>)" if p in special else _lit(p) for p in parts))

    calls = "call (" + lit(syntax.sep) + " call)*" if parallel and syntax.sep else "call+" if parallel else "call"
    lines = ["start: " + _seq(_think(reasoning, lit), lit(syntax.prefix), calls, lit(syntax.suffix))]
    lines.append("call: " + " | ".join(f"call_{i}" for i in range(len(functions))))
    for i, (name, schema) in enumerate(functions.items()):
        lines.append(f"call_{i}: " + _seq(lit(syntax.open(name)), f"args_{i}", lit(syntax.close)))
        lines.append(f"args_{i}: %json " + json.dumps({**schema, "x-guidance": JSON_FORMAT}, ensure_ascii=False))
    if reasoning and reasoning.end in special:  # a special token ends the free text where it comes
        lines.append(f"think: /(?s:.*)/ <[{int(special[reasoning.end])}]>")
    elif reasoning:  # lazy: the text ends at the first end marker
        end = re.escape(reasoning.end).replace("/", "\\/")
        lines.append(f"think[lazy]: /(?s:.*){end}/")
    return "\n".join(lines) + "\n"


def _seq(*parts: str) -> str:
    return " ".join(p for p in parts if p and p != '""')


def _think(reasoning: ReasoningConfig | None, lit: Callable[[str], str]) -> str:
    if reasoning is None:
        return ""
    if reasoning.starts_inside:
        return 'think "\\n\\n"'
    return f'({lit(reasoning.start)} think "\\n\\n")?'


def grammar_error(grammar: str) -> str | None:
    """llguidance's error for a Lark grammar (a tool schema it cannot compile, say), or None."""
    from llguidance import LLMatcher

    is_error, messages = LLMatcher.validate_grammar_with_warnings(LLMatcher.grammar_from_lark(grammar))
    return messages[0] if is_error else None
