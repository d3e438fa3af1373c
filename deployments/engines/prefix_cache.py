"""A prefix cache that shares: the KV of every kept prompt lives once, in blocks of a tree.

mlx-lm's LRUPromptCache keeps one whole KV copy per entry, so a system prompt that a hundred
conversations begin with is stored once per conversation, and a few conversations evict each
other's histories (issue 27). Here a kept sequence is cut into blocks of `block_tokens` tokens; a
block is a node of a tree whose path from the root spells the tokens before it (vLLM hashes a block
with its prefix for the same reason; SGLang's radix tree shares the same way), and it holds its slice
of every layer's keys and values. Two sequences that begin alike share the blocks of their common
part, so the system prompt is stored once however many conversations use it, and each
conversation's turns add only their own blocks. A sequence's last, shorter block is kept too, as a
leaf, so a repeated prompt is reused whole; a longer block with the same start replaces it.

A block holds every layer's keys in one array (layers first) and every layer's values in another,
so that building a request's cache is one concatenation of its blocks for the keys and one for the
values, whatever the model's depth: a request's cache is built by concatenating its blocks along the
sequence axis (a copy: mlx-lm's batch merges every cache into its own arrays anyway, and the blocks
stay untouched by the request), and each layer's cache is a view of that copy. Stored a layer at a
time, a 3,000-token prefix of a 16-layer model in 128-token blocks took 768 copies to build, each
an operation of its own for MLX (on a GPU, a kernel launch and a node of MLX's CUDA graph); see
docs/engines.md for what that cost is known to be.

A request gets its longest cached prefix to the token: whole blocks down the tree, then the longest
common start with one child of the last one. Blocks are evicted least recently used first, leaves only,
whenever the kept bytes pass `max_bytes`; `shrink(target)` evicts down to any lower figure, so an
instance's cache can give memory back before a model is evicted for room.

Only models whose every layer cache is mlx-lm's plain `KVCache` can be cut into blocks: a rotating
(sliding-window) cache holds a window, not a prefix, and an SSM's state is one array for the whole
prefix. `sliceable` tells them apart; the engine keeps mlx-lm's LRUPromptCache for the rest.

With `kv_bits` (quantized_cache.py) the blocks hold the quantized keys and values as they are, each
an mx.quantize triple cut on the sequence axis like a plain array: a prefix is not quantized twice,
and the cache holds as many more tokens in `max_bytes` as the quantized cache does.

Every method runs on the engine's MLX thread (the arrays belong to its stream)."""

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache

from deployments.engines.block_rows import BlockKVCache, BlockQuantizedKVCache
from deployments.engines.prefix_disk import DiskTier, chain

# Keys (or values): one array, or mx.quantize's triple with kv_bits. A layer's are (1, heads,
# tokens, dim); a block's are every layer's stacked, (layers, 1, heads, tokens, dim). The sequence
# axis is the second last in both.
Kv = Any


def _cut(x: Kv, start: int, end: int | None = None) -> Kv:
    if isinstance(x, tuple):
        return tuple(a[..., start:end, :] for a in x)
    return x[..., start:end, :]


def _join(parts: list[Kv]) -> Kv:
    """Blocks' keys (or values) along the sequence axis, as one fresh array (or triple)."""
    if isinstance(parts[0], tuple):
        return tuple(mx.concatenate(list(p), axis=-2) if len(parts) > 1 else mx.array(p[0]) for p in zip(*parts, strict=True))
    return mx.concatenate(parts, axis=-2) if len(parts) > 1 else mx.array(parts[0])


def _stacked(per_layer: list[Kv]) -> Kv:
    """Every layer's slice as one fresh array (or triple), layers first: never a view of the
    request's arrays (a view would keep all of them alive)."""
    if isinstance(per_layer[0], tuple):
        return tuple(mx.stack(list(p)) for p in zip(*per_layer, strict=True))
    return mx.stack(per_layer)


def _layer(x: Kv, layer: int) -> Kv:
    """One layer's part of stacked keys (or values): a view (a slice; MLX copies for x[layer],
    an integer index, which is a gather)."""
    if isinstance(x, tuple):
        return tuple(a[layer : layer + 1].squeeze(0) for a in x)
    return x[layer : layer + 1].squeeze(0)


def _depth(x: Kv) -> int:
    return (x[0] if isinstance(x, tuple) else x).shape[0]


def _arrays(x: Kv) -> list[mx.array]:
    return list(x) if isinstance(x, tuple) else [x]


def sliceable(layer_caches: Sequence[Any]) -> bool:
    """Whether a model's fresh cache (mlx-lm's make_prompt_cache) can be cut into blocks."""
    return bool(layer_caches) and all(type(c) is KVCache for c in layer_caches)


@dataclass(eq=False)
class _Block:
    tokens: tuple[int, ...]
    parent: "_Block | None"
    keys: Kv = None  # every layer's, stacked: (layers, 1, heads, len(tokens), dim), or its triple
    values: Kv = None
    nbytes: int = 0
    children: dict[tuple[int, ...], "_Block"] = field(default_factory=dict)
    used: int = 0  # the cache's clock at its last use
    gone: bool = False
    key: str = ""  # its chained hash (the disk tier's name for it): its parent's and its tokens


def _common(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """The length of the common start of two blocks' tokens: a bisection over slice comparisons,
    which run in C (a lookup compares its block with every child where a conversation branches off)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    same, differ = 0, n
    while differ - same > 1:
        mid = (same + differ) // 2
        if a[:mid] == b[:mid]:
            same = mid
        else:
            differ = mid
    return same


class PrefixCache:
    """KV of kept token sequences, shared block by block (see the module's docstring)."""

    def __init__(
        self, block_tokens: int = 128, max_bytes: int = 512 * 2**20, kv_bits: int | None = None, kv_group_size: int = 64, disk: DiskTier | None = None
    ):
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be at least 1, not {block_tokens}")
        if max_bytes < 0:
            raise ValueError(f"max_bytes must not be negative, not {max_bytes}")
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self.kv_bits, self.kv_group_size = kv_bits, kv_group_size  # the blocks' form: what fetch gives back
        self._root = _Block(tokens=(), parent=None)
        self._clock = itertools.count(1)
        self._leaves: list[tuple[int, int, _Block]] = []  # (used, tie, block): a heap, stale entries skipped
        self._tie = itertools.count()
        self._blocks = 0
        self._bytes = 0
        self.disk = disk  # every full block is written there too, and read back by `restore` (prefix_disk.py)
        # what it did, for counters(): tokens given back, blocks made and evicted
        self.stats = {
            "prefix_lookups": 0,
            "prefix_hits": 0,
            "prefix_hit_tokens": 0,
            "prefix_blocks_added": 0,
            "prefix_blocks_evicted": 0,
            "prefix_restored_tokens": 0,  # read back from the disk tier (restore)
        }

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        """Blocks held."""
        return self._blocks

    # ---- lookup ----------------------------------------------------------------------------
    def _path(self, tokens: Sequence[int], limit: int) -> list[tuple[_Block, int]]:
        """The blocks of the longest cached prefix of tokens[:limit], each with how many of its
        tokens that prefix uses (all but maybe the last's)."""
        path: list[tuple[_Block, int]] = []
        node, at, size = self._root, 0, self.block_tokens
        while at < limit:
            want = tuple(tokens[at : min(at + size, limit)])
            child = node.children.get(want) if len(want) == size else None
            if child is not None:
                path.append((child, size))
                node, at = child, at + size
                continue
            best, n = None, 0
            for candidate in node.children.values():  # the one sharing the longest start with the rest
                common = _common(candidate.tokens, want)
                if common > n:
                    best, n = candidate, common
            if best is not None:
                path.append((best, n))
            break
        return path

    def restore(self, tokens: Sequence[int]) -> int:
        """Read back from the disk tier the full blocks of `tokens` that follow its longest prefix in
        memory, as far as the tier has them in a row (a block whose parent is not there cannot be
        reached); returns the tokens restored. Then `match` and `fetch` see them as any kept prefix.
        Nothing is read for a prompt whose blocks memory holds."""
        if self.disk is None or not self.disk.worth_reading():
            return 0
        node, at, size, restored = self._root, 0, self.block_tokens, 0
        now = next(self._clock)
        fresh: list[mx.array] = []
        while at + size <= len(tokens):
            want = tuple(tokens[at : at + size])
            child = node.children.get(want)
            if child is None:
                key = chain(node.key, want)
                found = self.disk.load(key, want) if self.disk.has(key) else None
                if found is None:
                    break
                child = self._attach(node, want, *found)
                fresh += _arrays(child.keys) + _arrays(child.values)
                restored += size
            child.used = now
            node, at = child, at + size
        if not restored:
            return 0
        self._push(node)
        mx.eval(fresh)
        self.shrink(self.max_bytes)
        self.stats["prefix_restored_tokens"] += restored
        return restored

    def match(self, tokens: Sequence[int]) -> int:
        """How many leading tokens of `tokens` are cached, found without copying anything."""
        return sum(n for _, n in self._path(tokens, len(tokens)))

    def fetch(self, tokens: Sequence[int], limit: int, min_tokens: int = 1) -> tuple[list[Any] | None, int]:
        """A fresh per-layer cache holding the longest cached prefix of tokens[:limit] and its
        length, or (None, 0) when fewer than `min_tokens` (at least 1) are cached. Its batch gives
        rows back to `insert` as views (block_rows.py)."""
        self.stats["prefix_lookups"] += 1
        path = self._path(tokens, max(0, min(limit, len(tokens))))
        reused = sum(n for _, n in path)
        if not path or reused < max(1, min_tokens):
            return None, 0
        now = next(self._clock)
        for block, _ in path:
            block.used = now
        self._push(path[-1][0])  # the path's leaf-most block; the others are inner or get pushed when they become leaves
        keys = _join([b.keys if n == len(b.tokens) else _cut(b.keys, 0, n) for b, n in path])
        values = _join([b.values if n == len(b.tokens) else _cut(b.values, 0, n) for b, n in path])
        layers: list[Any] = []
        for layer in range(_depth(keys)):
            cache = BlockKVCache() if self.kv_bits is None else BlockQuantizedKVCache(group_size=self.kv_group_size, bits=self.kv_bits)
            cache.keys, cache.values = _layer(keys, layer), _layer(values, layer)
            cache.offset = reused
            layers.append(cache)
        self.stats["prefix_hits"] += 1
        self.stats["prefix_hit_tokens"] += reused
        return layers, reused

    # ---- insertion -------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], layer_caches: Sequence[Any]) -> int:
        """Keep the KV of `tokens` (`layer_caches`: one mlx-lm KVCache, or QuantizedKVCache with
        kv_bits, per layer holding exactly their keys and values, as a finished request's is): only the blocks not held already are
        copied. Evicts down to max_bytes afterwards. Returns the bytes added."""
        n = min(len(tokens), min(c.offset for c in layer_caches))
        node, at, size, added = self._root, 0, self.block_tokens, 0
        now = next(self._clock)
        fresh: list[mx.array] = []
        written: list[_Block] = []  # full blocks made now: the disk tier keeps them too
        while at < n:
            block = tuple(tokens[at : min(at + size, n)])
            child = node.children.get(block)
            if child is None and len(block) < size:  # a short last block: kept unless a held block starts with it
                child = next((c for c in node.children.values() if c.tokens[: len(block)] == block), None)
            if child is None:
                child = self._block(node, block, layer_caches, at)
                fresh += _arrays(child.keys) + _arrays(child.values)
                added += child.nbytes
                if len(block) == size:
                    written.append(child)
            child.used = now
            node, at = child, at + len(child.tokens)
            if len(child.tokens) < size:
                break
        if node is not self._root:
            self._push(node)
        if fresh:
            mx.eval(fresh)  # the blocks own their memory now; the request's whole cache can go
            if self.disk is not None:
                for made in written:
                    self.disk.put(made.key, made.tokens, made.keys, made.values)
        self.shrink(self.max_bytes)
        return added

    def _block(self, parent: _Block, tokens: tuple[int, ...], layer_caches: Sequence[Any], at: int) -> _Block:
        end = at + len(tokens)
        keys = _stacked([_cut(c.keys, at, end) for c in layer_caches])
        values = _stacked([_cut(c.values, at, end) for c in layer_caches])
        return self._attach(parent, tokens, keys, values)

    def _attach(self, parent: _Block, tokens: tuple[int, ...], keys: Kv, values: Kv) -> _Block:
        """A block of `tokens` under `parent`: made from a request's cache, or read back from disk. A
        shorter last block it starts with adds nothing any more and goes."""
        for other in [c for c in parent.children.values() if len(c.tokens) < len(tokens) and tokens[: len(c.tokens)] == c.tokens and not c.children]:
            self._drop(other)
        block = _Block(tokens=tokens, parent=parent, keys=keys, values=values, key=chain(parent.key, tokens))
        block.nbytes = sum(a.nbytes for a in _arrays(keys) + _arrays(values))
        parent.children[tokens] = block
        self._blocks += 1
        self._bytes += block.nbytes
        self.stats["prefix_blocks_added"] += 1
        return block

    # ---- eviction --------------------------------------------------------------------------
    def _push(self, block: _Block) -> None:
        heapq.heappush(self._leaves, (block.used, next(self._tie), block))
        if len(self._leaves) > 4 * self._blocks + 64:  # stale entries pile up with every use: rebuild
            self._leaves = [(b.used, next(self._tie), b) for _, _, b in self._leaves if not b.gone and not b.children]
            self._leaves = list({id(e[2]): e for e in self._leaves}.values())
            heapq.heapify(self._leaves)

    def _drop(self, block: _Block) -> None:
        """Remove a leaf block; its parent may become a leaf itself."""
        parent = block.parent
        assert parent is not None and not block.children
        del parent.children[block.tokens]
        block.gone = True
        block.keys, block.values = None, None
        self._blocks -= 1
        self._bytes -= block.nbytes
        if parent is not self._root and not parent.children:
            self._push(parent)

    def shrink(self, target_bytes: int) -> int:
        """Evict least recently used leaf blocks until at most `target_bytes` are held; returns the
        bytes freed."""
        freed = 0
        while self._bytes > max(0, target_bytes) and self._leaves:
            used, _, block = heapq.heappop(self._leaves)
            if block.gone or block.children or used != block.used:
                continue  # stale: used again since, evicted already, or not a leaf now
            freed += block.nbytes
            self._drop(block)
            self.stats["prefix_blocks_evicted"] += 1
        return freed

    def clear(self) -> None:
        self.shrink(0)
