"""One dedicated thread for all of an engine's MLX work.

MLX streams are thread-local: a model, its caches and its generation stream must be used from the
thread that made them. Every engine owns one MLXWorker and runs every MLX call through it."""

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class MLXWorker:
    def __init__(self, name: str):
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"mlx-{name}")
        self._thread_id: int | None = None
        self._executor.submit(self._remember_thread).result()

    def _remember_thread(self) -> None:
        self._thread_id = threading.get_ident()

    @property
    def on_worker(self) -> bool:
        return threading.get_ident() == self._thread_id

    def submit(self, fn: Callable[..., T], *args: Any):
        """A concurrent.futures.Future for fn(*args) on the worker thread."""
        return self._executor.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Await fn(*args) run on the worker thread."""
        return await asyncio.wrap_future(self._executor.submit(fn, *args))

    def shutdown(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)
