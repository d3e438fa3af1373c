"""place_on(): what an operator's load of a model on one named node does (rule P11): use the copy
already there, wait for the one loading there, place another copy there (evicting what the plan
names), or refuse with the reason. The same function answers "what if" without doing it."""

from policy.cluster_state import ClusterState, InstanceRef
from policy.config import PolicyConfig
from policy.decisions import Decision, Reject, Use, Wait
from policy.placement import blockers_of, place_from_plan, plan_placement


def place_on(model: str, node_id: str, state: ClusterState, now: float, config: PolicyConfig) -> Decision:
    spec = state.catalog.get(model)
    if spec is None:
        return Reject(model=model, code="unknown_model", message=f"model {model!r} is not in the registry")
    node = state.node(node_id)
    if node is None or not node.alive:
        return Reject(model=model, code="no_node", message=f"no alive node {node_id!r}")
    inst = node.instance(model)
    if inst is not None and inst.status == "ready":
        return Use(instance=InstanceRef(node_id=node_id, model=model))
    if inst is not None:
        code = "loading" if inst.status == "loading" else "busy"
        return Wait(model=model, code=code, message=f"model {model} is {inst.status} on {node_id}", retry_after_s=config.retry_poll_s)
    copies = sum(1 for n in state.nodes if n.alive and n.instance(model) is not None)
    if copies >= spec.max_copies:
        message = f"model {model} already has {copies} copies (max_copies={spec.max_copies}): unload it first"
        return Reject(model=model, code="max_copies", message=message)
    others = frozenset(n.node_id for n in state.nodes if n.node_id != node_id)
    plan, shortfalls, eligible = plan_placement(spec, state, now, config, exclude_nodes=others)
    if plan is not None:
        return place_from_plan(spec, plan, config)
    why = "its constraints exclude it" if not eligible else "it does not fit even after every allowed eviction, or a cap forbids it"
    return Reject(model=model, code="blocked", message=f"cannot place model {model} on {node_id}: {why}", blockers=blockers_of(shortfalls))
