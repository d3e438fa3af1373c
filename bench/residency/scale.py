"""How long one ensure() takes on a large cluster: 100 nodes, 1,000 models in the registry."""

import random
import statistics
import time

from policy import ClusterState, InstanceState, ModelSpec, NodeState, Place, PolicyConfig, ensure
from policy.config import GIB


def large_cluster(nodes: int, models: int, seed: int = 7) -> tuple[ClusterState, str]:
    rng = random.Random(seed)
    specs = []
    for i in range(models):
        if i % 10 == 0:
            specs.append(ModelSpec(name=f"llm-{i}", kind="llm", weight_bytes=int(rng.uniform(4, 40) * GIB), kv_bytes_per_token=128 * 1024))
        else:
            kind = rng.choice(["embedding", "rerank", "stt", "tts"])
            specs.append(ModelSpec(name=f"{kind}-{i}", kind=kind, weight_bytes=int(rng.uniform(0.05, 2.0) * GIB), role="utility"))
    target = specs[0]  # an LLM that nothing holds
    placeable = specs[1:]
    node_states = []
    for n in range(nodes):
        usable = 48 * GIB
        held, used = [], 0
        for spec in rng.sample(placeable, 40):
            nbytes = spec.weight_bytes + 256 * 1024**2
            if used + nbytes > usable * 0.9:
                continue
            used += nbytes
            held.append(
                InstanceState(
                    model=spec.name,
                    device="metal",
                    bytes=nbytes,
                    last_used=rng.uniform(0, 9000),
                    loaded_at=rng.uniform(0, 5000),
                    in_flight=rng.choice([0, 0, 0, 1]),
                )
            )
            if len(held) == 10:
                break
        node_states.append(
            NodeState(node_id=f"mac-{n:03d}", devices=("metal", "cpu"), total_bytes=64 * GIB, usable_bytes=usable, instances=tuple(held))
        )
    return ClusterState(nodes=tuple(node_states), catalog={s.name: s for s in specs}), target.name


def time_one_decision(nodes: int = 100, models: int = 1000, runs: int = 5) -> dict:
    state, model = large_cluster(nodes, models)
    loaded = sum(len(n.instances) for n in state.nodes)
    config = PolicyConfig(max_instances=loaded)  # at the global cap: every node's plan must evict
    timings, decision = [], None
    for _ in range(runs):
        started = time.perf_counter()
        decision = ensure(model, state, 10_000.0, config)
        timings.append((time.perf_counter() - started) * 1000)
    assert isinstance(decision, Place) and decision.evict, decision
    return {
        "nodes": nodes,
        "models": models,
        "instances": loaded,
        "runs": runs,
        "median_ms": statistics.median(timings),
        "max_ms": max(timings),
        "evicted": len(decision.evict),
    }
