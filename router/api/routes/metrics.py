"""GET /metrics: Orchard's own view in Prometheus's text format, for setups that do not scrape Ray's
per-node exporters (those carry the same and more as `ray_orchard_*`: docs/cluster.md). Node memory,
instances with their bytes and requests in flight, and the residency events counted by kind, model
and node since the controller started. An admin key when keys are configured (it names models)."""

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from router.api.auth import require_admin
from router.api.ingress import Ingress, current

router = APIRouter(tags=["metrics"], dependencies=[Depends(require_admin)])


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{v.replace(chr(92), chr(92) * 2).replace(chr(34), chr(92) + chr(34))}"' for k, v in labels.items())
    return "{" + inner + "}"


@router.get("/metrics", response_class=PlainTextResponse)
async def metrics(ingress: Ingress = Depends(current)):
    view = await ingress.residency.cluster.remote()
    counts = await ingress.residency.event_counts.remote()
    lines = [
        "# HELP orchard_node_usable_bytes Memory Orchard may use on a node",
        "# TYPE orchard_node_usable_bytes gauge",
        "# HELP orchard_node_headroom_bytes Free memory a node reports",
        "# TYPE orchard_node_headroom_bytes gauge",
        "# HELP orchard_instance_bytes Memory a loaded model instance holds (weights + KV reservation)",
        "# TYPE orchard_instance_bytes gauge",
        "# HELP orchard_instance_requests Requests in flight on an instance",
        "# TYPE orchard_instance_requests gauge",
    ]
    for node in view["nodes"]:
        n = node["node_id"]
        lines.append(f"orchard_node_usable_bytes{_labels(node=n)} {node['memory']['usable_bytes'] if node['alive'] else 0}")
        lines.append(f"orchard_node_headroom_bytes{_labels(node=n)} {node['memory']['headroom_bytes'] or 0}")
        for inst in node["instances"]:
            lines.append(f"orchard_instance_bytes{_labels(model=inst['model'], node=n, status=inst['status'])} {inst['bytes']}")
            lines.append(f"orchard_instance_requests{_labels(model=inst['model'], node=n)} {inst['leases']}")
    lines += ["# HELP orchard_events_total Residency events since the controller started", "# TYPE orchard_events_total counter"]
    lines += [f"orchard_events_total{_labels(kind=kind, model=model, node=node)} {n}" for kind, model, node, n in counts]
    return "\n".join(lines) + "\n"
