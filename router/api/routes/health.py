"""Liveness and readiness for a load balancer in front of the ingress (no key needed)."""

import asyncio

from fastapi import APIRouter, Depends

from deployments.wire.failure import OrchardError
from router.api.ingress import Ingress, current

router = APIRouter(tags=["health"])


@router.get("/health")
async def health():
    """The ingress process answers."""
    return {"status": "ok"}


@router.get("/ready")
async def ready(ingress: Ingress = Depends(current)):
    """The residency controller answers, and at least one node reports."""
    try:
        view = await asyncio.wait_for(ingress.residency.cluster.remote(), 5.0)
    except Exception as e:
        raise OrchardError("not_ready", f"the residency controller does not answer: {type(e).__name__}", retry_after_s=2) from None
    alive = [n["node_id"] for n in view["nodes"] if n["alive"]]
    if not alive:
        raise OrchardError("not_ready", "no node reports to the residency controller", retry_after_s=2)
    return {"status": "ready", "nodes": alive}
