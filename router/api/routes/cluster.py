"""The cluster view (nodes, memory, instances, leases) and the placement / eviction event log (admin keys only)."""

from fastapi import APIRouter, Depends, Query

from router.api.auth import require_admin
from router.api.ingress import Ingress, current

router = APIRouter(tags=["cluster"], dependencies=[Depends(require_admin)])


@router.get("/v1/cluster")
async def cluster(ingress: Ingress = Depends(current)):
    return await ingress.residency.cluster.remote()


@router.get("/v1/cluster/events")
async def events(since: int = Query(default=0, ge=0), ingress: Ingress = Depends(current)):
    return {"object": "list", "data": await ingress.residency.events.remote(since)}
