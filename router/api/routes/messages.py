"""Anthropic Messages and count_tokens, translated to a chat request (router/protocols/anthropic/).
Errors under these paths are Anthropic's (router/api/errors.py)."""

from fastapi import APIRouter, Depends

from router.api.auth import principal
from router.api.generate import generate, prompt_estimate
from router.api.ingress import Ingress, current
from router.api.keys import Principal
from router.protocols import anthropic as anth
from router.serving.generation import call, prepare
from router.serving.renderers import AnthropicRenderer

router = APIRouter(tags=["anthropic"])


@router.post("/v1/messages")
async def messages(body: anth.MessagesRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    chat = anth.to_chat_request(body)
    return await generate(ingress, who, chat, lambda parser: AnthropicRenderer(body, parser), stream=bool(body.stream))  # type: ignore[arg-type]  # a chat request always gets a parser


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: anth.CountTokensRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    """The prompt's tokens, by the model's own tokenizer: counted against the key's tpm like a
    prompt (the estimate at admission, the count at the end), since it runs the model's tokenizer."""
    chat = anth.to_chat_request(body)
    async with ingress.hold(who, chat.model, prompt_estimate(chat)) as lease:
        request, _ = prepare(lease, chat, allow_remote_images=ingress.allow_remote_images)
        count = await call(lease, lambda actor: actor.count_tokens.remote(request))
        lease.release(count)
    return anth.count_tokens_response(count)
