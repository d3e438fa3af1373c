"""The residency loop's state as the JSON views GET /v1/models and GET /v1/cluster answer (the
console reads them too)."""

from typing import Any

from policy import InstanceRef
from policy.failures import backoff_left
from policy.memory import ours_bytes, protected_for_s
from router.residency.controller import ResidencyController
from router.residency.measured import side_by_side


def models(controller: ResidencyController) -> list[dict[str, Any]]:
    """Every registry model with its residency: loaded / loading / failed / available, where,
    bytes; a model marked failed (P10) says why and when it is tried again."""
    state = controller.state
    now = controller.clock.now()
    out = []
    for name, spec in sorted(state.catalog.items()):
        copies = [(n.node_id, i) for n in state.nodes if n.alive for i in n.instances if i.model == name]
        mark = state.failed.get(name)
        status = "loaded" if any(i.status == "ready" for _, i in copies) else "loading" if copies else "failed" if mark else "available"
        folder = controller.sites.entries[name].folder
        stores = controller.sites.stores.items() if folder is not None else ()
        fetching = {node_id: s.fetching[folder].model_dump() for node_id, s in stores if folder in s.fetching}
        if fetching and status != "loaded":
            status = "fetching"
        model = {
            "id": name,
            "kind": spec.kind,
            "status": status,
            "pinned": spec.pinned,
            "keep_warm": spec.keep_warm,
            "nodes": [node_id for node_id, _ in copies],
            "bytes": sum(i.bytes for _, i in copies) or None,
            "stored_on": sorted(node_id for node_id, s in stores if s.holds(folder)),  # type: ignore[arg-type]  # folder is set when stores is
            "fetching": fetching,  # node -> done_bytes, total_bytes, source, bytes_per_s, eta_s
            "demand": round(controller.demand.at(name, now), 2),  # requests, decayed (L4)
        }
        if mark is not None:
            model["failure"] = {
                "node_id": mark.node_id,
                "reason": mark.reason,
                "message": mark.message,
                "failures": mark.failures,
                "retry_in_s": max(0.0, round(backoff_left(mark, now, controller.config), 1)),
            }
        out.append(model)
    return out


def cluster(controller: ResidencyController) -> dict[str, Any]:
    """Every node (memory, instances with their leases and actor, store), the policy, the catalog as
    the policy sees it now (pins included), lease counts, and the loop's clock (`now`: instances'
    `loaded_at` and `last_used` are on it)."""
    state = controller.state
    leases = controller.leases.all()
    return {
        "now": controller.clock.now(),
        "nodes": [
            {
                "node_id": n.node_id,
                "alive": n.alive,
                "draining": n.draining,
                "devices": list(n.devices),
                "chip": controller.sites.chips.get(n.node_id),
                "labels": n.labels,
                "memory": {
                    "total_bytes": n.total_bytes,
                    "usable_bytes": n.usable_bytes,
                    "foreign_bytes": n.foreign_bytes,
                    "headroom_bytes": n.reported_headroom_bytes,
                    "ours_bytes": ours_bytes(n),  # kept prompt prefixes included (X4)
                },
                "instances": [
                    i.model_dump()
                    | {
                        "leases": sum(1 for lease in leases if lease.node_id == n.node_id and lease.model == i.model),
                        "actor": controller.sites.actor_of(InstanceRef(node_id=n.node_id, model=i.model)),
                        # E3: seconds after loaded_at it may not be evicted (twice what losing it costs)
                        "protected_for_s": round(protected_for_s(i, state.catalog[i.model], controller.config), 2)
                        if i.model in state.catalog
                        else 0.0,
                        # M1: its folder's estimate beside what its engine measured after the load
                        "memory": side_by_side(controller.placements.measurements.get(i.model)),
                    }
                    for i in n.instances
                ],
                "store": store.model_dump() if (store := controller.sites.stores.get(n.node_id)) is not None else None,
                # R1: the model-server process started ahead of demand here (None: none ready)
                "spare": {"actor": spare.actor, "bytes": spare.bytes} if (spare := controller.spares.ready.get(n.node_id)) is not None else None,
            }
            for n in state.nodes
        ],
        "policy": controller.config.model_dump(mode="json"),
        "catalog": {name: spec.model_dump(mode="json") for name, spec in sorted(state.catalog.items())},
        "routing": {
            "leases_granted": controller.acquires,
            "standing_leases": sum(1 for lease in leases if lease.holder is not None),
            "request_leases": sum(1 for lease in leases if lease.holder is None),
        },
    }
