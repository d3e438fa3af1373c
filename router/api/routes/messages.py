"""Anthropic Messages and count_tokens, translated to a chat request (router/protocols/anthropic/).
Errors under these paths are Anthropic's (router/api/errors.py)."""

from fastapi import APIRouter, Depends

from router.api.auth import principal
from router.api.generate import generate
from router.api.ingress import Ingress, current
from router.api.keys import Principal
from router.protocols import anthropic as anth
from router.serving.renderers import AnthropicRenderer

router = APIRouter(tags=["anthropic"])


@router.post("/v1/messages")
async def messages(body: anth.MessagesRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    chat = anth.to_chat_request(body)
    return await generate(ingress, who, chat, lambda parser: AnthropicRenderer(body, parser), stream=bool(body.stream))  # type: ignore[arg-type]  # a chat request always gets a parser


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: anth.CountTokensRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    """The prompt's tokens, by the model's own tokenizer and chat template, without a lease: nothing
    is loaded, placed or evicted for a count (router/serving/counting.py). A key's count is one
    request of its rpm and holds no tokens."""
    count = await ingress.count_tokens(who, anth.to_chat_request(body))
    return anth.count_tokens_response(count)
