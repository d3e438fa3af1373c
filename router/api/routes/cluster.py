"""The cluster view (nodes, memory, instances, leases) and the placement / eviction event log."""

from fastapi import APIRouter, Depends, Query

from router.api.ingress import Ingress, current

router = APIRouter(tags=["cluster"])


@router.get("/v1/cluster")
async def cluster(ingress: Ingress = Depends(current)):
    return await ingress.residency.cluster.remote()


@router.get("/v1/cluster/events")
async def events(since: int = Query(default=0, ge=0), ingress: Ingress = Depends(current)):
    return {"object": "list", "data": await ingress.residency.events.remote(since)}
