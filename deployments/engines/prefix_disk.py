"""The block prefix cache's disk tier: prompt prefixes that outlive their process.

A model that is evicted and loaded again (a swap, an idle unload, a restart) comes back with an
empty prefix cache, and a coding agent's next turn prefills its 20-60k tokens of system prompt, tools
and history again: tens of seconds on a Mac. Here every full block the memory cache makes
(prefix_cache.py) is also written to the node's disk, named by the chained hash of its tokens (the
hash of its parent's name and its own tokens, as the tree spells it), under a folder of the model's
identity: its weights (a digest of each safetensors file's header, size and first and last MiB), the
KV's form (bits, group size, dtype) and the block size. A prompt whose first blocks are not in memory
reads them back from disk before it is matched (`restore`), so the prefix it reuses is the same a
warm cache would give.

Files are written atomically (a temporary name, then a rename) and carry their own checksum (a
CRC-32 of their arrays), their model's identity and their tokens: a torn, foreign or colliding file is never used (it is
deleted). The tier has its own budget beside the model store (`budget_bytes`), across every model
server of the node: each write reserves its room in one total under a lock file, and the folder is
listed and trimmed (least recently used first) when that total would pass the budget, every RESCAN
writes, and when a tier opens (a restart). Only full blocks of plain KV caches live here (the memory cache
holds nothing else), so a restored prefix is exactly what a prefill would have made.

Conversions to and from NumPy run on the engine's MLX thread (`put`, `restore`); file writes on one
writer thread, so a write costs the engine a copy of the new blocks, not their I/O."""

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import queue
import threading
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from safetensors.numpy import load_file, save_file

log = logging.getLogger("orchard.engine")

DIR_NAME = ".prefixes"  # beside the model store's folders, not counted in its budget (cluster/store.py's PREFIXES)
SUFFIX = ".safetensors"
_SAMPLE = 1 << 20
RESCAN = 256  # a writer lists the tier's folder at least every this many blocks it writes
READ_RATE_WEIGHT = 0.2  # of each read in the moving average of the read-back rate
READ_PROBE_EVERY = 32  # a read passed up as too slow is made anyway once in this many


def default_dir() -> Path | None:
    """The node's tier: `<ORCHARD_STORE>/.prefixes` (the store's root, as the raylet's environment
    gives it), None where the node names no store."""
    store = os.environ.get("ORCHARD_STORE")
    return Path(store).expanduser() / DIR_NAME if store else None


def model_identity(path: str | Path, kv_bits: int | None, kv_group_size: int, block_tokens: int, dtype: str) -> str:
    """A digest of the weights as they are on disk (each safetensors file's header, size, first and
    last MiB: two random models of one shape differ there) and the KV's form."""
    sha = hashlib.sha256(json.dumps([kv_bits, kv_group_size, block_tokens, dtype]).encode())
    for file in sorted(Path(path).glob("*.safetensors")):
        size = file.stat().st_size
        sha.update(f"{file.name}:{size}".encode())
        with open(file, "rb") as f:
            sha.update(f.read(_SAMPLE))
            f.seek(max(0, size - _SAMPLE))
            sha.update(f.read(_SAMPLE))
    return sha.hexdigest()[:32]


def chain(parent: str, tokens: Sequence[int]) -> str:
    """A block's name: its parent's name and its own tokens, hashed."""
    return hashlib.sha256(parent.encode() + np.asarray(tokens, dtype=np.int64).tobytes()).hexdigest()[:40]


def _to_numpy(x: Any) -> tuple[list[np.ndarray], list[str]]:
    """An array or mx.quantize triple as NumPy arrays (bfloat16, which NumPy lacks, as its bits) and their dtypes."""
    arrays = list(x) if isinstance(x, tuple) else [x]
    out, dtypes = [], []
    for a in arrays:
        dtypes.append(str(a.dtype).removeprefix("mlx.core."))
        out.append(np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a))
    return out, dtypes


def _from_numpy(arrays: list[np.ndarray], dtypes: list[str]) -> Any:
    out = [mx.array(a).view(mx.bfloat16) if d == "bfloat16" else mx.array(a) for a, d in zip(arrays, dtypes, strict=True)]
    return tuple(out) if len(out) > 1 else out[0]


def _digest(arrays: dict[str, np.ndarray]) -> str:
    """A CRC-32 of the arrays: a torn or damaged file fails it (the identity and tokens in its header
    guard against another model's or prompt's), at a few GB/s where SHA-256 made reading a prefix
    back slower than prefilling it on an H100."""
    crc = 0
    for name in sorted(arrays):
        crc = zlib.crc32(name.encode(), crc)
        crc = zlib.crc32(np.ascontiguousarray(arrays[name]).data, crc)
    return f"{crc:08x}"


class DiskTier:
    """One model's blocks on the node's disk (see the module's docstring)."""

    def __init__(self, root: Path, identity: str, budget_bytes: int):
        self.root = root
        self.identity = identity
        self.budget_bytes = budget_bytes
        self.folder = root / identity
        self.folder.mkdir(parents=True, exist_ok=True)
        self.stats = {"disk_blocks_written": 0, "disk_blocks_restored": 0, "disk_blocks_refused": 0, "disk_write_errors": 0}
        self._read_rate: float | None = None  # bytes/s of recent reads back (a moving average)
        self._passed = 0  # reads passed up in a row because they would not pay
        self.per_token = 0.0  # bytes a token's KV takes in a block (seen at the first put or load)
        self._writes = 0  # blocks this tier wrote (the folder is listed again every RESCAN of them)
        # the engine's measured prefill rate (tokens/s; 0 before any): a prefix is read back only
        # where that is faster than prefilling it (an H100 prefills a 1B model's 20k tokens in 1.2 s)
        self.prefill_rate: Callable[[], float] | None = None
        self._queue: queue.Queue[tuple[str, tuple[int, ...], dict[str, np.ndarray], list[str]] | None] = queue.Queue(maxsize=4096)
        self._writer = threading.Thread(target=self._write_loop, name=f"prefix-disk-{identity[:8]}", daemon=True)
        self._writer.start()
        self.enforce()  # a restart finds the tier within its budget

    # ---- names -----------------------------------------------------------------------------
    def _file(self, key: str) -> Path:
        return self.folder / f"{key}{SUFFIX}"

    def has(self, key: str) -> bool:
        return self._file(key).is_file()

    # ---- writing (the MLX thread queues, the writer writes) ---------------------------------
    def put(self, key: str, tokens: tuple[int, ...], keys: Any, values: Any) -> None:
        """Keep a full block (evaluated arrays): copied to NumPy here, written by the writer thread.
        A full queue drops it (the disk is behind; the memory cache still has it)."""
        if self.has(key):
            return
        k, kd = _to_numpy(keys)
        v, vd = _to_numpy(values)
        arrays = {f"k{i}": a for i, a in enumerate(k)} | {f"v{i}": a for i, a in enumerate(v)}
        self.per_token = sum(a.nbytes for a in arrays.values()) / max(1, len(tokens))
        with contextlib.suppress(queue.Full):
            self._queue.put_nowait((key, tokens, arrays, kd + vd))

    def flush(self, timeout_s: float) -> bool:
        """Wait up to timeout_s for the queued blocks to be written (a stopping engine); whether all were."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        self._queue.put(None)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except OSError as e:  # a full disk, a removed folder: the block stays in memory only
                self.stats["disk_write_errors"] += 1
                log.warning("prefix tier %s: a block was not written: %s", self.folder, e)
            finally:
                self._queue.task_done()

    def _write(self, key: str, tokens: tuple[int, ...], arrays: dict[str, np.ndarray], dtypes: list[str]) -> None:
        nbytes = sum(a.nbytes for a in arrays.values())
        if nbytes > self.budget_bytes:
            return
        target = self._file(key)
        tmp = target.with_name(f".{key}.{os.getpid()}.tmp")
        meta = {"identity": self.identity, "tokens": json.dumps(list(tokens)), "dtypes": json.dumps(dtypes), "crc32": _digest(arrays)}
        self._reserve(nbytes)
        save_file(arrays, str(tmp), metadata=meta)
        os.replace(tmp, target)
        self.stats["disk_blocks_written"] += 1

    # ---- reading (the MLX thread) -------------------------------------------------------------
    def load(self, key: str, tokens: tuple[int, ...]) -> tuple[Any, Any] | None:
        """The block's keys and values, or None when it is not here or fails its checks (then it is
        deleted): another model's, other tokens under its name, a torn file."""
        path = self._file(key)
        started = time.monotonic()
        try:
            arrays = load_file(str(path))
            with open(path, "rb") as f:  # safetensors' header: 8 bytes of length, then JSON with the metadata
                header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
            meta = header.get("__metadata__") or {}
            if (
                meta.get("identity") != self.identity
                or json.loads(meta.get("tokens", "null")) != list(tokens)
                or meta.get("crc32") != _digest(arrays)
            ):
                raise ValueError("its identity, tokens or checksum do not match")
            dtypes = json.loads(meta["dtypes"])
        except FileNotFoundError:
            return None
        except Exception as e:  # torn, foreign, corrupt: never used
            self.stats["disk_blocks_refused"] += 1
            log.warning("prefix tier %s: %s refused: %s", self.folder, path.name, e)
            with contextlib.suppress(OSError):
                path.unlink()
            return None
        with contextlib.suppress(OSError):
            os.utime(path)  # recently used: the budget removes others first
        n = sum(1 for name in arrays if name.startswith("k"))
        keys = _from_numpy([arrays[f"k{i}"] for i in range(n)], dtypes[:n])
        values = _from_numpy([arrays[f"v{i}"] for i in range(len(arrays) - n)], dtypes[n:])
        self.stats["disk_blocks_restored"] += 1
        nbytes = sum(a.nbytes for a in arrays.values())
        rate = nbytes / max(time.monotonic() - started, 1e-6)
        self._read_rate = rate if self._read_rate is None else (1 - READ_RATE_WEIGHT) * self._read_rate + READ_RATE_WEIGHT * rate
        self.per_token = nbytes / max(1, len(tokens))
        return keys, values

    def worth_reading(self) -> bool:
        """Whether reading blocks back beats prefilling their tokens, at the rates measured here
        (until both are known: yes). Every READ_PROBE_EVERY-th read passed up is made anyway, so one
        slow read (a cold disk, a busy node) does not turn the tier off for the engine's life."""
        rate = self.prefill_rate() if self.prefill_rate is not None else 0.0
        if rate <= 0 or self.per_token <= 0 or self.read_bytes_per_s() / self.per_token > rate:
            self._passed = 0
            return True
        self._passed += 1
        if self._passed >= READ_PROBE_EVERY:
            self._passed = 0
            return True
        return False

    def read_bytes_per_s(self) -> float:
        """How fast blocks came back from disk here lately (checks included); 1 GiB/s before any did."""
        return self._read_rate if self._read_rate is not None else float(2**30)

    # ---- the budget -------------------------------------------------------------------------
    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(self.root / ".lock", "a+") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock, fcntl.LOCK_UN)

    def _reserve(self, nbytes: int) -> None:
        """Room for a block about to be written. Every writer of the node counts what it adds in one
        total (`.held`, under the lock), so the budget holds without listing the folder each write;
        the folder is listed (and trimmed) only when the total would pass the budget, when there is
        no total, or every RESCAN writes (a file deleted as refused, or by hand, leaves the total high)."""
        with self._locked():
            held = self._total()
            self._writes += 1
            if held is None or held + nbytes > self.budget_bytes or self._writes % RESCAN == 0:
                held = self._trim(nbytes)
            (self.root / ".held").write_text(str(held + nbytes))

    def _total(self) -> int | None:
        try:
            return int((self.root / ".held").read_text())
        except (OSError, ValueError):
            return None

    def enforce(self, room_for: int = 0) -> int:
        """Remove the least recently used blocks of every model on the node until the tier holds at
        most budget_bytes - room_for; returns the bytes removed."""
        with self._locked():
            before = tier_bytes(self.root)
            held = self._trim(room_for)
            (self.root / ".held").write_text(str(held))
        return before - held

    def _trim(self, room_for: int) -> int:
        """Under the lock: list every block of the node's tier and remove the least recently used
        until they hold at most budget_bytes - room_for; what they hold then."""
        files = []
        for path in self.root.glob(f"*/*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                st = path.stat()
                files.append((st.st_mtime, st.st_size, path))
        held = sum(size for _, size, _ in files)
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if held + room_for <= self.budget_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                held -= size
        return held


def tier_bytes(root: Path | None) -> int:
    """What a node's tier holds (its store report)."""
    if root is None or not root.is_dir():
        return 0
    return sum(p.stat().st_size for p in root.glob(f"*/*{SUFFIX}") if p.is_file())
