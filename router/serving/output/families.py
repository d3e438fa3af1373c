"""The shape a tool-call family's chat template wants past calls in. Which family a model speaks
is read from its folder in deployments/tool_family.py (the registry asks there too); this module
shapes a request's history for that family.

Past turns: clients send a call's arguments as a JSON string (OpenAI) and tool results as "tool"
messages; most templates want the arguments as an object (they iterate it or `tojson` it, which
would quote a string twice), DeepSeek's concatenates them as a string, and Mistral's refuse call ids
that are not 9 letters or digits. `history_messages` puts a request's messages in the shape the
family's template renders correctly."""

from __future__ import annotations

import hashlib
import json
from typing import Any

# Families whose templates concatenate a call's arguments as a string; every other wants an object.
ARGUMENTS_AS_STRING = frozenset({"deepseek"})
# Families whose templates require 9-character alphanumeric call ids (Mistral's tokenizer rule).
NINE_CHAR_IDS = frozenset({"mistral", "mistral_v11"})
# Families whose templates write the call id where the model writes `functions.NAME:INDEX` (Kimi K2:
# the model reads its own calls in that form, and its parser finds the name there).
INDEXED_IDS = frozenset({"kimi_k2"})


def _nine(call_id: str) -> str:
    """A 9-character alphanumeric id for any call id, the same each time (Mistral's templates)."""
    if len(call_id) == 9 and call_id.isalnum():
        return call_id
    return hashlib.sha256(call_id.encode()).hexdigest()[:9]


def _arguments(arguments: Any, as_string: bool) -> Any:
    if as_string:
        return arguments if isinstance(arguments, str) else json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    if isinstance(arguments, str):
        try:
            loaded = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            return arguments  # not JSON: left as the client sent it
        return loaded if isinstance(loaded, dict) else arguments
    return {} if arguments is None else arguments


def history_messages(family: str | None, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` (OpenAI chat shape) as `family`'s chat template renders them: each past call's
    arguments an object (a string for DeepSeek); call ids 9 alphanumerics for Mistral, and
    `functions.NAME:INDEX` for Kimi K2 (numbered through the conversation), with the results'
    tool_call_id mapped the same way. Other fields are kept; the input is not changed."""
    if family is None:
        return messages
    as_string = family in ARGUMENTS_AS_STRING
    ids: dict[str, str] = {}  # the client's call id -> the one the template gets

    def new_id(old: str, name: Any) -> str:
        if family in NINE_CHAR_IDS:
            return _nine(old)
        if family in INDEXED_IDS:
            return f"functions.{name}:{len(ids)}"
        return old

    out = []
    for message in messages:
        calls = message.get("tool_calls")
        if calls:
            shaped = []
            for call in calls:
                call = dict(call)
                function = dict(call.get("function") or {})
                function["arguments"] = _arguments(function.get("arguments"), as_string)
                call["function"] = function
                old = call.get("id")
                if isinstance(old, str):
                    ids[old] = call["id"] = new_id(old, function.get("name"))
                shaped.append(call)
            message = {**message, "tool_calls": shaped}
        if message.get("role") == "tool" and message.get("tool_call_id") in ids:
            message = {**message, "tool_call_id": ids[message["tool_call_id"]]}
        out.append(message)
    return out
