"""`python -m bench.peers --agent --shape claude-code` (or `--shape codex`): conversations shaped as
the real coding-agent CLIs send them, from their recorded first requests (tests/fixtures/agents/,
written by tests/test_agent_clis.py from Claude Code 2.1.332 and Codex 0.171.0): the CLI's own system
prompt, tools and request fields, brought to `--prompt-tokens` (~20k) by project notes where a CLI
puts them (Claude Code: a CLAUDE.md `<system-reminder>` in the first user message; Codex: an AGENTS.md
user item), then several turns per conversation, each resending the whole history.

- Claude Code (Anthropic Messages, `/v1/messages`, streamed): every request opens its system prompt
  with the billing line `x-anthropic-billing-header: cc_version=2.1.332.<hash>; ...` with a fresh hash
  each time, as the CLI does; `metadata.user_id` carries the conversation's session id; the reply
  comes back as an assistant message of text blocks, then the next user message.
- Codex (Responses, `/v1/responses`, streamed, `store: false`): the whole input resent each turn, the
  response's output items appended as Codex appends them; `prompt_cache_key` is the conversation's id.

`max_tokens` (`max_output_tokens`) is `--tokens` rather than the CLI's 32000, so a random-weights
model's answer ends; every other recorded field is sent as recorded, to every server: a server that
refuses one is reported as failed. Per server: first token (request sent to the first text, thinking
or reasoning delta) p50 / p95 of turn 1 and of turns 2+, tok/s (completion tokens from usage over the
cell's wall time), and the share of turns 2+'s prompt that usage reports as read from cache
(`cache_read_input_tokens` over the whole prompt; `input_tokens_details.cached_tokens` over
`input_tokens`). "bare" is Orchard's LLMEngine in process, each request translated to the engine's
request by Orchard's own protocol code (router.protocols: the billing line stripped there too).

`--long-prompt-tokens N` (0: off) then sends `--long-concurrency` requests of ~N tokens at once, each
new to every cache, as a client with an idle timeout (`--idle-timeout-s`: no byte for that long and it
gives up and sends the request again, as Claude Code does after ~300 s and Codex after its
`stream_idle_timeout_ms`, 300 s): the benchmark's idle timeout is the CLI's 300 s scaled to this
machine's prefill. Counted: re-sends, and how long the slowest first token took against the timeout
(a prefill shorter than the timeout proves nothing)."""

import argparse
import asyncio
import copy
import json
import secrets
import statistics
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from bench.engine.agent import system_prompt, user_turn
from bench.peers.agent import engine_turn, turn
from bench.sse import Chunks
from deployments.engines.llm import LLMEngine
from deployments.wire.generation import GenerationRequest

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "agents"
RECORDED = {"claude-code": FIXTURES / "claude-code-2.1.332" / "00-v1_messages.json", "codex": FIXTURES / "codex-0.171.0" / "00-v1_responses.json"}
ROUTES = {"claude-code": "/v1/messages", "codex": "/v1/responses"}
BILLING = "x-anthropic-billing-header: cc_version=2.1.332.{hash}; cc_entrypoint=sdk-cli;"
CLAUDE_MD = (
    "<system-reminder>\nAs you answer the user's questions, you can use the following context:\n# claudeMd\n"
    "Contents of /work/project/CLAUDE.md (project instructions, checked into the codebase):\n\n{notes}\n</system-reminder>\n"
)
AGENTS_MD = "# AGENTS.md instructions for /work/project\n\n<INSTRUCTIONS>\n{notes}\n</INSTRUCTIONS>"


def recorded(shape: str) -> dict[str, Any]:
    return json.loads(RECORDED[shape].read_text())


def estimate_tokens(body: dict[str, Any], encode: Callable[[str], list[int]]) -> int:
    """The request's text and tools as JSON, tokenized: within ~10% of the templated prompt."""
    keys = ("system", "tools", "messages", "input", "instructions")
    return sum(len(encode(json.dumps(body[k], ensure_ascii=False))) for k in keys if k in body)


def notes(shape: str, encode: Callable[[str], list[int]], target: int) -> str:
    """Project notes (bench.engine.agent's rules and tool list) that bring the recorded request to
    ~`target` tokens; empty where it is that long already."""
    room = target - estimate_tokens(recorded(shape), encode)
    return system_prompt(encode, room) if room > 200 else ""


@dataclass
class Conversation:
    """One CLI session: the request fields it keeps, the history it resends."""

    shape: str
    body: dict[str, Any]  # the recorded request as this cell sends it, history aside
    number: int
    history: list[dict[str, Any]]
    session: str = field(default_factory=lambda: str(uuid.uuid4()))


def conversation(shape: str, tag: str, project: str, number: int, model: str, tokens: int, temperature: float) -> Conversation:
    """A new session of `shape` in this cell: the cell's tag opens the CLI's system prompt (no
    cell reuses another's prefix), the project notes sit where the CLI puts them, the first user
    text is this conversation's own. Conversations of a cell share the CLI's system prompt, tools and
    notes, as sessions of one project do."""
    body = recorded(shape)
    body.update(model=model, stream=True, temperature=temperature)
    if shape == "claude-code":
        body["max_tokens"] = tokens
        body["system"][1]["text"] = f"{tag} {body['system'][1]['text']}"
        first = body.pop("messages")
        blocks = list(first[0]["content"][:-1])
        if project:
            blocks.append({"type": "text", "text": CLAUDE_MD.format(notes=project)})
        blocks.append({"type": "text", "text": user_turn(number, 0)})
        history = [{"role": "user", "content": blocks}, *first[1:]]
        conv = Conversation(shape, body, number, history)
        body["metadata"] = {"user_id": json.dumps({"device_id": "bench", "account_uuid": "", "session_id": conv.session})}
        return conv
    body["max_output_tokens"] = tokens
    items = body.pop("input")
    items[0]["content"][0]["text"] = f"{tag} {items[0]['content'][0]['text']}"
    developer = [i for i in items if i.get("role") == "developer"]
    context = [i for i in items if i.get("role") != "developer"][:-1]  # the environment context; the user's text is this conversation's
    if project:
        developer.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": AGENTS_MD.format(notes=project)}]})
    history = [*developer, *context, {"type": "message", "role": "user", "content": [{"type": "input_text", "text": user_turn(number, 0)}]}]
    conv = Conversation(shape, body, number, history)
    body["prompt_cache_key"] = conv.session
    return conv


def request(conv: Conversation) -> dict[str, Any]:
    """The next request: the whole history, with a fresh billing hash (Claude Code) or this turn's ids (Codex)."""
    body = copy.deepcopy(conv.body)
    if conv.shape == "claude-code":
        body["system"][0] = {"type": "text", "text": BILLING.format(hash=secrets.token_hex(2)[:3])}
        body["messages"] = copy.deepcopy(conv.history)
        return body
    body["input"] = copy.deepcopy(conv.history)
    body["client_metadata"] = {"thread_id": conv.session, "turn_id": str(uuid.uuid4())}
    return body


def add_turn(conv: Conversation, reply: "Reply", next_user: str | None) -> None:
    """The reply appended as the CLI appends it, then the next user message (if any)."""
    if conv.shape == "claude-code":
        conv.history.append({"role": "assistant", "content": [{"type": "text", "text": reply.text or "."}]})
        if next_user is not None:
            conv.history.append({"role": "user", "content": [{"type": "text", "text": next_user}]})
        return
    conv.history.extend(reply.output)
    if next_user is not None:
        conv.history.append({"type": "message", "role": "user", "content": [{"type": "input_text", "text": next_user}]})


@dataclass
class Reply:
    """One turn as the client saw it."""

    ttft_s: float
    itl_s: float | None
    completion_tokens: int
    prompt_tokens: int
    cached_tokens: int | None  # None: the server does not report it
    text: str
    output: list[dict[str, Any]] = field(default_factory=list)  # Responses' output items
    resends: int = 0


class Idle(Exception):
    """No byte for the client's idle timeout."""


def reply(sent: float, first: float | None, last: float | None, completion: int, prompt: int, cached: int | None, text: str) -> Reply:
    return Reply(**asdict(turn(sent, first, last, completion, prompt, cached, text)))


async def _anthropic(lines: Chunks, sent: float) -> Reply:
    first = last = None
    text: list[str] = []
    usage: dict[str, Any] = {}
    stopped = False
    async for event in lines:
        kind = event.get("type")
        if kind == "error":
            raise RuntimeError(f"the stream failed: {event.get('error')}")
        if kind == "message_start":
            usage |= {k: v for k, v in (event["message"].get("usage") or {}).items() if v is not None}
        elif kind == "content_block_delta":
            delta = event["delta"]
            piece = delta.get("text") or delta.get("thinking") or delta.get("partial_json")
            if piece:
                last = time.perf_counter()
                first = first or last
                if delta.get("type") == "text_delta":
                    text.append(piece)
        elif kind == "message_delta":
            usage |= {k: v for k, v in (event.get("usage") or {}).items() if v is not None}
        elif kind == "message_stop":
            stopped = True
    if not stopped or "output_tokens" not in usage:
        raise RuntimeError("the stream ended without message_stop and its usage")
    cached = usage.get("cache_read_input_tokens")
    prompt = usage.get("input_tokens", 0) + (cached or 0) + (usage.get("cache_creation_input_tokens") or 0)
    return reply(sent, first, last, usage["output_tokens"], prompt, cached, "".join(text))


async def _responses(lines: Chunks, sent: float) -> Reply:
    first = last = None
    text: list[str] = []
    done: dict[str, Any] | None = None
    async for event in lines:
        kind = event.get("type", "")
        if kind in ("error", "response.failed"):
            raise RuntimeError(f"the stream failed: {event}")
        if kind in ("response.output_text.delta", "response.reasoning_text.delta", "response.reasoning_summary_text.delta"):
            if event.get("delta"):
                last = time.perf_counter()
                first = first or last
                if kind == "response.output_text.delta":
                    text.append(event["delta"])
        elif kind in ("response.completed", "response.incomplete"):
            done = event["response"]
    if done is None or not done.get("usage"):
        raise RuntimeError("the stream ended without response.completed and its usage")
    usage = done["usage"]
    cached = (usage.get("input_tokens_details") or {}).get("cached_tokens")
    r = reply(sent, first, last, usage["output_tokens"], usage["input_tokens"], cached, "".join(text))
    r.output = [{k: v for k, v in item.items() if k not in ("id", "status")} for item in done.get("output") or []]
    return r


class CLIClient:
    """Streamed requests of one shape to one server, made in the cell's event loop. With an idle
    timeout, a request that gets no byte for that long is sent again (`resends`), at most
    `max_resends` times, as the CLIs do."""

    def __init__(self, base: str, shape: str, idle_timeout_s: float | None = None, max_resends: int = 3):
        self.url = base + ROUTES[shape]
        self.parse = _anthropic if shape == "claude-code" else _responses
        self.idle_timeout_s, self.max_resends = idle_timeout_s, max_resends
        timeout = aiohttp.ClientTimeout(total=3600, sock_read=idle_timeout_s)
        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=timeout)
        self.headers = {"x-api-key": "unused", "anthropic-version": "2023-06-01"} if shape == "claude-code" else {"Authorization": "Bearer unused"}

    async def __call__(self, body: dict[str, Any]) -> Reply:
        started = time.perf_counter()
        for resends in range(self.max_resends + 1):
            sent = time.perf_counter()
            try:
                async with self.session.post(self.url, json=body, headers=self.headers) as response:
                    if response.status != 200:
                        raise RuntimeError(f"{self.url}: HTTP {response.status}: {(await response.text())[:500]}")
                    r = await self.parse(Chunks(response.content), sent)
            except (TimeoutError, aiohttp.ServerTimeoutError):
                continue  # the CLI's idle timeout: it gives up on this answer and sends the request again
            r.resends = resends
            r.ttft_s += sent - started  # from the first send
            return r
        raise RuntimeError(f"{self.url}: no byte for {self.idle_timeout_s} s, {self.max_resends + 1} times")

    async def close(self) -> None:
        await self.session.close()


def in_process(engine: LLMEngine, shape: str) -> Callable[[dict[str, Any]], Awaitable[Reply]]:
    """The same request through the engine in this process, translated by Orchard's protocol code."""
    from router.protocols import anthropic, openai, responses

    async def call(body: dict[str, Any]) -> Reply:
        if shape == "claude-code":
            chat = anthropic.to_chat_request(anthropic.parse_messages_request(body))
        else:
            chat = responses.to_chat_request(responses.parse_responses_request(body))
        r = Reply(**asdict(await engine_turn(engine, GenerationRequest(**openai.generation_fields(chat)))))
        if shape == "codex":
            r.output = [{"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": r.text, "annotations": []}]}]
        return r

    return call


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))]


def _stats(records: list[dict[str, Any]]) -> dict[str, Any]:
    ttfts = [r["ttft_s"] for r in records]
    prompt = sum(r["prompt"] for r in records)
    cached = None if any(r["cached"] is None for r in records) else sum(r["cached"] for r in records)
    return {
        "requests": len(records),
        "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1),
        "ttft_p95_ms": round(1000 * pct(ttfts, 0.95), 1),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "cached_share": None if cached is None or not prompt else round(cached / prompt, 4),
    }


async def cell(
    call: Callable[[dict[str, Any]], Awaitable[Reply]], shape: str, tag: str, project: str, n: int, a: argparse.Namespace, model: str
) -> dict:
    """`n` conversations at a time, `a.per_slot` each one after the other, `a.turns` turns each."""
    records: list[dict[str, Any]] = []
    started = time.perf_counter()

    async def one(c: int) -> int:
        conv = conversation(shape, tag, project, c, model, a.tokens, a.temperature)
        produced = 0
        for t in range(a.turns):
            r = await call(request(conv))
            produced += r.completion_tokens
            records.append({"turn": t, "ttft_s": r.ttft_s, "itl_s": r.itl_s, "prompt": r.prompt_tokens, "cached": r.cached_tokens})
            add_turn(conv, r, user_turn(c, t + 1) if t + 1 < a.turns else None)
        return produced

    async def client(k: int) -> int:
        return sum([await one(k + n * i) for i in range(a.per_slot)])

    produced = sum(await asyncio.gather(*(client(k) for k in range(n))))
    elapsed = time.perf_counter() - started
    itls = [r["itl_s"] for r in records if r["itl_s"] is not None]
    by_turn = [_stats([r for r in records if r["turn"] == t]) for t in range(a.turns)]
    return {
        "tok_s": round(produced / elapsed, 1),
        "seconds": round(elapsed, 2),
        "completion_tokens": produced,
        "itl_p50_ms": round(1000 * statistics.median(itls), 2) if itls else 0.0,
        "turn1": by_turn[0],
        "later": _stats([r for r in records if r["turn"] > 0]),
        "turns": by_turn,
    }


async def served_prompt(client: CLIClient, body: dict[str, Any]) -> int:
    """The prompt tokens a server reports for `body` sent whole (not streamed), one token asked: a
    server whose stream reports no prompt count (vllm-mlx's Messages stream says 0) says it here."""
    body = {**body, "stream": False, **({"max_tokens": 1} if "max_tokens" in body else {"max_output_tokens": 1})}
    async with client.session.post(client.url, json=body, headers=client.headers) as response:
        if response.status != 200:
            raise RuntimeError(f"{client.url}: HTTP {response.status}: {(await response.text())[:500]}")
        usage = (await response.json())["usage"]
    return int(usage["input_tokens"] + (usage.get("cache_read_input_tokens") or 0) + (usage.get("cache_creation_input_tokens") or 0))


async def long_prompts(call: CLIClient, shape: str, tag: str, project: str, a: argparse.Namespace, model: str) -> dict[str, Any]:
    """`a.long_concurrency` requests of ~`a.long_prompt_tokens` at once, each new to every cache."""
    replies = await asyncio.gather(
        *(call(request(conversation(shape, f"{tag}-{i}.", project, 1000 + i, model, a.tokens, a.temperature))) for i in range(a.long_concurrency))
    )
    return {
        "requests": len(replies),
        "prompt_tokens": [r.prompt_tokens for r in replies],
        "idle_timeout_s": a.idle_timeout_s,
        "ttft_max_s": round(max(r.ttft_s for r in replies), 2),
        "resends": sum(r.resends for r in replies),
        "outlasted": max(r.ttft_s for r in replies) > a.idle_timeout_s,
    }
