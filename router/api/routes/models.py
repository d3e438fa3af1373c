"""The model list (OpenAI's /v1/models and /v1/models/{id}, with Orchard's residency) and the
operator's model actions (admin keys only): load, unload, pin, unpin, pull to node stores, and
remove a node's stored copy."""

from typing import Any

from fastapi import APIRouter, Body, Depends, Query
from pydantic import BaseModel, ConfigDict

from deployments.wire.failure import OrchardError
from deployments.wire.leases import Refusal
from router.api.auth import principal, require_admin
from router.api.ingress import Ingress, current
from router.api.keys import Principal

router = APIRouter(tags=["models"])


class LoadRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    node: str | None = None  # load there (an extra copy when the model is elsewhere); default: where the policy says


class PullRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    nodes: list[str] | None = None  # default: every alive node


def _model_object(m: dict[str, Any]) -> dict[str, Any]:
    return {"id": m["id"], "object": "model", "created": 0, "owned_by": "orchard", "orchard": m}


async def _ask(call) -> dict[str, Any]:
    """A residency-service call whose failure comes back as a Refusal (it crosses Ray)."""
    answer = await call
    if isinstance(answer, Refusal):
        raise answer.error()
    return answer


@router.get("/v1/models")
async def list_models(ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    """Every model this key may use, with its residency under `orchard`."""
    models = await ingress.residency.models.remote()
    return {"object": "list", "data": [_model_object(m) for m in models if who.may_use(m["id"])]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, ingress: Ingress = Depends(current), who: Principal = Depends(principal)):
    """OpenAI's model object (client.models.retrieve), with the residency under `orchard`."""
    for m in await ingress.residency.models.remote() if who.may_use(model) else ():
        if m["id"] == model:
            return _model_object(m)
    raise OrchardError("model_not_found", f"The model '{model}' does not exist", "model")


@router.post("/v1/models/{model}/load", dependencies=[Depends(require_admin)])
async def load(model: str, body: LoadRequest | None = Body(default=None), ingress: Ingress = Depends(current)):
    return await _ask(ingress.residency.load.remote(model, body.node if body else None))


@router.post("/v1/models/{model}/unload", dependencies=[Depends(require_admin)])
async def unload(model: str, ingress: Ingress = Depends(current)):
    return await _ask(ingress.residency.unload.remote(model))


@router.post("/v1/models/{model}/pin", dependencies=[Depends(require_admin)])
async def pin(model: str, ingress: Ingress = Depends(current)):
    return await _ask(ingress.residency.pin.remote(model, True))


@router.post("/v1/models/{model}/unpin", dependencies=[Depends(require_admin)])
async def unpin(model: str, ingress: Ingress = Depends(current)):
    return await _ask(ingress.residency.pin.remote(model, False))


@router.post("/v1/models/{model}/pull", dependencies=[Depends(require_admin)])
async def pull(model: str, body: PullRequest | None = Body(default=None), ingress: Ingress = Depends(current)):
    """Copy the model's weights into node stores without loading them (like `ollama pull`); returns at
    once with each node's status: follow the copies on GET /v1/models/{model} (`fetching`, `stored_on`)."""
    return await _ask(ingress.residency.pull.remote(model, body.nodes if body else None))


@router.delete("/v1/models/{model}/files", dependencies=[Depends(require_admin)])
async def delete_files(model: str, node: str = Query(min_length=1), force: bool = False, ingress: Ingress = Depends(current)):
    """Remove the model's stored copy from one node's store (not while in use there; the cluster's
    last copy only with force=true)."""
    return await _ask(ingress.residency.delete_files.remote(model, node, force))
