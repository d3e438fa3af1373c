"""Anthropic's Messages API for Orchard: POST /v1/messages and /v1/messages/count_tokens.

A request is validated once, by the Messages models (errors name Anthropic's fields), then built into
the typed OpenAI chat request (`to_chat_request`, router.protocols.openai.build), so Anthropic clients
reach every chat model through the same template and generation path as OpenAI clients; the output events of that generation (router.protocols.events) are encoded back into
Anthropic's message object (`message_response`) or its SSE stream (`MessageStreamEncoder`). Pure
(pydantic + stdlib): no Ray, no MLX, no web framework.

errors <- requests <- translate <- encoder; every public name is re-exported here."""

from router.protocols.anthropic.encoder import (
    MessageStreamEncoder,
    count_tokens_response,
    finish_error,
    message_response,
    new_message_id,
    stop_reason,
    tool_input,
)
from router.protocols.anthropic.errors import AnthropicErrorType, error_body, error_type, protocol_error_body, validation_error
from router.protocols.anthropic.requests import (
    ContentBlock,
    CountTokensRequest,
    ImageSource,
    Message,
    MessagesRequest,
    Metadata,
    OutputConfig,
    OutputFormat,
    Thinking,
    Tool,
    ToolChoice,
    parse_count_tokens_request,
    parse_messages_request,
)
from router.protocols.anthropic.translate import chat_messages, to_chat_request

__all__ = [
    "AnthropicErrorType",
    "ContentBlock",
    "CountTokensRequest",
    "ImageSource",
    "Message",
    "MessageStreamEncoder",
    "MessagesRequest",
    "Metadata",
    "OutputConfig",
    "OutputFormat",
    "Thinking",
    "Tool",
    "ToolChoice",
    "chat_messages",
    "count_tokens_response",
    "error_body",
    "error_type",
    "finish_error",
    "message_response",
    "new_message_id",
    "parse_count_tokens_request",
    "parse_messages_request",
    "protocol_error_body",
    "stop_reason",
    "to_chat_request",
    "tool_input",
    "validation_error",
]
