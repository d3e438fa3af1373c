"""The run of `python -m bench.peers --agent --shape claude-code|codex` (the requests: bench/peers/clis.py):
every server of `--servers` started by bench.peers.agent's code, each cell `--concurrency` CLI
conversations at a time, then (`--long-prompt-tokens`) the long prompts against a client idle timeout.
Prints a table, writes JSON (`--json`) and with `--markdown` a section of that file."""

import argparse
import asyncio
import json
import os
import platform
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import bench.peers.__main__ as peers_bench
import bench.serve.__main__ as serve_bench
from bench.peers import agent, clis
from deployments.models import prepare

ROOT = Path(__file__).resolve().parents[2]
LABEL = {"claude-code": "Claude Code 2.1.332", "codex": "Codex 0.171.0"}


def _opener(server: agent.Server, shape: str, idle_timeout_s: float | None = None) -> tuple[Callable, Callable[[], Awaitable[None]]]:
    if server.engine is not None:
        return clis.in_process(server.engine, shape), agent._nothing
    assert server.base is not None
    client = clis.CLIClient(server.base, shape, idle_timeout_s)
    return client, client.close


def run_cell(server: agent.Server, tag: str, n: int, a: argparse.Namespace) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        call, close = _opener(server, a.shape)
        try:
            before = await server.counters() if server.counters else None
            r = await clis.cell(call, a.shape, tag, a.project, n, a, server.model or a.model)
            if before is not None and server.counters is not None:
                r["engine"] = agent.engine_window(before, await server.counters())
            return r
        finally:
            await close()

    return asyncio.run(go())


def long_run(a: argparse.Namespace) -> Callable[[agent.Server], dict | None]:
    def last(server: agent.Server) -> dict | None:
        """An HTTP server's turn-1 prompt as it counts it (a whole answer's usage), then the long prompts."""
        if server.engine is not None:  # in process: its usage counts every prompt; no client, no idle timeout
            return None

        async def go() -> dict[str, Any]:
            assert server.base is not None
            model = server.model or a.model
            client = clis.CLIClient(server.base, a.shape, a.idle_timeout_s)
            try:
                first = clis.request(clis.conversation(a.shape, "Probe.", a.project, 0, model, a.tokens, a.temperature))
                out: dict[str, Any] = {"turn1_prompt_tokens": await clis.served_prompt(client, first)}
                if a.long_prompt_tokens > 0:
                    out["long"] = await clis.long_prompts(client, a.shape, f"Long {server.name}", a.long_project, a, model)
                    r = out["long"]
                    print(
                        f"  {server.name}: {r['requests']} long prompts, slowest first token {r['ttft_max_s']} s, {r['resends']} re-sends", flush=True
                    )
                return out
            finally:
                await client.close()

        return asyncio.run(go())

    return last


def summarize(raw: list[dict], concurrency: list[int], servers: list[str]) -> tuple[list[dict], list[dict], list[dict]]:
    probed = {x["server"]: x["last"]["turn1_prompt_tokens"] for x in raw if "last" in x}
    rows = []
    for n in concurrency:
        for s in servers:
            rs = [x for x in raw if x.get("server") == s and x.get("concurrency") == n]
            if not rs:
                continue

            def med(part: str, key: str, rs: list[dict] = rs) -> float:
                return round(statistics.median(x[part][key] for x in rs), 1)

            rows.append(
                {
                    "server": s,
                    "concurrency": n,
                    "rounds": len(rs),
                    "tok_s": round(statistics.median(x["tok_s"] for x in rs), 1),
                    "turn1_ttft_p50_ms": med("turn1", "ttft_p50_ms"),
                    "turn1_ttft_p95_ms": med("turn1", "ttft_p95_ms"),
                    "later_ttft_p50_ms": med("later", "ttft_p50_ms"),
                    "later_ttft_p95_ms": med("later", "ttft_p95_ms"),
                    # from the stream's usage, else (a server whose stream says 0) from a whole answer's
                    "turn1_prompt_tokens": round(rs[-1]["turn1"]["prompt_tokens"] / rs[-1]["turn1"]["requests"]) or probed.get(s, 0),
                    "later_cached_share": rs[-1]["later"]["cached_share"],
                }
            )
    ratios = []
    for n in concurrency:
        by = {r["server"]: r for r in rows if r["concurrency"] == n}
        if "vllm-mlx" not in by:
            continue
        for name in (s for s in servers if s in peers_bench.ORCHARDS and s in by):
            o, v = by[name], by["vllm-mlx"]
            ratios.append(
                {
                    "concurrency": n,
                    "server": name,
                    "tok_s_over_vllm_mlx": round(o["tok_s"] / v["tok_s"], 3),
                    "turn1_ttft_p50_over_vllm_mlx": round(o["turn1_ttft_p50_ms"] / v["turn1_ttft_p50_ms"], 3),
                    "later_ttft_p50_over_vllm_mlx": round(o["later_ttft_p50_ms"] / v["later_ttft_p50_ms"], 3),
                }
            )
    longs = [{"server": x["server"]} | x["last"]["long"] for x in raw if "long" in x.get("last", {})]
    return rows, ratios, longs


def _count(n: int) -> str:
    """A token count, or - where the server reported none (vllm-mlx's Messages stream says 0)."""
    return f"{n:,}" if n else "-"


def render(r: dict) -> str:
    lines = [
        "| server | at a time | tok/s | first token p50 / p95 ms, turn 1 | turns 2+ | turns 2+ prompt from cache | turn-1 prompt tokens |",
        "|---|---:|---:|---|---|---:|---:|",
    ]
    for x in r["rows"]:
        share = "-" if x["later_cached_share"] is None else f"{100 * x['later_cached_share']:.1f}%"
        lines.append(
            f"| {x['server']} | {x['concurrency']} | {x['tok_s']:,.1f} | {x['turn1_ttft_p50_ms']:,.0f} / {x['turn1_ttft_p95_ms']:,.0f} | "
            f"{x['later_ttft_p50_ms']:,.0f} / {x['later_ttft_p95_ms']:,.0f} | {share} | {x['turn1_prompt_tokens']:,} |"
        )
    notes = [
        f"- {q['concurrency']} at a time, {q['server']}: tok/s {q['tok_s_over_vllm_mlx']:.2f}x vllm-mlx's; first token p50 "
        f"{q['turn1_ttft_p50_over_vllm_mlx']:.2f}x its on turn 1, {q['later_ttft_p50_over_vllm_mlx']:.2f}x on turns 2+."
        for q in r["ratios"]
    ]
    text = "\n".join(lines) + "\n\n" + "\n".join(notes) + ("\n" if notes else "")
    if r["long"]:
        text += (
            "\n| server | long prompts at once | prompt tokens | client idle timeout s | slowest first token s | prefill outlasted the timeout | re-sends |\n"
            "|---|---:|---:|---:|---:|---|---:|\n"
        )
        for x in r["long"]:
            text += (
                f"| {x['server']} | {x['requests']} | {_count(max(x['prompt_tokens']))} | {x['idle_timeout_s']:g} | {x['ttft_max_s']:,.1f} | "
                f"{'yes' if x['outlasted'] else 'no'} | {x['resends']} |\n"
            )
    failed = "".join(f"\n- {name}: {why.splitlines()[0][:400]}" for name, why in r.get("failed", {}).items())
    return text + failed + ("\n" if failed else "")


HEAD = """## {title}

`{command}`; JSON in `{json}`. {where}: the {model} model; {label}'s recorded first request
(tests/fixtures/agents/) brought to ~{prompt_tokens:,} tokens by project notes, {turns} turns per
conversation each resending the whole history ({route}, streamed{extra}), {concurrency} conversations at
a time, {per_slot} per client one after the other, {tokens} tokens a turn, temperature {temperature}.
{mode} First token: request sent to its first text delta; the cache share is usage's
{cache_field} over turns 2+'s whole prompt, of the last round. {long}

"""


def markdown(r: dict, json_path: Path) -> str:
    try:
        where_path = json_path.resolve().relative_to(ROOT)
    except ValueError:
        where_path = json_path
    shape = r["shape"]
    long = ""
    if r["long"]:
        long = (
            f"Then {r['long_concurrency']} requests of ~{r['long_prompt_tokens']:,} tokens at once, new to every cache, from a client "
            f"that sends a request again after {r['idle_timeout_s']:g} s without a byte (the CLIs' 300 s, scaled to this machine's prefill)."
        )
    return HEAD.format(
        title=r["section"],
        command=r["command"],
        json=where_path,
        where=r["where"],
        model=r["model"],
        label=LABEL[shape],
        prompt_tokens=r["prompt_tokens_target"],
        turns=r["turns"],
        route=clis.ROUTES[shape],
        extra=", a fresh billing hash on every request" if shape == "claude-code" else ", `prompt_cache_key` the conversation's id",
        concurrency=" and ".join(str(n) for n in r["concurrency"]),
        per_slot=r["per_slot"],
        tokens=r["tokens"],
        temperature=r["temperature"],
        mode="Every server up at once, the cells in turns." if r["interleaved"] else "Each server alone, one after the other.",
        cache_field="`cache_read_input_tokens`" if shape == "claude-code" else "`input_tokens_details.cached_tokens`",
        long=long,
    ) + render(r)


def main(a: argparse.Namespace, argv: list[str]) -> int:
    if a.render is not None:
        r = json.loads(a.render.read_text())
        print(render(r))
        if a.markdown is not None:
            agent.write_section(a.markdown, a.section or r["section"], markdown(r, a.render))
            print(f"wrote {a.markdown}")
        return 0
    known = [*agent.SERVERS, *peers_bench.ORCHARDS]
    unknown = set(a.servers.split(",")) - set(known)
    if unknown:
        raise SystemExit(f"unknown servers {sorted(unknown)}: from {', '.join(known)}")
    os.environ["RAY_worker_niceness"] = str(a.ray_worker_niceness)  # noqa: SIM112  (as bench.peers.agent)
    serve_bench.TEMPERATURE = a.temperature
    prepare(a.models_dir, {a.model}, log=lambda *_: None)
    path = (a.models_dir / a.model).resolve()
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path)
    a.project = clis.notes(a.shape, tokenizer.encode, a.prompt_tokens)
    a.long_project = clis.notes(a.shape, tokenizer.encode, a.long_prompt_tokens) if a.long_prompt_tokens > 0 else ""
    keys = ["warm", *(str(r) for r in range(a.rounds))]
    tags = {(k, n): f"Session {k}-{n}." for k in keys for n in a.concurrency}
    raw, failed = agent.cells(a, path, tags, run=run_cell, last=long_run(a))
    rows, ratios, longs = summarize(raw, a.concurrency, a.servers.split(","))
    where, _ = peers_bench.where()
    import mlx.core as mx

    device = agent._card(mx) if mx.default_device() == mx.gpu else "this machine, CPU"
    result = {
        "command": "python -m bench.peers --agent " + " ".join(x for x in argv if x != "--agent"),
        "section": a.section or f"{LABEL[a.shape]}-shaped conversations ({device}, {a.model})",
        "where": where[0].upper() + where[1:],
        "shape": a.shape,
        "model": a.model,
        "prompt_tokens_target": a.prompt_tokens,
        "concurrency": a.concurrency,
        "per_slot": a.per_slot,
        "turns": a.turns,
        "tokens": a.tokens,
        "temperature": a.temperature,
        "rounds": a.rounds,
        "interleaved": a.interleave,
        "long_prompt_tokens": a.long_prompt_tokens,
        "long_concurrency": a.long_concurrency,
        "idle_timeout_s": a.idle_timeout_s,
        "rows": rows,
        "ratios": ratios,
        "long": longs,
        "raw": raw,
        "failed": failed,
        "machine": {"python": platform.python_version(), "cores": os.cpu_count(), "mlx": mx.__version__, "device": str(mx.default_device())},  # type: ignore[attr-defined]
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    a.json.with_suffix(".partial.json").unlink(missing_ok=True)
    print(render(result))
    print(f"wrote {a.json}")
    if a.markdown is not None:
        agent.write_section(a.markdown, result["section"], markdown(result, a.json))
        print(f"wrote {a.markdown}")
    return 0
