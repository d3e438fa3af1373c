"""OpenAI's Responses API for Orchard: POST /v1/responses, stored and continued.

A request is validated once, by the Responses models (errors name its fields), then built into the
typed OpenAI chat request (`to_chat_request`, router.protocols.openai.build), so it reaches every
chat model through the chat path's template and generation; the generation's
output events (router.protocols.events) are encoded back as a Response object (`response_object`) or
the Responses SSE stream (`ResponseStreamEncoder`). Pure (pydantic + stdlib).

Stateful as OpenAI's: a response is stored unless `store` is false (`ResponseStore`, over a
key-value store the app shares between its ingress replicas, bounded by a TTL and size caps, each
record read only by the key that made it), and `previous_response_id` continues its conversation
(`state.continued`: earlier inputs and outputs, reasoning items and function calls included, then
the new input; instructions are not carried over). What needs state Orchard does not keep
(`conversation`, `item_reference` items, `background`, stored `prompt` templates) is a 400 naming
the field.

requests <- translate <- encoder; store <- state; every public name is re-exported here."""

from router.protocols.responses.encoder import ResponseStreamEncoder, finish_error, new_response_id, response_object
from router.protocols.responses.requests import (
    CUSTOM_PARAMETERS,
    ContentPart,
    FunctionTool,
    InputItem,
    ReasoningConfig,
    ResponsesRequest,
    TextConfig,
    TextFormat,
    Tool,
    parse_responses_request,
)
from router.protocols.responses.state import continued, conversation, item_page, stored_item
from router.protocols.responses.store import KV, ResponseStore, ResponseTooLarge, StoredResponse, StoreSettings
from router.protocols.responses.translate import UNBOUNDED_OUTPUT_TOKENS, chat_messages, to_chat_request

__all__ = [
    "CUSTOM_PARAMETERS",
    "UNBOUNDED_OUTPUT_TOKENS",
    "ContentPart",
    "FunctionTool",
    "InputItem",
    "KV",
    "ReasoningConfig",
    "ResponseStore",
    "ResponseStreamEncoder",
    "ResponseTooLarge",
    "ResponsesRequest",
    "StoreSettings",
    "StoredResponse",
    "TextConfig",
    "TextFormat",
    "Tool",
    "chat_messages",
    "continued",
    "conversation",
    "finish_error",
    "item_page",
    "new_response_id",
    "parse_responses_request",
    "response_object",
    "stored_item",
    "to_chat_request",
]
