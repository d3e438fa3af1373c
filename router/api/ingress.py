"""The ingress replica's state, shared by every route: its lease client, its stream mux, its
settings. Serve makes one per replica process (router/api/app.py); routes get it through the
`current` dependency."""

import contextlib
from typing import Any

from router.errors import OrchardError
from router.serving.lease import Leases
from router.serving.stream_mux import StreamMux


class Ingress:
    def __init__(
        self,
        residency: Any,
        chunk_timeout_s: float = 60.0,
        api_keys: list[str] | None = None,
        *,
        allow_remote_images: bool = False,
        max_audio_bytes: int = 25 * 1024**2,
    ):
        self.residency = residency
        self.leases = Leases(residency)
        self.mux = StreamMux()
        self.chunk_timeout_s = chunk_timeout_s
        self.api_keys = [k.encode() for k in api_keys or []]
        self.allow_remote_images = allow_remote_images
        self.max_audio_bytes = max_audio_bytes
        install(self)

    def close(self) -> None:
        """The replica is shutting down: close every channel (each actor cancels what was open)."""
        with contextlib.suppress(Exception):
            self.mux.close()


_CURRENT: list[Ingress] = []


def install(ingress: Ingress) -> None:
    """Make `ingress` the one the routes of this process use (Serve runs one replica per process)."""
    _CURRENT[:] = [ingress]


def current() -> Ingress:
    if not _CURRENT:
        raise OrchardError("unavailable", "the ingress is starting", retry_after_s=1)
    return _CURRENT[0]
