"""The cluster view (nodes, memory, instances, leases, the ingress replicas' direct addresses) and the placement / eviction event log (admin keys only)."""

from fastapi import APIRouter, Depends, Query
from ray import serve

from cluster.serve_endpoints import direct_ingress
from router.api.auth import require_admin
from router.api.ingress import Ingress, current

router = APIRouter(tags=["cluster"], dependencies=[Depends(require_admin)])


@router.get("/v1/cluster")
async def cluster(ingress: Ingress = Depends(current)):
    view = await ingress.residency.cluster.remote()
    # where each node's ingress replica answers without the proxy's hop (Serve's direct ingress)
    view["ingress"] = await direct_ingress(serve.get_replica_context().app_name)
    return view


@router.get("/v1/cluster/events")
async def events(since: int = Query(default=0, ge=0), ingress: Ingress = Depends(current)):
    return {"object": "list", "data": await ingress.residency.events.remote(since)}
