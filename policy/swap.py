"""pick_swap(): which busy instance to drain for which waiting model (rules W1-W3 in docs/residency.md).

Under steady load every resident instance is always busy, so a model that is not resident would
wait until its requests time out: E2 never evicts a busy instance. A swap drains one instead: no
new request is sent to it, what runs on it finishes, then it is evicted and the waiting model is
placed in its room (by the usual placement, once it is idle)."""

from collections.abc import Mapping, Sequence

from pydantic import Field

from policy._frozen import Frozen
from policy.cluster_state import ClusterState, InstanceRef
from policy.config import PolicyConfig
from policy.memory import estimated_load_seconds, reload_seconds, required_bytes
from policy.placement import plan_placement
from policy.transitions import set_in_flight


class SwapAsk(Frozen):
    """Requests waiting for one model: how many, and how long the oldest has waited."""

    model: str
    waiting: int = Field(ge=1)
    waited_s: float = Field(ge=0)


class Drain(Frozen):
    """Drain `instances` (all on `node_id`) so that `model` can be placed there once they are idle."""

    model: str
    node_id: str
    instances: tuple[InstanceRef, ...]
    swap_seconds: float  # the loads the swap costs: the waiting model's, and the drained ones' again
    reason: str


def pick_swap(
    asks: Sequence[SwapAsk],
    state: ClusterState,
    now: float,
    config: PolicyConfig,
    *,
    swaps_last_minute: Mapping[str, int],
    draining_for: frozenset[str] = frozenset(),
) -> Drain | None:
    """W1: only under `contention: wait`, for a model whose oldest request has waited
    `swap_after_s`, and when busy instances alone keep it out: with their requests finished the
    usual placement (P4-P7) would place it, evicting only instances that are not pinned, young,
    loading or draining, and only busy ones among them are drained. W2 (anti-thrash): none while
    `max_swaps_per_node_per_minute` swaps started on a node in the last minute (`swaps_last_minute`:
    node -> swaps), none on a node where a drain is
    under way, none for a model a drain is under way for (`draining_for`: one swap makes room for
    one model); minimum residency protects every instance, the one a swap loaded too. W3: among
    the models that could be swapped in, the one with the most waiting time per second of loading
    the swap costs (requests waiting x the oldest's wait / (1 + load seconds of the model and of
    the drained instances)); ties by model name."""
    if config.contention != "wait":
        return None
    spent = frozenset(node for node, n in swaps_last_minute.items() if n >= config.max_swaps_per_node_per_minute)
    draining = frozenset(n.node_id for n in state.nodes for i in n.instances if i.status == "draining") | spent
    if config.max_swaps_per_node_per_minute == 0:
        return None
    busy = [
        (InstanceRef(node_id=n.node_id, model=i.model), i)
        for n in state.nodes
        if n.alive and n.node_id not in draining
        for i in n.instances
        if i.status == "ready" and i.in_flight > 0
    ]
    if not busy:
        return None
    idle = state
    for ref, _ in busy:
        idle = set_in_flight(idle, ref, 0)
    busy_refs = {ref for ref, _ in busy}
    best: tuple[float, str, Drain] | None = None
    for ask in asks:
        spec = state.catalog.get(ask.model)
        if spec is None or ask.waited_s < config.swap_after_s or ask.model in draining_for:
            continue
        plan, _, _ = plan_placement(spec, idle, now, config, exclude_nodes=draining, waited_s=ask.waited_s)
        if plan is None:
            continue
        victims = tuple(c.ref for c in plan.victims)
        drained = tuple(ref for ref in victims if ref in busy_refs)
        if not drained:
            continue  # it fits without draining: the waiter's own decision places it
        seconds = (spec.load_seconds_estimate or estimated_load_seconds(required_bytes(spec, config), config)) + sum(
            reload_seconds(c.inst, c.spec, config) for c in plan.victims if c.ref in drained
        )
        score = ask.waiting * ask.waited_s / (1.0 + seconds)
        names = ", ".join(r.model for r in drained)
        drain = Drain(
            model=ask.model,
            node_id=plan.node.node_id,
            instances=drained,
            swap_seconds=round(seconds, 2),
            reason=(
                f"{ask.waiting} request(s) for {ask.model} waited up to {ask.waited_s:.1f} s while busy {names} held "
                f"{plan.node.node_id}: draining {names} for it (about {seconds:.1f} s of loading)"
            ),
        )
        if best is None or score > best[0] or (score == best[0] and ask.model < best[1]):
            best = (score, ask.model, drain)
    return best[2] if best is not None else None
