"""`python -m bench.residency.scale`: how long one ensure() takes on a large cluster (100 nodes,
1,000 models in the registry by default), in three scenarios:

- place-fit: a Place with no eviction (no cap in force; some node has room);
- place-evict: a Place that evicts (the cluster at its global instance cap);
- contention: every instance busy and the cluster at its cap, so no node can evict: the decision
  plans twice (with and without the passing protections) and explains every node's shortfall: a Wait.

Every run decides on the same state; the policy keeps nothing between calls, so each run is a
whole decision. Wall time (p50/p95/max) is what a caller waits; CPU time (p50) is the decision's
own cost, the better figure on a shared machine. Prints a table and writes JSON (default
bench/results/residency-scale.json)."""

import argparse
import platform
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

from bench.report import publish
from policy import ClusterState, Decision, InstanceState, ModelSpec, NodeState, Place, PolicyConfig, Wait, ensure
from policy.config import GIB

NOW = 10_000.0


def large_cluster(nodes: int, models: int, seed: int = 7, *, busy: bool = False) -> tuple[ClusterState, str]:
    """Nodes of 48 GiB usable, each holding up to 10 small models; the model asked for is an LLM
    that nothing holds. busy: every instance has a request in flight."""
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
            in_flight = rng.choice([0, 0, 0, 1])
            held.append(
                InstanceState(
                    model=spec.name,
                    device="metal",
                    bytes=nbytes,
                    last_used=rng.uniform(0, 9000),
                    loaded_at=rng.uniform(0, 5000),
                    in_flight=max(in_flight, 1) if busy else in_flight,
                )
            )
            if len(held) == 10:
                break
        node_states.append(
            NodeState(node_id=f"mac-{n:03d}", devices=("metal", "cpu"), total_bytes=64 * GIB, usable_bytes=usable, instances=tuple(held))
        )
    return ClusterState(nodes=tuple(node_states), catalog={s.name: s for s in specs}), target.name


def _loaded(state: ClusterState) -> int:
    return sum(len(n.instances) for n in state.nodes)


def scenarios(nodes: int, models: int) -> dict[str, tuple[ClusterState, str, PolicyConfig, Callable[[Decision], bool]]]:
    """Name -> (state, model asked for, config, what the decision must be)."""
    state, model = large_cluster(nodes, models)
    busy, _ = large_cluster(nodes, models, busy=True)
    return {
        "place-fit": (state, model, PolicyConfig(), lambda d: isinstance(d, Place) and not d.evict),
        # At the global cap: every node's plan must evict.
        "place-evict": (state, model, PolicyConfig(max_instances=_loaded(state)), lambda d: isinstance(d, Place) and bool(d.evict)),
        "contention": (busy, model, PolicyConfig(max_instances=_loaded(busy)), lambda d: isinstance(d, Wait) and d.code == "busy"),
    }


def _time(state: ClusterState, model: str, config: PolicyConfig, runs: int) -> tuple[list[float], list[float], Decision]:
    """Wall and CPU milliseconds of each run, and the decision."""
    wall, cpu = [], []
    decision = ensure(model, state, NOW, config)  # warm-up, not timed
    for _ in range(runs):
        started, started_cpu = time.perf_counter(), time.process_time()
        decision = ensure(model, state, NOW, config)
        cpu.append((time.process_time() - started_cpu) * 1000)
        wall.append((time.perf_counter() - started) * 1000)
    return wall, cpu, decision


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def time_one_decision(nodes: int = 100, models: int = 1000, runs: int = 5) -> dict:
    """The place-evict scenario alone (what `python -m bench.residency` reports)."""
    state, model, config, _ = scenarios(nodes, models)["place-evict"]
    timings, _, decision = _time(state, model, config, runs)
    assert isinstance(decision, Place) and decision.evict, decision
    return {
        "nodes": nodes,
        "models": models,
        "instances": _loaded(state),
        "runs": runs,
        "median_ms": statistics.median(timings),
        "max_ms": max(timings),
        "evicted": len(decision.evict),
    }


def run(nodes: int, models: int, runs: int) -> dict:
    out: dict = {"nodes": nodes, "models": models, "runs": runs, "scenarios": {}}
    for name, (state, model, config, expected) in scenarios(nodes, models).items():
        wall, cpu, decision = _time(state, model, config, runs)
        if not expected(decision):
            raise AssertionError(f"{name}: unexpected decision {decision!r}")
        out["scenarios"][name] = {
            "instances": _loaded(state),
            "decision": decision.decision,
            "evicted": len(decision.evict) if isinstance(decision, Place) else 0,
            "p50_ms": round(statistics.median(wall), 3),
            "p95_ms": round(_percentile(wall, 0.95), 3),
            "max_ms": round(max(wall), 3),
            "cpu_p50_ms": round(statistics.median(cpu), 3),
        }
    out["machine"] = {"python": platform.python_version(), "processor": platform.machine()}
    return out


def table(results: dict) -> str:
    lines = [
        f"One ensure() at {results['nodes']} nodes x {results['models']} models, {results['runs']} runs per scenario\n",
        "| scenario | instances | decision | evicted | p50 ms | p95 ms | max ms | CPU p50 ms |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for name, s in results["scenarios"].items():
        lines.append(
            f"| {name} | {s['instances']} | {s['decision']} | {s['evicted']} "
            f"| {s['p50_ms']:.2f} | {s['p95_ms']:.2f} | {s['max_ms']:.2f} | {s['cpu_p50_ms']:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", type=int, default=100)
    parser.add_argument("--models", type=int, default=1000)
    parser.add_argument("--runs", type=int, default=50, help="timed decisions per scenario (after one untimed)")
    parser.add_argument("--json", default=str(Path("bench") / "results" / "residency-scale.json"))
    args = parser.parse_args()
    if args.nodes < 1 or args.models < 41 or args.runs < 1:
        parser.error("--nodes and --runs must be at least 1, --models at least 41 (each node samples 40 of the models)")
    results = run(args.nodes, args.models, args.runs)
    publish(results, table(results), args.json, None)


if __name__ == "__main__":
    main()
