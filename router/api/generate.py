"""Text generation for every protocol, as each route reads it: lease, prepare, stream, render.

The route has parsed the body (FastAPI, typed) and picked the renderer of its protocol; this runs
the rest. A streamed request's deltas go out as they come (its channel, DeltaStream); a
non-streamed one is one call answered at its end (WholeGeneration). A request that fails before
any output raises (the protocol's error handler answers); one that fails after some output ends
its stream with the protocol's error event."""

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

from router import metrics
from router.api.bodies import json_body
from router.api.ingress import Ingress
from router.api.keys import Principal
from router.api.request_context import ARRIVED
from router.api.sse import event_stream
from router.protocols import openai as oai
from router.protocols.openai import DEFAULT_MAX_TOKENS
from router.serving.affinity import prefix_keys
from router.serving.generation import ChatOrCompletion, DeltaStream, WholeGeneration, prepare
from router.serving.output.parsing import OutputParser
from router.serving.renderers import Renderer
from router.serving.token_estimate import estimate_tokens

# A stream whose first delta takes longer (a long prompt being read) is answered at once, with
# keep-alives until it comes (router/api/sse.py); a quicker one's early failure stays an HTTP error.
KEEPALIVE_AFTER_S = 2.0


async def generate(
    ingress: Ingress, who: Principal, body: ChatOrCompletion, make_renderer: Callable[[OutputParser | None], Renderer], *, stream: bool
):
    entered = time.monotonic()
    async with ingress.hold(who, body.model, reserve_tokens(body), prefix_keys(body)) as lease:
        request, parser = prepare(lease, body, allow_remote_images=ingress.allow_remote_images)
        renderer = make_renderer(parser)
        arrived = ARRIVED.get() or entered
        if not stream:
            whole = WholeGeneration(lease, request, ingress.chunk_timeout_s)
            delta = await whole.run()
            timing = {"Server-Timing": server_timing(entered - arrived, whole.started - entered, whole.ttft_s or 0.0)}
            metrics.on_request(body.model, whole.ttft_s, whole.tokens, whole.elapsed_s())
            return json_body(renderer.respond([delta]), headers=timing)
        deltas = DeltaStream(ingress.mux, lease, request, ingress.chunk_timeout_s)
        pending = asyncio.ensure_future(deltas.first())
        try:
            await asyncio.wait({pending}, timeout=KEEPALIVE_AFTER_S)
        except asyncio.CancelledError:
            pending.cancel()
            raise
        first: Any = pending.result() if pending.done() else pending  # failed early: the protocol's HTTP error
        timing = {"Server-Timing": server_timing(entered - arrived, deltas.started - entered, deltas.ttft_s or 0.0)}
        lease.hand_off()  # the event stream ends it: closing `deltas` releases the lease
        return event_stream(first, deltas, renderer, body.model, who, write_timeout_s=ingress.stream_write_timeout_s, headers=timing)


def reserve_tokens(body: ChatOrCompletion) -> int:
    """What a generation holds of its key's tpm until it ends (then its real usage replaces it):
    the prompt's estimate plus the most it may generate."""
    return prompt_estimate(body) + (getattr(body, "max_completion_tokens", None) or body.max_tokens or DEFAULT_MAX_TOKENS)


def prompt_estimate(body: ChatOrCompletion) -> int:
    """The prompt's tokens before the model's tokenizer sees it: a token-id prompt's length, else
    `estimate_tokens` over every text the prompt is made of (messages, tool calls, tool schemas).
    Images are not estimated (the model's usage counts them when the request ends)."""
    if isinstance(body, oai.CompletionRequest):
        return len(body.prompt) if isinstance(body.prompt, list) else estimate_tokens(body.prompt)
    texts = []
    for message in body.messages:
        texts.append(message.text())
        if message.tool_calls:
            texts.append(json.dumps(message.tool_calls))
    if body.tools:
        texts.append(json.dumps([tool.model_dump(mode="json", exclude_none=True) for tool in body.tools]))
    return estimate_tokens(*texts)


def server_timing(app_s: float, lease_s: float, first_delta_s: float) -> str:
    """The W3C Server-Timing header of a generation (browsers' dev tools and load generators read
    it): `app`, from the request reaching the app to its route running (routing, the body parsed
    and validated, the key checked); `lease`, from there to sending it to its instance (the key's
    limits, routing, a cold load or a wait); `first-delta`, from there to the instance's first output."""
    return f"app;dur={1000 * app_s:.1f}, lease;dur={1000 * lease_s:.1f}, first-delta;dur={1000 * first_delta_s:.1f}"
