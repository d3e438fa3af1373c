"""OpenAI's Responses API for Orchard: POST /v1/responses, stateless.

A request is validated once, by the Responses models (errors name its fields), then built into the
typed OpenAI chat request (`to_chat_request`, router.protocols.openai.build), so it reaches every
chat model through the chat path's template and generation; the generation's
output events (router.protocols.events) are encoded back as a Response object (`response_object`) or
the Responses SSE stream (`ResponseStreamEncoder`). Pure (pydantic + stdlib).

Stateless: Orchard keeps no responses. `store` (true by default in the SDK) is accepted and
ignored, and the Response says `"store": false`; what needs a stored response or conversation
(`previous_response_id`, `conversation`, `item_reference` items, `background`, stored `prompt`
templates) is a 400 naming the field, since ignoring it would silently drop the earlier context.
Clients send the whole conversation in `input`, as they do with store=false.

requests <- translate <- encoder; every public name is re-exported here."""

from router.protocols.responses.encoder import ResponseStreamEncoder, finish_error, new_response_id, response_object
from router.protocols.responses.requests import (
    ContentPart,
    FunctionTool,
    InputItem,
    ReasoningConfig,
    ResponsesRequest,
    TextConfig,
    TextFormat,
    parse_responses_request,
)
from router.protocols.responses.translate import chat_messages, to_chat_request

__all__ = [
    "ContentPart",
    "FunctionTool",
    "InputItem",
    "ReasoningConfig",
    "ResponseStreamEncoder",
    "ResponsesRequest",
    "TextConfig",
    "TextFormat",
    "chat_messages",
    "finish_error",
    "new_response_id",
    "parse_responses_request",
    "response_object",
    "to_chat_request",
]
