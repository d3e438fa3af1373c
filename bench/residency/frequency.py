"""`python -m bench.residency.frequency`: does a keep value that learns how often each model is asked
for beat the shipped recency estimate? (Issue 12's GreedyDual-Size-Frequency question.)

The shipped `cost` strategy values an idle instance at reload seconds / (idle seconds + 60 s). The
variants here estimate each model's time to its next request from its own past arrivals (never the
future), kept across evictions as GDSF's frequency would be: an exponentially weighted mean of the
gaps between its requests (weight `alpha` for the newest gap), or the mean of the last `k` gaps;
the expected time to the next request is max(that mean, time since the last request) + 1 s, and the
keep value is reload seconds / that. Each variant replays the zipf and bursts traces with several
seeds through the same simulator and the same policy (only the keep values differ, passed as the
policy's keep-value override); the table gives GB reloaded as a ratio to offline Belady's on the
same trace. Prints the table, writes JSON (default bench/results/residency-frequency.json)."""

import argparse
import json
import statistics
from collections import deque
from collections.abc import Callable
from pathlib import Path

from bench.residency.catalog import NODES, empty_cluster, model_specs
from bench.residency.simulate import Decider, belady, orchard, simulate
from bench.residency.traces import bursts, zipf
from policy import ClusterState, InstanceRef, PolicyConfig, ensure
from policy.memory import reload_seconds

ROOT = Path(__file__).resolve().parents[2]


def learned(config: PolicyConfig, alpha: float | None = None, last_k: int | None = None) -> Decider:
    """The policy with keep values from each model's observed gaps between requests."""
    last: dict[str, float] = {}
    mean_gap: dict[str, float] = {}
    recent: dict[str, deque[float]] = {}

    def observe(model: str, now: float) -> None:
        if model in last:
            gap = max(now - last[model], 1e-3)
            if last_k is not None:
                q = recent.setdefault(model, deque(maxlen=last_k))
                q.append(gap)
                mean_gap[model] = sum(q) / len(q)
            else:
                assert alpha is not None
                old = mean_gap.get(model)
                mean_gap[model] = gap if old is None else (1 - alpha) * old + alpha * gap
        last[model] = now

    def decide(model: str, state: ClusterState, now: float, waited: float) -> object:
        if waited == 0:  # a new request (a retry of a waiting one is not another arrival)
            observe(model, now)
        values = {}
        for node in state.nodes:
            for inst in node.instances:
                spec = state.catalog[inst.model]
                weight = config.cost.utility_weight if spec.role == "utility" else 1.0
                if inst.model in mean_gap:
                    expect = max(mean_gap[inst.model], now - last[inst.model]) + 1.0
                else:
                    expect = max(0.0, now - inst.last_used) + config.cost.idle_floor_s
                values[InstanceRef(node_id=node.node_id, model=inst.model)] = reload_seconds(inst, spec, config) * weight / expect
        return ensure(model, state, now, config, waited_s=waited, oracle_keep_values=values)

    return decide


def known_rates(config: PolicyConfig, trace: list) -> Decider:
    """A bound on any frequency learner: each model's true long-run request rate (its count over the
    whole trace / the trace's length) given up front, the timing of its requests not. For arrivals
    without memory the expected time to the next request is 1 / rate, so the keep value is reload
    seconds x rate."""
    span = max(r.arrival for r in trace) - min(r.arrival for r in trace) or 1.0
    counts: dict[str, int] = {}
    for r in trace:
        counts[r.model] = counts.get(r.model, 0) + 1
    rate = {m: c / span for m, c in counts.items()}

    def decide(model: str, state: ClusterState, now: float, waited: float) -> object:
        values = {}
        for node in state.nodes:
            for inst in node.instances:
                spec = state.catalog[inst.model]
                weight = config.cost.utility_weight if spec.role == "utility" else 1.0
                values[InstanceRef(node_id=node.node_id, model=inst.model)] = reload_seconds(inst, spec, config) * weight * rate.get(inst.model, 0.0)
        return ensure(model, state, now, config, waited_s=waited, oracle_keep_values=values)

    return decide


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, nargs="+", default=[1, 3, 4, 5])
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "residency-frequency.json")
    a = ap.parse_args(argv)
    config = PolicyConfig()
    variants: dict[str, Callable[[list], Decider]] = {
        "shipped cost (recency)": lambda trace: orchard(config),
        "learned gaps, EWMA 0.3": lambda trace: learned(config, alpha=0.3),
        "learned gaps, EWMA 0.5": lambda trace: learned(config, alpha=0.5),
        "learned gaps, last 16": lambda trace: learned(config, last_k=16),
        "true rates, known up front (bound)": lambda trace: known_rates(config, trace),
    }
    ratios: dict[str, dict[str, list[float]]] = {name: {"zipf": [], "bursts": []} for name in variants}
    raw = []
    for seed in a.seeds:
        traces = {"zipf": zipf(seed=seed, requests=5000), "bursts": bursts(seed=seed if seed != 1 else 2, hours=2.0)}
        for trace_name, trace in traces.items():
            reference = simulate(trace, empty_cluster(model_specs(frozenset()), NODES), belady(config, trace), config).row()["gb_reloaded"]
            for name, make in variants.items():
                gb = simulate(trace, empty_cluster(model_specs(frozenset()), NODES), make(trace), config).row()["gb_reloaded"]
                ratios[name][trace_name].append(gb / reference)
                raw.append({"seed": seed, "trace": trace_name, "variant": name, "gb_reloaded": gb, "belady_gb": reference})
            print(f"seed {seed} {trace_name}: " + ", ".join(f"{n} {ratios[n][trace_name][-1]:.2f}" for n in variants), flush=True)
    seeds = ", ".join(str(s) for s in a.seeds)
    lines = [
        f"| keep value | zipf: GB reloaded / Belady's, seeds {seeds} | mean | bursts: the same | mean |",
        "|---|---|---:|---|---:|",
    ]
    for name, by in ratios.items():
        lines.append(
            f"| {name} | {', '.join(f'{r:.2f}' for r in by['zipf'])} | {statistics.mean(by['zipf']):.2f} | "
            f"{', '.join(f'{r:.2f}' for r in by['bursts'])} | {statistics.mean(by['bursts']):.2f} |"
        )
    print("\n".join(lines))
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps({"seeds": a.seeds, "ratios": ratios, "raw": raw}, indent=2) + "\n")
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
