"""Tool-aware chat prompts. A chat template that knows tools gets them (`tools=`) and the messages
as they are. Any other template gets a rendering it can take: the tools listed as JSON in a system
preamble with the Hermes convention for calling one (`<tool_call>{"name": ..., "arguments": {...}}
</tool_call>`, the syntax the router parses for such models), assistant tool calls written out in
that syntax, tool results as user turns wrapped in `<tool_response>...</tool_response>`, and None
content as "". Also what a client may pass to a chat template (`template_kwargs_error`). Pure
functions: no tokenizer, no MLX (the router imports this module to check requests)."""

import json
import math
import re
from typing import Any

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"
TOOL_RESPONSE_OPEN, TOOL_RESPONSE_CLOSE = "<tool_response>", "</tool_response>"

# Jinja blocks ({{ ... }}, {% ... %}) and the string literals inside them: a template knows tools
# when a block names the variable `tools` outside a literal ("You can use tools" does not count).
_JINJA_BLOCK = re.compile(r"\{\{.*?\}\}|\{%.*?%\}", re.DOTALL)
_STRING_LITERAL = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", re.DOTALL)
_TOOLS = re.compile(r"(?<![\w.])tools\b")


# The chat-template variables a client may set (`chat_template_kwargs`): the switches that open
# models' templates read (Qwen3 / SmolLM3 / GLM `enable_thinking`, DeepSeek V3.1 / Granite `thinking`,
# gpt-oss `reasoning_effort` and `model_identity`, Llama 3 `date_string` and `tools_in_user_message`).
# Nothing else reaches apply_chat_template through them: its other keyword arguments belong to the
# tokenizer (`chat_template`, `tokenize`, `padding`, `truncation`, `max_length`, `return_*`, ...) and
# `tools`, `documents`, `add_generation_prompt` are the engine's own. Values are JSON scalars (a
# string of at most TEMPLATE_STRING_MAX characters). docs/protocols.md lists them.
TEMPLATE_VARIABLES = frozenset({"enable_thinking", "thinking", "reasoning_effort", "model_identity", "date_string", "tools_in_user_message"})
TEMPLATE_STRING_MAX = 256


def template_kwargs_error(kwargs: Any) -> tuple[str | None, str] | None:
    """Why `kwargs` may not go to a chat template, as (the key at fault or None, the reason), or None
    when every key is a template variable (TEMPLATE_VARIABLES) with a JSON scalar value."""
    if not isinstance(kwargs, dict):
        return None, "chat_template_kwargs must be an object of template variables"
    for name, value in kwargs.items():
        if name not in TEMPLATE_VARIABLES:
            allowed = ", ".join(sorted(TEMPLATE_VARIABLES))
            return str(name), f"'{name}' is not a chat-template variable Orchard passes on (allowed: {allowed})"
        if isinstance(value, str):
            if len(value) > TEMPLATE_STRING_MAX:
                return name, f"'{name}' is longer than {TEMPLATE_STRING_MAX} characters"
        elif isinstance(value, float | int) and not isinstance(value, bool):
            if abs(value) > 2**53 or not math.isfinite(value):
                return name, f"'{name}' must be a finite number of at most 2**53"
        elif value is not None and not isinstance(value, bool):
            return name, f"'{name}' must be a string, number, boolean or null"
    return None


def _names_tools(template: str) -> bool:
    return any(_TOOLS.search(_STRING_LITERAL.sub("", block)) for block in _JINJA_BLOCK.findall(template))


def template_supports_tools(template: str | dict | list | None) -> bool:
    """Whether a chat template renders `tools`. Tokenizers may carry several named templates (a
    dict, or the list of {"name", "template"} of tokenizer_config.json): a "tool_use" one counts."""
    if not template:
        return False
    if isinstance(template, list):
        template = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
    if isinstance(template, dict):
        if template.get("tool_use"):
            return True
        return any(isinstance(t, str) and _names_tools(t) for t in template.values())
    return _names_tools(template)


def tools_preamble(tools: list[dict[str, Any]]) -> str:
    """The system text that offers the tools (one JSON line each) and says how to call one."""
    listed = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "You may call one or more functions to assist with the user query.\n\n"
        "You are provided with function signatures within <tools></tools> XML tags:\n"
        f"<tools>\n{listed}\n</tools>\n\n"
        "To call a function, answer with a JSON object with the function name and its arguments within "
        f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n"
        f'{TOOL_CALL_OPEN}{{"name": <function-name>, "arguments": <args-json-object>}}{TOOL_CALL_CLOSE}'
    )


def render_tool_call(call: dict[str, Any]) -> str:
    """One OpenAI tool call ({"id", "type": "function", "function": {"name", "arguments"}}, where
    arguments is a JSON string or already an object) as `<tool_call>{...}</tool_call>`."""
    function = call.get("function") or call
    arguments: Any = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass  # not JSON: kept as the string the client sent
    if arguments is None:
        arguments = {}
    body = json.dumps({"name": function.get("name"), "arguments": arguments}, ensure_ascii=False)
    return f"{TOOL_CALL_OPEN}{body}{TOOL_CALL_CLOSE}"


def text_of(content: Any) -> str:
    """Message content as text: None is "", a list of parts is its text parts joined."""
    if content is None:
        return ""
    if isinstance(content, list):
        return "".join(p.get("text") or "" for p in content if isinstance(p, dict) and p.get("type", "text") == "text")
    return str(content)


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Messages any plain template renders: {"role", "content": str} for the tool-related ones (the
    others as they are, content None becoming ""). Consecutive tool results share one user turn."""
    out: list[dict[str, Any]] = []
    if tools:
        preamble = tools_preamble(tools)
        if messages and messages[0].get("role") == "system":
            first = dict(messages[0], content=(text_of(messages[0].get("content")) + "\n\n" + preamble).lstrip())
            messages = [first, *messages[1:]]
        else:
            out.append({"role": "system", "content": preamble})
    tool_turn = -1  # index in `out` of the user turn gathering consecutive tool results
    for message in messages:
        role = message.get("role")
        if role == "tool":
            block = f"{TOOL_RESPONSE_OPEN}\n{text_of(message.get('content'))}\n{TOOL_RESPONSE_CLOSE}"
            if tool_turn == len(out) - 1 >= 0:
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block})
                tool_turn = len(out) - 1
            continue
        if role == "assistant" and message.get("tool_calls"):
            calls = "\n".join(render_tool_call(c) for c in message["tool_calls"])
            text = text_of(message.get("content"))
            out.append({"role": "assistant", "content": f"{text}\n{calls}" if text else calls})
            continue
        out.append(message if message.get("content") is not None else dict(message, content=""))
    return out


def chat_inputs(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template_knows_tools: bool
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(messages, extra apply_chat_template kwargs) for a request: as they are (with `tools=`) for
    a template that renders tools (see template_supports_tools), the fallback rendering otherwise."""
    if template_knows_tools:
        return messages, ({"tools": tools} if tools else {})
    return fallback_messages(messages, tools), {}
