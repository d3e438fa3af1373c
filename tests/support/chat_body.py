"""The chat-completions JSON of a chat request that an adapter (Anthropic, Responses) built, checked
on the way: validating that JSON as a client's chat request must give back the very same request.
The adapters build their chat request without validating it a second time
(router.protocols.openai.build), so this is what holds them to the chat request's rules; every
adapter test that looks at the translation goes through here."""

from collections.abc import Callable
from typing import Any

from router.protocols.openai import ChatCompletionRequest, ChatMessage, ProtocolError


def _message(m: ChatMessage) -> dict[str, Any]:
    out = m.model_dump(mode="json", exclude_none=True)
    parts = out.get("content")
    out["content"] = parts[0]["text"] if parts is not None and len(parts) == 1 and parts[0]["type"] == "text" else parts
    return out


def as_body(chat: ChatCompletionRequest) -> dict[str, Any]:
    body = chat.model_dump(mode="json", by_alias=True, exclude_unset=True, exclude_none=True)
    body["messages"] = [_message(m) for m in chat.messages]
    again = ChatCompletionRequest.model_validate(body)
    assert again == chat, f"the adapter built a chat request that validation would change:\n{again!r}\n!=\n{chat!r}"
    return body


def some_of(draw: Callable[[Any], Any], optional: dict[str, Any]) -> dict[str, Any]:
    """Each optional field of a generated request, drawn or left out (hypothesis's `draw`)."""
    from hypothesis import strategies as st

    return {key: draw(strategy) for key, strategy in optional.items() if draw(st.booleans())}


def translation_of(parse: Callable[[Any], Any], translate: Callable[[Any], ChatCompletionRequest], body: dict[str, Any]) -> dict[str, Any] | None:
    """The chat body an adapter builds for `body` (checked by as_body), or None when the adapter's own
    validation refuses it (under its own field names: the rejection tests say which)."""
    try:
        request = parse(body)
    except ProtocolError:
        return None
    return as_body(translate(request))
