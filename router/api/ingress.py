"""The ingress replica's state, shared by every route: its lease client, its stream mux, its
settings. Serve makes one per replica process (router/api/app.py); routes get it through the
`current` dependency."""

import contextlib
import logging
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from deployments.wire.failure import OrchardError
from router.api.errors import for_principal
from router.api.keys import Principal
from router.protocols.openai import ChatCompletionRequest
from router.serving.counting import Counter
from router.serving.lease import Lease, Leases
from router.serving.stream_mux import StreamMux

# A streamed response whose client takes none of a write for this long ends (router/api/sse.py).
STREAM_WRITE_TIMEOUT_S = 30.0


class Ingress:
    def __init__(
        self,
        residency: Any,
        chunk_timeout_s: float = 60.0,
        principals: list[Principal] | None = None,
        *,
        allow_remote_images: bool = False,
        max_audio_bytes: int = 25 * 1024**2,
        route_linger_s: float = 2.0,
        prefix_affinity_max_extra_in_flight: int = 4,
        gil_switch_ms: float | None = None,
        stream_write_timeout_s: float = STREAM_WRITE_TIMEOUT_S,
    ):
        if gil_switch_ms is not None:
            # How soon Ray's threads (a submit going out, a channel's batch coming in) get the GIL
            # from the event loop that carries every stream; Python's default is 5 ms.
            sys.setswitchinterval(gil_switch_ms / 1000.0)
        self.residency = residency
        self.leases = Leases(
            residency, holder=f"ingress-{uuid.uuid4().hex[:8]}", linger_s=route_linger_s, max_extra_in_flight=prefix_affinity_max_extra_in_flight
        )
        self.mux = StreamMux()
        self.counter = Counter(residency)
        self.chunk_timeout_s = chunk_timeout_s
        self.principals = list(principals or [])
        if not self.principals:
            logging.getLogger("orchard.ingress").warning("no API keys configured: every route is open to whoever reaches this address")
        self.allow_remote_images = allow_remote_images
        self.max_audio_bytes = max_audio_bytes
        self.stream_write_timeout_s = stream_write_timeout_s
        install(self)

    @contextlib.asynccontextmanager
    async def hold(self, who: Principal, model: str, reserve_tokens: int = 0, prefix: tuple[int, ...] = ()) -> AsyncIterator[Lease]:
        """A lease on `model` for `who` (router.serving.lease), counted against the key's limits with
        `reserve_tokens` held until it ends (end it early with `lease.release(used_tokens)` to count
        what the request really used); `prefix`: the request's prefix keys (router.serving.affinity),
        so it goes where its prompt's beginning went before; a model the key may not use is a 404. Whatever fails while
        it is held reaches the client as `who` may read it (router.api.errors.for_principal)."""
        with seen_by(who, model):
            async with self.leases.hold(model, who.tenant(), reserve_tokens, prefix) as lease:
                yield lease

    async def count_tokens(self, who: Principal, chat: ChatCompletionRequest) -> int:
        """`chat`'s prompt tokens on its model, without a lease (router/serving/counting.py): nothing
        is loaded for a count. A model the key may not use is a 404, as for a lease."""
        with seen_by(who, chat.model):
            return await self.counter.count(chat, who.tenant(), allow_remote_images=self.allow_remote_images)

    def close(self) -> None:
        """The replica is shutting down: close every channel (each actor cancels what was open)."""
        with contextlib.suppress(Exception):
            self.mux.close()
        if self.leases.standing is not None:
            with contextlib.suppress(Exception):
                self.leases.standing.close()


@contextlib.contextmanager
def seen_by(who: Principal, model: str) -> Iterator[None]:
    """Refuse a model the key may not use (404); whatever fails inside reaches the client as `who`
    may read it (router.api.errors.for_principal)."""
    if not who.may_use(model):
        raise OrchardError("model_not_found", f"model {model!r} is not in the registry", "model")
    try:
        yield
    except OrchardError as e:
        shown = for_principal(e, who.admin, model)
        if shown is e:
            raise
        raise shown from None


_CURRENT: list[Ingress] = []


def install(ingress: Ingress) -> None:
    """Make `ingress` the one the routes of this process use (Serve runs one replica per process)."""
    _CURRENT[:] = [ingress]


async def current() -> Ingress:
    if not _CURRENT:
        raise OrchardError("unavailable", "the ingress is starting", retry_after_s=1)
    return _CURRENT[0]
