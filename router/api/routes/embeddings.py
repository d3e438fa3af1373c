"""OpenAI embeddings and Cohere / Jina rerank. Both count against a key's tpm: the input's estimate
at admission, the tokens the model ran at the end."""

from fastapi import APIRouter, Depends

from router.api.auth import principal
from router.api.bodies import json_body
from router.api.ingress import Ingress, current
from router.api.keys import Principal
from router.protocols import openai as oai
from router.protocols.rerank_audio import RerankRequest, rerank_response
from router.serving.generation import call, require_kind
from router.serving.token_estimate import estimate_tokens

router = APIRouter(tags=["openai"])


@router.post("/v1/embeddings")
async def embeddings(body: oai.EmbeddingRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    async with ingress.hold(who, body.model, estimate_tokens(*body.texts())) as lease:
        require_kind(lease, ("embedding",), "an embedding model")
        result = await call(lease, lambda actor: actor.embed.remote(body.texts(), body.dimensions))
        lease.release(result.prompt_tokens)
    return json_body(oai.embedding_response(body.model, result.vectors, result.prompt_tokens, body.encoding_format))


@router.post("/v1/rerank")
@router.post("/rerank")
@router.post("/v2/rerank")
async def rerank(body: RerankRequest, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    """Cohere / Jina shape: query, documents (strings or {"text": ...}), top_n, return_documents."""
    documents = body.texts()
    async with ingress.hold(who, body.model, estimate_tokens(*documents) + len(documents) * estimate_tokens(body.query)) as lease:
        require_kind(lease, ("rerank",), "a rerank model")
        result = await call(lease, lambda actor: actor.rerank.remote(body.query, documents, body.top_n))
        lease.release(result.usage.prompt_tokens)  # every (query, document) pair the model ran
    return json_body(rerank_response(body, result))
