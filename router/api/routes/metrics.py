"""GET /metrics: Orchard's own view in Prometheus's text format, for setups that do not scrape Ray's
per-node exporters (those carry the same and more as `ray_orchard_*`: docs/cluster.md). Node memory,
instances with their bytes and requests in flight, the residency events counted by kind, model
and node since the controller started, and each LLM instance's speculative decoding (drafts proposed
and accepted, verify steps, the steps it turned down and why: its engine's counters). An admin key
when keys are configured (it names models)."""

import asyncio
from typing import Any

import ray
from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from cluster.ray_api import NAMESPACE
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
    instances = [(inst["model"], node["node_id"], inst["actor"]) for node in view["nodes"] for inst in node["instances"] if inst.get("actor")]
    counted = await asyncio.gather(*(_engine_counters(actor) for _, _, actor in instances))
    lines += speculation_lines([(model, node, c) for (model, node, _), c in zip(instances, counted, strict=True)])
    return "\n".join(lines) + "\n"


SPECULATION = (  # engine counter (deployments/engines/speculation.py), metric, help
    ("spec_proposed", "orchard_spec_proposed_tokens_total", "Draft tokens an LLM instance verified"),
    ("spec_accepted", "orchard_spec_accepted_tokens_total", "Draft tokens the target model accepted"),
    ("spec_steps", "orchard_spec_verify_steps_total", "Decode steps that verified drafts"),
    ("spec_depth_sum", "orchard_spec_depth_sum_total", "Draft depth chosen, summed over the verify steps"),
    ("spec_draft_rows", "orchard_spec_draft_rows_total", "Rows of verify steps whose drafts came from a draft model"),
    ("spec_draft_forwards", "orchard_spec_draft_forwards_total", "The draft model's forwards for them (one a draft token)"),
    ("spec_draft_s", "orchard_spec_draft_seconds_total", "Seconds the draft model took for them"),
)
PLAIN_WHY = {"spec_off_prefill": "prefill", "spec_off_rows": "rows", "spec_off_no_drafts": "no_drafts", "spec_off_cost": "cost"}


def speculation_lines(instances: list[tuple[str, str, dict[str, Any]]]) -> list[str]:
    """Prometheus lines of each instance's speculation counters (model, node, its engine's counters);
    instances whose engine does not speculate have none."""
    rows = [(model, node, c) for model, node, c in instances if "spec_steps" in c]
    if not rows:
        return []
    lines: list[str] = []
    for key, metric, text in SPECULATION:
        lines += [f"# HELP {metric} {text}", f"# TYPE {metric} counter"]
        lines += [f"{metric}{_labels(model=model, node=node)} {c.get(key, 0):g}" for model, node, c in rows]
    metric = "orchard_spec_plain_steps_total"
    lines += [f"# HELP {metric} Decode steps that did not speculate, by why", f"# TYPE {metric} counter"]
    for model, node, c in rows:
        lines += [f"{metric}{_labels(model=model, node=node, why=why)} {c.get(key, 0):g}" for key, why in PLAIN_WHY.items()]
    return lines


async def _engine_counters(actor: str) -> dict[str, Any]:
    """An instance's engine counters (ModelServer.counters), or {} where it does not answer in time."""
    try:
        handle = await asyncio.to_thread(ray.get_actor, actor, NAMESPACE)
        return await asyncio.wait_for(handle.counters.remote(), timeout=2.0)
    except Exception:  # gone, starting, busy: /metrics answers without it
        return {}
