"""A model server's process before it holds a model: a spare (rule R1 in docs/residency.md) is a
ModelServer started ahead of demand, with the engines' imports done and the device set up, that
`take` turns into a model's server. What it reads as its entry and engine until then, and what its
start does."""

import ctypes
import ctypes.util
import gc
import os
import subprocess
import sys
import threading
from pathlib import Path

from deployments.manifest import ManifestEntry
from deployments.wire.reports import Health, MemoryReport

# What a spare (rule R1) reads as its entry until `take` gives it one.
SPARE_ENTRY = ManifestEntry(name="", kind="llm", path=".", weight_bytes=0, weights="real", architecture="none", source="spare")


class NoModel:
    """A spare's engine: no model yet, nothing running."""

    def health(self) -> Health:
        return Health(status="spare", kind="llm", model="", detail="a spare process: no model yet")

    def memory(self) -> MemoryReport:
        return MemoryReport(weight_bytes=0)

    def running_requests(self) -> int:
        return 0

    async def stop(self) -> None:
        return None


def keep_kernels() -> None:
    """MLX's CUDA kernels, compiled at a process's first use of each, go to a folder of the node's that
    outlives the process (`<ORCHARD_STORE>/.kernels`, unless MLX_PTX_CACHE_DIR says): a model server
    started later, or on a node rebooted since, does not compile what another already did (MLX's
    default is under /tmp). Set before MLX's first compilation; nothing on a Mac (Metal's are built in)."""
    store = os.environ.get("ORCHARD_STORE")
    if store and "MLX_PTX_CACHE_DIR" not in os.environ:
        os.environ["MLX_PTX_CACHE_DIR"] = str(Path(store).expanduser() / ".kernels")


def warm_up() -> None:
    """What a model server's start costs before any weights, for the kind most placements are: the
    LLM engine's imports (MLX, mlx-lm) and the device set up by a first evaluation. Another kind
    imports its own stack when the spare takes it (deployments.models.engine_class)."""
    from deployments.models import engine_class

    engine_class("llm")
    import mlx.core as mx

    mx.eval(mx.ones((8, 8)) @ mx.ones((8, 8)))


RECYCLE_MLX_BYTES = 16 * 2**20  # MLX arrays a stopped engine may leave behind in a process that becomes a spare again
# the names engines give their threads (deployments/worker.py, engines/llm.py, engines/prefix_disk.py)
ENGINE_THREADS = ("mlx-", "prep-", "prefix-disk-")


def left_behind() -> str | None:
    """What a stopped engine left in this process that keeps it from being a spare again (R1): MLX
    arrays past RECYCLE_MLX_BYTES once collected, or a thread of an engine's still running; None
    when nothing."""
    gc.collect()  # the stopped engine's model and caches, cycles included
    mx = sys.modules.get("mlx.core")
    if mx is not None:
        mx.clear_cache()
        if mx.get_active_memory() > RECYCLE_MLX_BYTES:
            return f"still holds {mx.get_active_memory() / 2**20:.0f} MiB of MLX arrays"
    left = sorted(t.name for t in threading.enumerate() if t.name.startswith(ENGINE_THREADS))
    return f"left threads running ({', '.join(left)})" if left else None


def give_back_heap() -> None:
    """Return the C heap's free pages to the system after an engine stopped: a model's load and
    its requests leave freed memory in the allocator's arenas, which the process's resident size
    still counts (on Linux glibc's malloc_trim; on macOS libmalloc's pressure relief of every zone)."""
    try:
        if sys.platform == "darwin":
            ctypes.CDLL(ctypes.util.find_library("System")).malloc_zone_pressure_relief(None, 0)
        elif (libc := ctypes.util.find_library("c")) is not None and hasattr(lib := ctypes.CDLL(libc), "malloc_trim"):
            lib.malloc_trim(0)
    except OSError:  # no such library here: the pages go back when the process exits
        pass


def process_bytes() -> int:
    """What this process holds of the memory its node's budget stands for (a spare's `spare_bytes`,
    what a released process holds until it exits: rules R1 and X1). On a Mac or a CPU node that
    is one pool, the process's resident memory. On CUDA the budget is the device's memory: what MLX
    holds there (its arrays and buffer cache) or, where the driver says more for this process (its
    context, the libraries' workspaces), that. A CUDA process's resident memory is host memory
    (1.6 GiB for an H100 model server after its release, the libraries mapped): not the device's."""
    mx = sys.modules.get("mlx.core")
    if mx is not None and mx.cuda.is_available():
        return max(mx.get_active_memory() + mx.get_cache_memory(), driver_bytes())
    import psutil

    return int(psutil.Process().memory_info().rss)


def driver_bytes(pid: int | None = None) -> int:
    """The device memory NVIDIA's driver counts for process `pid` (this one by default), 0 where
    nvidia-smi is missing or does not list it (a container's own process ids, say)."""
    pid = os.getpid() if pid is None else pid
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=10
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(
        int(used) * 2**20
        for found, _, used in (line.partition(",") for line in out.splitlines())
        if found.strip() == str(pid) and used.strip().isdigit()
    )
