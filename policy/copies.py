"""plan_copies(): copies to start without a request asking: up to min_copies for every model, and
one more copy of a model whose every ready copy is saturated, up to max_copies."""

from policy.cluster_state import ClusterState
from policy.config import PolicyConfig
from policy.decisions import Place
from policy.failures import within_backoff
from policy.placement import place_from_plan, plan_placement
from policy.transitions import apply_place


def plan_copies(state: ClusterState, now: float, config: PolicyConfig) -> tuple[Place, ...]:
    """Rules C1-C3 in docs/residency.md. Each Place is planned against the state with the earlier
    ones applied, so two copies never count on the same free memory. A model within its failed-load
    back-off gets no copy (P10)."""
    places: list[Place] = []
    work = state
    for name in sorted(work.catalog):
        spec = work.catalog[name]
        copies = [i for n in work.nodes if n.alive for i in n.instances if i.model == name and i.status in ("ready", "loading")]
        if len(copies) >= spec.max_copies or within_backoff(work, name, now, config):
            continue
        below_minimum = len(copies) < spec.min_copies
        saturated = bool(copies) and all(i.status == "ready" and i.in_flight >= spec.reserve_concurrency for i in copies)
        if not below_minimum and not saturated:
            continue
        plan, _, _ = plan_placement(spec, work, now, config)
        if plan is None or ((plan.victims or plan.shrink) and not below_minimum):
            continue
        place = place_from_plan(spec, plan, config)
        places.append(place)
        work = apply_place(work, place, now)
    return tuple(places)
