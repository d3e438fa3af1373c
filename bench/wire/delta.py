"""What one generation delta costs on the token path, by the type it crosses as: built on the model
server, pickled in a flush with the other streams' deltas (Ray's serializer: ray.cloudpickle,
protocol 5), unpickled on the ingress, and read there as the output parsers read it (text,
token_ids, finish_reason). In process, one thread, no Ray call: only what the type changes.

Sides, each a one-token delta as the LLM engine makes one per stream per step:
- `dict`: the wire's GenerationDelta (a TypedDict, so a plain dict at run time): the baseline;
- `model`: the same fields as a frozen pydantic model, validated when built;
- `model_construct`: that model built without validation (as the engine builds its own Delta);
- `engine+dump`: the engine's own Delta (model_construct), dumped to a dict on the server, as the
  model server did before the wire had a delta type;
- `engine(valid)+dump`: the same with the engine's Delta validated when built (pydantic's
  model_construct runs in Python, validation in its Rust core).

    python -m bench.wire.delta [--flush 16] [--flushes 2000] [--rounds 5]

Prints microseconds per delta (median of the rounds) and each side's ratio to `dict` measured in
the same run; writes bench/results/wire-delta.json."""

import argparse
import platform
import statistics
import time
from collections.abc import Callable
from typing import Any

from pydantic import Field
from ray import cloudpickle

from bench.report import publish
from deployments.wire.generation import FinishReason, GenerationDelta
from policy._frozen import Frozen


class DeltaModel(Frozen):
    """The wire delta's fields as a pydantic model (what the wire would send instead of the TypedDict)."""

    text: str = ""
    token_ids: list[int] = Field(default_factory=list)
    logprobs: list[dict[str, Any]] | None = None
    finish_reason: FinishReason | None = None
    usage: dict[str, int] | None = None
    error: str | None = None
    error_code: str | None = None
    error_param: str | None = None
    stop_sequence: str | None = None


def _build_dict(i: int) -> Any:
    return GenerationDelta(text=" tok", token_ids=[i], logprobs=None)


def _build_model(i: int) -> Any:
    return DeltaModel(text=" tok", token_ids=[i])


def _build_construct(i: int) -> Any:
    return DeltaModel.model_construct(text=" tok", token_ids=[i], logprobs=None)


def _build_engine_dump(i: int) -> Any:
    from deployments.engines.llm import Delta  # the engine module (MLX): only this side needs it

    return Delta.model_construct(text=" tok", token_ids=[i], logprobs=None).model_dump()


def _build_engine_validated_dump(i: int) -> Any:
    from deployments.engines.llm import Delta

    return Delta(text=" tok", token_ids=[i], logprobs=None).model_dump()


def _read_dict(d: Any) -> int:
    return len(d.get("text") or "") + len(d.get("token_ids") or ()) + (d.get("finish_reason") is not None)


def _read_model(d: Any) -> int:
    return len(d.text) + len(d.token_ids) + (d.finish_reason is not None)


SIDES: dict[str, tuple[Callable[[int], Any], Callable[[Any], int]]] = {
    "dict": (_build_dict, _read_dict),
    "model": (_build_model, _read_model),
    "model_construct": (_build_construct, _read_model),
    "engine+dump": (_build_engine_dump, _read_dict),
    "engine(valid)+dump": (_build_engine_validated_dump, _read_dict),
}


def _round(build: Callable[[int], Any], read: Callable[[Any], int], flush: int, flushes: int) -> dict[str, float]:
    """Microseconds per delta: building, pickling (a flush: [(request_id, delta), ...]), unpickling, reading."""
    ids = [f"{i:032x}" for i in range(flush)]
    built = pickled = unpickled = 0.0
    for n in range(flushes):
        t0 = time.perf_counter()
        batch = [(rid, build(n + k)) for k, rid in enumerate(ids)]
        t1 = time.perf_counter()
        blob = cloudpickle.dumps(batch, protocol=5)
        t2 = time.perf_counter()
        got = cloudpickle.loads(blob)
        for _, delta in got:
            read(delta)
        t3 = time.perf_counter()
        built, pickled, unpickled = built + t1 - t0, pickled + t2 - t1, unpickled + t3 - t2
    per = 1e6 / (flush * flushes)
    return {"build_us": built * per, "pickle_us": pickled * per, "unpickle_read_us": unpickled * per, "total_us": (built + pickled + unpickled) * per}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--flush", type=int, default=16, help="deltas per flush (streams in one channel item)")
    parser.add_argument("--flushes", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", default="bench/results/wire-delta.json")
    args = parser.parse_args()

    for build, read in SIDES.values():  # warm: imports, pydantic's schema, the pickler's caches
        _round(build, read, args.flush, 50)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in SIDES}
    for _ in range(args.rounds):  # sides interleaved, so drift in the machine hits them alike
        for name, (build, read) in SIDES.items():
            runs[name].append(_round(build, read, args.flush, args.flushes))
    medians = {name: {key: statistics.median(r[key] for r in rounds) for key in rounds[0]} for name, rounds in runs.items()}
    base = medians["dict"]["total_us"]
    lines = [
        f"one delta, in flushes of {args.flush}, median of {args.rounds} rounds x {args.flushes} flushes ({platform.processor() or platform.machine()})",
        f"{'side':<19} {'build us':>9} {'pickle us':>10} {'unpickle+read us':>17} {'total us':>9} {'x dict':>7}",
    ]
    for name, m in medians.items():
        lines.append(
            f"{name:<19} {m['build_us']:>9.2f} {m['pickle_us']:>10.2f} {m['unpickle_read_us']:>17.2f} {m['total_us']:>9.2f} {m['total_us'] / base:>7.2f}"
        )
    results = {
        "flush": args.flush,
        "flushes": args.flushes,
        "rounds": args.rounds,
        "machine": platform.machine(),
        "python": platform.python_version(),
        "sides": {name: m | {"ratio_to_dict": m["total_us"] / base} for name, m in medians.items()},
    }
    publish(results, "\n".join(lines), args.json, None)


if __name__ == "__main__":
    # Run as the module bench.wire.delta, not as __main__: cloudpickle pickles a class of __main__
    # by value (its whole definition in every flush), one of an importable module by reference.
    from bench.wire.delta import main as run

    run()
