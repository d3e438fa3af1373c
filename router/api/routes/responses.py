"""OpenAI Responses, stateless (router/protocols/responses/)."""

from fastapi import APIRouter, Depends

from router.api.auth import principal
from router.api.generate import generate
from router.api.ingress import Ingress, current
from router.api.keys import Principal
from router.protocols import responses as resp
from router.serving.renderers import ResponsesRenderer

router = APIRouter(tags=["openai"])


@router.post("/v1/responses")
async def responses(body: resp.ResponsesRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    chat = resp.to_chat_request(body)
    return await generate(ingress, who, chat, lambda parser: ResponsesRenderer(body, parser), stream=bool(body.stream))  # type: ignore[arg-type]  # a chat request always gets a parser
