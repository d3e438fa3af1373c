"""How much of MLX's buffer cache an LLM engine keeps through mlx-lm's prefill.

mlx-lm's BatchGenerator calls `mx.clear_cache()` after every prefill chunk (and every 512 decode
steps), handing every cached buffer back to the device; the steps that follow allocate them again.
On an H200 that cost the engine in process at 64 streams 2 ms a step and 29% of the time to a first
token (TTFT p50 260.7 -> 186.3 ms with the calls skipped, bare's 123.8; docs/serve-path.md,
"Memory and caches"). Here `mlx_lm.generate` sees an `mlx.core` whose `clear_cache` clears only once the
cache holds more than the engines of this process keep (each its `prefill_cache_keep_mib`, by
default its KV reservation, which the residency policy already counts): short prompts' buffers stay
cached, a long prompt's large ones still go back. Nothing else in the process changes: the module
that mlx-lm's generate code reads `mx` from gets a copy of mlx.core's namespace with that one
function replaced, so every other name is mlx.core's own object."""

import contextlib
import sys
import threading
import types
from collections.abc import Iterator

import mlx.core as mx

_lock = threading.Lock()
_keep: dict[int, int] = {}  # id(engine) -> bytes it keeps cached


def keep(owner: object, nbytes: int) -> None:
    """`owner` (an engine) keeps up to `nbytes` of MLX's buffer cache through mlx-lm's prefill."""
    with _lock:
        _keep[id(owner)] = max(0, int(nbytes))
        _install()


def release(owner: object) -> None:
    with _lock:
        _keep.pop(id(owner), None)


@contextlib.contextmanager
def mlx_lm_own() -> Iterator[None]:
    """mlx-lm's own clearing while the block runs, whatever the engines of the process keep (a bare
    BatchGenerator beside an engine in one process: bench.engine.share's baseline)."""
    with _lock:
        saved = dict(_keep)
        _keep.clear()
    try:
        yield
    finally:
        with _lock:
            _keep.update(saved)


def kept_bytes() -> int:
    return max(_keep.values(), default=0)


def clear_past_keep() -> None:
    """mx.clear_cache(), unless the cache holds no more than the engines keep."""
    if mx.get_cache_memory() > kept_bytes():
        mx.clear_cache()


def _install() -> None:
    generate = sys.modules["mlx_lm.generate"]  # (the package's attribute of that name is a function)
    if getattr(generate.mx, "clear_cache", None) is clear_past_keep:
        return
    view = types.ModuleType(mx.__name__, mx.__doc__)
    view.__dict__.update({k: v for k, v in vars(mx).items() if k not in ("__name__", "__doc__")})
    view.clear_cache = clear_past_keep  # type: ignore[attr-defined]
    generate.mx = view  # type: ignore[attr-defined]
