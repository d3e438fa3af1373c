"""OpenAI chat and legacy completions."""

from fastapi import APIRouter, Depends

from router.api.auth import principal
from router.api.generate import generate
from router.api.ingress import Ingress, current
from router.api.keys import Principal
from router.protocols import openai as oai
from router.serving.renderers import OpenAIRenderer

router = APIRouter(tags=["openai"])


@router.post("/v1/chat/completions")
async def chat_completions(body: oai.ChatCompletionRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    return await generate(ingress, who, body, lambda parser: OpenAIRenderer(body, parser), stream=bool(body.stream))


@router.post("/v1/completions")
async def completions(body: oai.CompletionRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    return await generate(ingress, who, body, lambda _: OpenAIRenderer(body, None), stream=bool(body.stream))
