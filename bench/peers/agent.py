"""`python -m bench.peers --agent` (or `python -m bench.peers.agent`): agent-shaped conversations
against Orchard and its peers over HTTP (issue 27 item 6), every server in one run. Each client runs
conversations over one long shared system prompt (instructions and a tool list, bench.engine.agent's),
turn after turn, each turn resending the whole history as a streamed chat completion with
`stream_options: {include_usage: true}`; `--concurrency` clients at a time, `--per-slot`
conversations each, one after the other. The servers are bench.peers' (started by its code): Orchard
on a one-node Ray cluster through its ingress replica's own port (direct ingress, as shipped),
vllm-mlx `--continuous-batching`, `mlx_lm.server`, and Orchard's LLMEngine bare in this process
(bench.engine.agent's runner: the same conversations through `generate()`, no Ray, no HTTP), the
baseline for ITL. Every server gets the same system prompt and user turns; each cell's system prompt
begins with its own session line, so no cell reuses what an earlier one left in a server's cache.

    python -m bench.peers --agent [--model llama-10m] [--concurrency 8 24] [--per-slot 2] [--turns 3]
        [--tokens 64] [--system-tokens 1200] [--temperature 1] [--rounds 1] [--interleave] [--warmup]
        [--servers orchard,vllm-mlx,mlx_lm.server,bare] [--json F] [--markdown docs/peers-benchmark.md]
    python -m bench.peers.agent --render bench/results/peers-agent.json --markdown docs/peers-benchmark.md

Per cell and server: tok/s (completion tokens over the cell's wall time), TTFT p50 / p90 of each turn
(request sent to its first content), ITL p50 (a turn's time from its first to its last content over
its tokens after the first, as usage counts them; the median over turns: coalesced SSE events count
as the tokens they carry), the prompt and cached tokens of each turn from usage
(`prompt_tokens_details.cached_tokens`, where the server reports it), the machine's load average,
and for Orchard and bare the engine's own counters (tokens prefilled, prefix-cache hits, decode ms a
step, rows a step, where first tokens waited). Prints a table, writes JSON
(bench/results/peers-agent.json) and, with --markdown, a section of that file (the rest kept)."""

import argparse
import asyncio
import contextlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

import bench.peers.__main__ as peers_bench
import bench.serve.__main__ as serve_bench
from bench.engine.agent import VARIANTS, system_prompt, user_turn
from bench.sse import Chunks
from deployments.engines.llm import LLMEngine
from deployments.models import prepare
from deployments.wire.generation import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
SERVERS = ["orchard", "vllm-mlx", "mlx_lm.server", "bare"]
PEERS = ["vllm-mlx", "mlx_lm.server"]


@dataclass
class Turn:
    """One turn as a client saw it."""

    ttft_s: float  # request sent -> first content
    itl_s: float | None  # (last content - first content) / (tokens - 1); None under 2 tokens
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None  # None: the server did not report it
    text: str


Chat = Callable[[list[dict], int], Awaitable[Turn]]  # (messages, max_tokens) -> the turn


class HTTPChat:
    """Streamed chat completions to one server (aiohttp, one json.loads per event, as bench.serve's
    SSEClient), made in the event loop of the cell that uses it."""

    def __init__(self, base: str, model: str, temperature: float):
        self.url = f"{base}/v1/chat/completions"
        self.model, self.temperature = model, temperature
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=1800))

    async def __call__(self, messages: list[dict], max_tokens: int) -> Turn:
        body = {
            "model": self.model,
            "messages": messages,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        sent = time.perf_counter()
        first = last = None
        text: list[str] = []
        usage: dict | None = None
        async with self.session.post(self.url, json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{self.url}: HTTP {response.status}: {await response.text()}")
            chunks = Chunks(response.content)
            async for chunk in chunks:
                if "error" in chunk:
                    raise RuntimeError(f"{self.url}: the stream failed: {chunk['error']}")
                content = chunk["choices"][0]["delta"].get("content") if chunk.get("choices") else None
                if content:
                    last = time.perf_counter()
                    first = first or last
                    text.append(content)
                if chunk.get("usage"):
                    usage = chunk["usage"]
        if not chunks.done or usage is None:
            raise RuntimeError(f"{self.url}: the stream ended without usage and [DONE]")
        details = usage.get("prompt_tokens_details") or {}
        return turn(sent, first, last, usage["completion_tokens"], usage["prompt_tokens"], details.get("cached_tokens"), "".join(text))

    async def close(self) -> None:
        await self.session.close()


def turn(sent: float, first: float | None, last: float | None, completion: int, prompt: int, cached: int | None, text: str) -> Turn:
    if first is None or last is None:  # an end of sequence sampled first (temperature 1): its first token is the end
        first = last = time.perf_counter()
    itl = (last - first) / (completion - 1) if completion > 1 else None
    return Turn(first - sent, itl, completion, prompt, cached, text)


async def engine_turn(engine: LLMEngine, request: GenerationRequest) -> Turn:
    """One request through the engine's own request API, in this process, timed as a client would."""
    sent = time.perf_counter()
    first = last = None
    text: list[str] = []
    usage = None
    async for d in engine.generate(request):
        if d.error:
            raise RuntimeError(f"the engine's generation failed: {d.error}")
        if d.text:
            last = time.perf_counter()
            first = first or last
            text.append(d.text)
        usage = d.usage or usage
    if usage is None:
        raise RuntimeError("the engine's generation ended without usage")
    return turn(sent, first, last, usage.completion_tokens, usage.prompt_tokens, usage.cached_tokens, "".join(text))


def in_process(engine: LLMEngine, temperature: float) -> Chat:
    """The same turn through the engine's own request API, in this process."""

    async def chat(messages: list[dict], max_tokens: int) -> Turn:
        return await engine_turn(engine, GenerationRequest(messages=list(messages), max_tokens=max_tokens, temperature=temperature))

    return chat


async def conversation(chat: Chat, system: str, c: int, turns: int, tokens: int, out: list[dict]) -> int:
    messages: list[dict] = [{"role": "system", "content": system}]
    produced = 0
    for t in range(turns):
        messages.append({"role": "user", "content": user_turn(c, t)})
        r = await chat(messages, tokens)
        produced += r.completion_tokens
        out.append({"turn": t, "ttft_s": r.ttft_s, "itl_s": r.itl_s, "prompt": r.prompt_tokens, "cached": r.cached_tokens})
        messages.append({"role": "assistant", "content": r.text})
    return produced


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


async def cell(chat: Chat, system: str, concurrency: int, per_slot: int, turns: int, tokens: int) -> dict[str, Any]:
    """`concurrency` clients, each running `per_slot` conversations one after the other."""
    records: list[dict] = []
    load_before = os.getloadavg()[0]
    started = time.perf_counter()

    async def client(k: int) -> int:
        return sum([await conversation(chat, system, k + concurrency * i, turns, tokens, records) for i in range(per_slot)])

    produced = sum(await asyncio.gather(*(client(k) for k in range(concurrency))))
    elapsed = time.perf_counter() - started
    by_turn = []
    for t in range(turns):
        rs = [r for r in records if r["turn"] == t]
        ttfts = [r["ttft_s"] for r in rs]
        itls = [r["itl_s"] for r in rs if r["itl_s"] is not None]
        cached = [r["cached"] for r in rs]
        by_turn.append(
            {
                "turn": t + 1,
                "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
                "ttft_p90_ms": round(1000 * pct(ttfts, 0.9), 1),
                "itl_p50_ms": round(1000 * statistics.median(itls), 2) if itls else None,
                "prompt_tokens": sum(r["prompt"] for r in rs),
                "cached_tokens": None if any(x is None for x in cached) else sum(cached),
            }
        )
    itls = [r["itl_s"] for r in records if r["itl_s"] is not None]
    return {
        "tok_s": round(produced / elapsed, 1),
        "seconds": round(elapsed, 2),
        "completion_tokens": produced,
        "itl_p50_ms": round(1000 * statistics.median(itls), 2),
        "itl_p90_ms": round(1000 * pct(itls, 0.9), 2),
        "turns": by_turn,
        "load_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],  # the machine's load average before and after
    }


def engine_window(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """What the engine's own counters say of one cell: tokens prefilled, reuse, pace of its steps,
    where a first token waited (means per request)."""

    def d(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    firsts = max(1.0, d("first_tokens"))
    steps = max(1.0, d("generation_steps"))
    return {
        "prefilled_tokens": int(d("prompt_tokens")),
        "padded_prefill_tokens": int(d("group_padded_tokens")),
        "prompt_time_s": round(d("prompt_time"), 2),
        "decode_time_s": round(d("decode_time"), 2),
        "decode_ms_per_step": round(1000 * d("decode_time") / steps, 2),
        "rows_per_step": round(d("generation_tokens") / steps, 2),
        "groups": int(d("admitted_groups")),
        "admit_wait_ms": round(1000 * d("admit_wait_s") / firsts, 1),
        "first_token_ms": round(1000 * d("first_token_s") / firsts, 1),
        "join_steps": round(d("join_steps") / firsts, 2),
        "prefix": {k: int(d(k)) for k in sorted(after) if k.startswith("prefix_")},  # the block cache's lookups, hits, blocks
    }


@dataclass
class Server:
    """A server of the run: a chat function made in a cell's event loop, and (Orchard, bare) a
    reading of its engine's counters."""

    name: str
    open_chat: Callable[[], tuple[Chat, Callable[[], Awaitable[None]]]]  # -> (chat, close)
    counters: Callable[[], Awaitable[dict[str, float]]] | None = None
    base: str | None = None  # an HTTP server's URL and the model name its requests carry (--shape)
    model: str | None = None
    engine: LLMEngine | None = None  # bare's engine


def run_cell(server: Server, system: str, concurrency: int, a: argparse.Namespace) -> dict[str, Any]:
    async def go() -> dict[str, Any]:
        chat, close = server.open_chat()
        try:
            before = await server.counters() if server.counters else None
            r = await cell(chat, system, concurrency, a.per_slot, a.turns, a.tokens)
            if before is not None and server.counters is not None:
                r["engine"] = engine_window(before, await server.counters())
            return r
        finally:
            await close()

    return asyncio.run(go())


def http_server(name: str, base: str, model: str, temperature: float, counters: Any = None) -> Server:
    def open_chat() -> tuple[Chat, Callable[[], Awaitable[None]]]:
        c = HTTPChat(base, model, temperature)
        return c, c.close

    return Server(name, open_chat, counters, base, model)


def units(wanted: list[str]) -> list[list[str]]:
    """The servers in the order asked, Orchard and its variants (bench.peers' ORCHARDS) as one unit:
    they share one local cluster, each variant an instance of its own under its own name."""
    orchards = [n for n in wanted if n in peers_bench.ORCHARDS]
    out: list[list[str]] = []
    for name in wanted:
        if name not in peers_bench.ORCHARDS:
            out.append([name])
        elif name == orchards[0]:
            out.append(orchards)
    return out


@contextlib.contextmanager
def started(names: list[str], a: argparse.Namespace, path: Path, home: str, failed: dict[str, str]) -> Iterator[list[Server]]:
    """One unit up (empty, with why in `failed`, when it did not start), each server warmed by one
    short turn."""
    name = names[0]
    if name == "bare":
        # as served (with the KV reservation bench.serve gives the model, for the CLIs' long prompts)
        # (none held otherwise: M4 off, as BatchGenerator runs)
        reserve: dict[str, Any] = serve_bench.OVERRIDES.get(path.name, {}) if getattr(a, "shape", "chat") != "chat" else {"reserve_context_tokens": 0}
        engine = LLMEngine(path.name, str(path), max_batch=max(64, *a.concurrency), **VARIANTS["blocks"], **reserve)
        asyncio.run(engine.load())
        try:

            async def counters() -> dict[str, float]:
                return engine.counters()

            server = Server("bare", lambda: (in_process(engine, a.temperature), _nothing), counters, engine=engine)
            _warm(server)
            yield [server]
        finally:
            asyncio.run(engine.stop())
        return
    if name in peers_bench.ORCHARDS:
        variants = {n: peers_bench.ORCHARDS[n] for n in names}
        rest = {json.dumps(peers_bench.without_llm_engine(v), sort_keys=True) for v in variants.values()}
        if len(rest) > 1:
            raise SystemExit(f"Orchard variants in one run may differ only in llm_engine, not {', '.join(names)}")
        common = peers_bench.without_llm_engine(variants[name])
        served = {n: f"{a.model}.{n}" if v.get("llm_engine") else a.model for n, v in variants.items()}
        aliases = {served[n]: (a.model, variants[n]["llm_engine"]) for n in names if served[n] != a.model}
        cluster, base = serve_bench.start_orchard(
            a.models_dir.resolve(), [a.model], peers_bench.without_via(common), common.get("via", "direct"), aliases=aliases
        )
        try:
            servers = []
            for n in names:
                server = http_server(n, base, served[n], a.temperature)
                _warm(server)  # the first request loads the instance
                server.counters = _actor_counters(served[n])
                servers.append(server)
            yield servers
        finally:
            serve_bench.stop_orchard(cluster)
        return
    peer = next(p for p in peers_bench.peers(path, a.vllm_mlx_site, home) if p.name == name)
    url = peers_bench.start_or_report(peer, failed)
    if url is None:
        failed[name] = f"did not start: {failed[name]}"
        yield []
        return
    try:
        server = http_server(name, url, peer.model, a.temperature)
        _warm(server)
        yield [server]
    finally:
        peer.stop()


async def _nothing() -> None:
    return None


def _warm(server: Server) -> None:
    async def go() -> None:
        chat, close = server.open_chat()
        try:
            await chat([{"role": "user", "content": "warm up"}], 4)
        finally:
            await close()

    asyncio.run(go())


def _actor_counters(model: str) -> Callable[[], Awaitable[dict[str, float]]] | None:
    """Orchard's engine counters, read from its model-server actor (None if it cannot be found)."""
    from cluster.model_servers import find_model_server

    try:
        actor = find_model_server(model, "head")
    except ValueError:
        return None

    async def counters() -> dict[str, float]:
        return await actor.counters.remote()

    return counters


Cell = Callable[[Server, str, int, argparse.Namespace], dict[str, Any]]


def cells(
    a: argparse.Namespace, path: Path, systems: dict[tuple[str, int], str], run: Cell = run_cell, last: Callable[[Server], dict | None] | None = None
) -> tuple[list[dict], dict[str, str]]:
    """Every wanted server's cells: one after the other (each server alone), or with --interleave all
    up at once and the cells in turns (each round, each concurrency, every server, the order rotated
    a step each round). --warmup: an untimed cell of each concurrency first (CUDA compiles kernels
    per shape). `run` runs a cell (run_cell: chat conversations); `last`, if given, runs once on each
    server after its cells (its result recorded as {"server", "last"})."""
    wanted = a.servers.split(",")
    out: list[dict] = []
    failed: dict[str, str] = {}
    partial = a.json.with_suffix(".partial.json")
    partial.parent.mkdir(parents=True, exist_ok=True)

    def one(server: Server, key: str, n: int) -> None:
        """One cell; a server whose cell fails (a 500, a stream cut short) is reported and left out
        of the cells after it, the others still run."""
        if server.name in failed:
            return
        try:
            r = run(server, systems[(key, n)], n, a)
        except (TimeoutError, RuntimeError, OSError, aiohttp.ClientError) as e:
            failed[server.name] = f"its {'warm-up' if key == 'warm' else f'round {int(key) + 1}'} cell of {n} at a time failed: {e}"
            print(f"  {server.name}: {failed[server.name]}", flush=True)
            return
        if key != "warm":
            out.append({"server": server.name, "concurrency": n, "round": int(key)} | r)
            partial.write_text(json.dumps(out, indent=1) + "\n")  # what a run cut off by a time limit still leaves
        ttft = " / ".join(f"{t['ttft_p50_ms']:.0f}" for t in r["turns"])
        print(
            f"  {key:>4} {server.name:14} {n:3} at a time: {r['tok_s']:8.1f} tok/s, TTFT p50 {ttft} ms, ITL p50 {r['itl_p50_ms']:.1f} ms", flush=True
        )

    def finish(server: Server) -> None:
        if last is None or server.name in failed:
            return
        try:
            r = last(server)
        except (TimeoutError, RuntimeError, OSError, aiohttp.ClientError) as e:
            failed[server.name] = f"its last step failed: {e}"
            print(f"  {server.name}: {failed[server.name]}", flush=True)
            return
        if r is not None:
            out.append({"server": server.name, "last": r})
            partial.write_text(json.dumps(out, indent=1) + "\n")

    with tempfile.TemporaryDirectory(prefix="orchard-peers-home-") as home:
        if not a.interleave:
            for unit in units(wanted):
                print(", ".join(unit), flush=True)
                with started(unit, a, path, home, failed) as servers:
                    for server in servers:
                        for n in a.concurrency:
                            for key in (["warm"] if a.warmup else []) + [str(r) for r in range(a.rounds)]:
                                one(server, key, n)
                        finish(server)
            return out, failed
        with contextlib.ExitStack() as up:
            servers = []
            for unit in units(wanted):
                print(f"starting {', '.join(unit)}", flush=True)
                servers += up.enter_context(started(unit, a, path, home, failed))
            for r, key in enumerate((["warm"] if a.warmup else []) + [str(r) for r in range(a.rounds)]):
                for n in a.concurrency:
                    for server in servers[r % len(servers) :] + servers[: r % len(servers)]:
                        one(server, key, n)
            for server in servers:
                finish(server)
    return out, failed


def summarize(raw: list[dict], concurrency: list[int], servers: list[str]) -> tuple[list[dict], list[dict]]:
    """Rows (medians over rounds per server and concurrency) and, per concurrency, the ratios of
    Orchard (and each variant) to the better peer (by tok/s), to vllm-mlx, and its ITL to bare's."""
    rows = []
    for n in concurrency:
        for s in servers:
            rs = [x for x in raw if x["server"] == s and x["concurrency"] == n]
            if not rs:
                continue
            turns = len(rs[0]["turns"])
            rows.append(
                {
                    "server": s,
                    "concurrency": n,
                    "rounds": len(rs),
                    "tok_s": round(statistics.median(x["tok_s"] for x in rs), 1),
                    "ttft_p50_ms": [round(statistics.median(x["turns"][t]["ttft_p50_ms"] for x in rs), 1) for t in range(turns)],
                    "ttft_p90_ms": [round(statistics.median(x["turns"][t]["ttft_p90_ms"] for x in rs), 1) for t in range(turns)],
                    "itl_p50_ms": round(statistics.median(x["itl_p50_ms"] for x in rs), 2),
                    "cached_tokens": [rs[-1]["turns"][t]["cached_tokens"] for t in range(turns)],
                    "prompt_tokens": [rs[-1]["turns"][t]["prompt_tokens"] for t in range(turns)],
                }
            )
    ratios = []
    for n, name in ((n, name) for n in concurrency for name in servers if name in peers_bench.ORCHARDS):
        by = {r["server"]: r for r in rows if r["concurrency"] == n}
        if name not in by:
            continue
        o = by[name]
        entry: dict[str, Any] = {"concurrency": n, "server": name}
        present = [p for p in PEERS if p in by]
        if present:
            best = max(present, key=lambda p: by[p]["tok_s"])
            entry["better_peer"] = best
            entry |= _against(o, by[best], "better_peer")
        if "vllm-mlx" in by:
            entry |= _against(o, by["vllm-mlx"], "vllm_mlx")
        if "bare" in by:
            entry["itl_over_bare"] = round(o["itl_p50_ms"] / by["bare"]["itl_p50_ms"], 3)
            entry["tok_s_over_bare"] = round(o["tok_s"] / by["bare"]["tok_s"], 3)
        ratios.append(entry)
    return rows, ratios


def _against(o: dict, p: dict, name: str) -> dict[str, Any]:
    return {
        f"tok_s_over_{name}": round(o["tok_s"] / p["tok_s"], 3),
        f"ttft_p50_over_{name}": [round(x / y, 3) for x, y in zip(o["ttft_p50_ms"], p["ttft_p50_ms"], strict=True)],
    }


def render(r: dict) -> str:
    turns = " / ".join(str(t + 1) for t in range(r["turns"]))
    lines = [
        f"| server | at a time | tok/s | TTFT p50 ms, turns {turns} | TTFT p90 ms | ITL p50 ms | cached / prompt tokens, turns {turns} |",
        "|---|---:|---:|---|---|---:|---|",
    ]
    for x in r["rows"]:
        cached = " / ".join(f"{'-' if c is None else f'{c:,}'}/{p:,}" for c, p in zip(x["cached_tokens"], x["prompt_tokens"], strict=True))
        lines.append(
            f"| {x['server']} | {x['concurrency']} | {x['tok_s']:,.1f} | {' / '.join(f'{v:,.0f}' for v in x['ttft_p50_ms'])} | "
            f"{' / '.join(f'{v:,.0f}' for v in x['ttft_p90_ms'])} | {x['itl_p50_ms']:.1f} | {cached} |"
        )
    notes = []
    for q in r["ratios"]:
        parts = []
        if "better_peer" in q:
            t = " / ".join(f"{v:.2f}" for v in q["ttft_p50_over_better_peer"])
            parts.append(f"tok/s {q['tok_s_over_better_peer']:.2f}x the better peer's ({q['better_peer']}), TTFT p50 {t}x its")
        if "tok_s_over_vllm_mlx" in q and q.get("better_peer") != "vllm-mlx":
            t = " / ".join(f"{v:.2f}" for v in q["ttft_p50_over_vllm_mlx"])
            parts.append(f"tok/s {q['tok_s_over_vllm_mlx']:.2f}x vllm-mlx's, TTFT p50 {t}x its")
        if "itl_over_bare" in q:
            parts.append(f"ITL p50 {q['itl_over_bare']:.2f}x bare's (tok/s {q['tok_s_over_bare']:.2f}x)")
        who = "Orchard" if q.get("server", "orchard") == "orchard" else q["server"]
        notes.append(f"- {q['concurrency']} at a time, {who}: " + "; ".join(parts) + ".")
    failed = "".join(f"\n- {name}: {why.splitlines()[0]}" for name, why in r.get("failed", {}).items())
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + failed + "\n"


SECTION_HEAD = """## {title}

`{command}`; JSON in `{json}`. {where}: the {model} model, a {system_tokens:,}-token shared
system prompt (bench.engine.agent's rules and tool list), {per_slot} conversation(s) of {turns} turns per
client one after the other, {tokens} tokens a turn, temperature {temperature}, each turn resending the
whole history as a streamed chat completion (usage included). {mode} Every server gets the same
prompts; each cell's system prompt opens with its own session line, so no cell reuses another's.
Orchard serves through its ingress replica's own port; vllm-mlx 0.6.0 runs `--continuous-batching
--completion-batch-size 64`, `mlx_lm.server` `--decode-concurrency 64`; "bare" is Orchard's LLMEngine in
the benchmark process, the same conversations through `generate()`. TTFT: a turn sent to its first
content; ITL: a turn's first to last content over its tokens after the first (usage's count), the median
over turns; cached: usage's `prompt_tokens_details.cached_tokens` summed over a turn's requests (- where
the server does not report it), of the last round. Load average (1 min) around the cells: {load}.

"""


def write_section(path: Path, title: str, text: str) -> None:
    """Replace the section `## title` of the Markdown file (up to the next `## `), or append it."""
    old = path.read_text() if path.exists() else "# Orchard against its peers\n"
    head = f"## {title}\n"
    if head in old:
        start = old.index(head)
        end = old.find("\n## ", start + len(head))
        new = old[:start] + text.rstrip("\n") + "\n" + (old[end:] if end >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + text
    path.write_text(new)


def markdown(r: dict, title: str, json_path: Path) -> str:
    mode = (
        "Every server is up at once and the cells take turns (`--interleave`), the order rotated each round."
        if r["interleaved"]
        else "Each server runs alone, one after the other."
    ) + (f" Median of {r['rounds']} rounds." if r["rounds"] > 1 else "")
    loads = [v for x in r["raw"] for v in x["load_1m"]]
    load = f"{min(loads):.1f}-{max(loads):.1f}" if loads else "-"
    try:
        where_path = json_path.resolve().relative_to(ROOT)
    except ValueError:
        where_path = json_path
    head = SECTION_HEAD.format(
        title=title,
        command=r["command"],
        json=where_path,
        where=r["where"],
        model=r["model"],
        system_tokens=r["system_tokens"],
        per_slot=r["per_slot"],
        turns=r["turns"],
        tokens=r["tokens"],
        temperature=r["temperature"],
        mode=mode,
        load=load,
    )
    return head + render(r)


def _card(mx: Any) -> str:
    """The GPU's short name ("H100", "H200"), from its device name ("NVIDIA H100 80GB HBM3")."""
    name = str(mx.device_info().get("device_name", "GPU"))
    words = [w for w in name.split() if w.upper() != "NVIDIA"]
    return words[0] if words else "GPU"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models-dir", type=Path, default=ROOT / "models")
    ap.add_argument("--model", default="llama-10m")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 24], help="conversations at a time (clients)")
    ap.add_argument("--per-slot", type=int, default=2, help="conversations each client runs, one after the other")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=64, help="max_tokens of every turn")
    ap.add_argument("--system-tokens", type=int, default=1200)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--interleave", action="store_true", help="every server up at once, the cells in turns (as bench.peers --interleave)")
    ap.add_argument("--warmup", action="store_true", help="an untimed cell of each concurrency first, on every server (GPU: kernels per shape)")
    ap.add_argument("--servers", default=",".join(SERVERS))
    ap.add_argument("--ray-worker-niceness", type=int, default=0, help="Ray's own default is 15: below the peers, on a shared machine")
    ap.add_argument("--vllm-mlx-site", type=Path, default=ROOT / ".peers" / "vllm-mlx")
    ap.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "peers-agent.json")
    ap.add_argument("--markdown", type=Path, default=None, help="write the table as a section of this file, the rest kept")
    ap.add_argument("--section", default=None, help="the section's title (default: the machine's)")
    ap.add_argument("--render", type=Path, default=None, help="only render this JSON (with --markdown: into that file)")
    ap.add_argument(
        "--shape", choices=["chat", "claude-code", "codex"], default="chat", help="the requests: chat completions, or a CLI's (bench/peers/clis.py)"
    )
    ap.add_argument("--prompt-tokens", type=int, default=20000, help="--shape: the first request brought to about this many tokens")
    ap.add_argument("--long-prompt-tokens", type=int, default=0, help="--shape: then requests of this many tokens new to every cache (0: none)")
    ap.add_argument("--long-concurrency", type=int, default=1, help="--shape: how many of them at once")
    ap.add_argument("--idle-timeout-s", type=float, default=10.0, help="--shape: their client's idle timeout (the CLIs': 300 s)")
    a = ap.parse_args(argv)
    if a.shape != "chat":
        from bench.peers.clis_run import main as clis_main

        return clis_main(a, argv if argv is not None else sys.argv[1:])
    if a.render is not None:
        r = json.loads(a.render.read_text())
        print(render(r))
        if a.markdown is not None:
            write_section(a.markdown, a.section or r["section"], markdown(r, a.section or r["section"], a.render))
            print(f"wrote {a.markdown}")
        return 0
    known = [*SERVERS, *peers_bench.ORCHARDS]
    unknown = set(a.servers.split(",")) - set(known)
    if unknown:
        ap.error(f"unknown servers {sorted(unknown)}: from {', '.join(known)}")
    # Ray starts its workers at niceness 15, Orchard's model server with them, and the peers run at
    # this process's: on a machine shared with other work (2 cores here) that alone would give the
    # peers the CPU first. Every server at one niceness unless asked otherwise.
    os.environ["RAY_worker_niceness"] = str(a.ray_worker_niceness)  # noqa: SIM112  (Ray reads RAY_<config name>)
    serve_bench.TEMPERATURE = a.temperature
    prepare(a.models_dir, {a.model}, log=lambda *_: None)
    path = (a.models_dir / a.model).resolve()
    from mlx_lm.utils import load_tokenizer

    tokenizer = load_tokenizer(path)
    shared = system_prompt(lambda s: tokenizer.encode(s), a.system_tokens)
    keys = ["warm", *(str(r) for r in range(a.rounds))]
    systems = {(k, n): f"Session {k}-{n}. {shared}" for k in keys for n in a.concurrency}
    uptime_before = _uptime()
    raw, failed = cells(a, path, systems)
    wanted = a.servers.split(",")
    rows, ratios = summarize(raw, a.concurrency, wanted)
    where, _ = peers_bench.where()
    import mlx.core as mx

    result = {
        "command": "python -m bench.peers --agent " + " ".join(argv if argv is not None else sys.argv[1:]),
        "section": a.section or f"Agent-shaped conversations ({_card(mx) if mx.default_device() == mx.gpu else 'this machine, CPU'})",
        "where": where[0].upper() + where[1:],
        # every server's process inherits this process's environment, and with it the MLX settings
        # Orchard's package sets on import (deployments/__init__.py): the peers run MLX as Orchard does
        "mlx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("MLX_")},
        "model": a.model,
        "system_tokens": len(tokenizer.encode(systems[("0", a.concurrency[0])])),
        "per_slot": a.per_slot,
        "turns": a.turns,
        "tokens": a.tokens,
        "temperature": a.temperature,
        "rounds": a.rounds,
        "interleaved": a.interleave,
        "warmup": a.warmup,
        "rows": rows,
        "ratios": ratios,
        "raw": raw,
        "failed": failed,
        "machine": {
            "python": platform.python_version(),
            "processor": platform.machine(),
            "cores": os.cpu_count(),
            "mlx": mx.__version__,  # type: ignore[attr-defined]
            "device": str(mx.default_device()),
            "uptime_before": uptime_before,
            "uptime_after": _uptime(),
            "ray_worker_niceness": a.ray_worker_niceness,
        },
    }
    a.json.parent.mkdir(parents=True, exist_ok=True)
    a.json.write_text(json.dumps(result, indent=2) + "\n")
    a.json.with_suffix(".partial.json").unlink(missing_ok=True)
    print(render(result))
    print(f"wrote {a.json}")
    if a.markdown is not None:
        write_section(a.markdown, result["section"], markdown(result, result["section"], a.json))
        print(f"wrote {a.markdown}")
    return 0


def _uptime() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/loadavg").read_text().strip()
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


if __name__ == "__main__":
    raise SystemExit(main())
