"""An LLM engine's kept prompt prefixes: which cache holds them, what a request gets back from it,
and what goes into it (a prompt once prefilled, a finished request's prompt and completion).

The block cache (prefix_cache.py, with its disk tier, prefix_disk.py) where every layer's cache is
mlx-lm's plain KVCache; mlx-lm's LRUPromptCache of whole entries for the rest (a sliding window or
an SSM's state is not a prefix that can be cut). A prefix is kept and reused only from
`prompt_cache_min_tokens`: reusing one copies the cached KV and merges a ragged cache into the
batch, and keeping one holds its KV; both cost more than prefilling a short prefix again.

Everything here that touches a cache runs on the engine's MLX thread."""

import logging
from pathlib import Path
from typing import Any, Protocol

from mlx_lm.models.cache import LRUPromptCache, can_trim_prompt_cache, make_prompt_cache, trim_prompt_cache

from deployments.engines import block_rows, buffer_cache, prefix_disk
from deployments.engines.prefix_cache import PrefixCache, sliceable
from deployments.engines.prefix_disk import DiskTier
from deployments.engines.quantized_cache import fresh_caches

logger = logging.getLogger("deployments.engines.llm")


class CacheSettings(Protocol):
    """What the keeping reads, live (the engine is one)."""

    name: str
    path: str
    prefix_cache: str
    prefix_block_tokens: int
    prompt_cache_bytes: int
    prompt_cache_min_tokens: int
    prefix_disk_bytes: int
    prefix_disk_dir: str | None
    kv_bits: int | None
    kv_group_size: int


class KeptPrefixes:
    """The engine's prompt cache and the rules of what it keeps and gives back."""

    def __init__(self, settings: CacheSettings, entries: int):
        self.settings = settings
        self.entries = entries  # 0: no prefix reuse; else the LRU cache's entries
        self.cache: PrefixCache | LRUPromptCache | None = None
        self.kind = settings.prefix_cache  # what the model allows: "blocks" or "lru"
        self.disk: DiskTier | None = None
        self.layers = 0

    def open(self, model: Any, prefill_rate: Any) -> None:
        """Shared blocks when every layer's cache is a plain KVCache; otherwise mlx-lm's whole-entry
        LRUPromptCache. `prefill_rate()`: prompt tokens a second the engine measured (the disk tier
        reads back only where that beats a prefill)."""
        s = self.settings
        fresh = make_prompt_cache(model)
        self.layers = len(fresh)
        self.kind = s.prefix_cache
        if s.prefix_cache == "blocks" and not sliceable(fresh):
            logger.info("%s: its KV cache cannot be cut into blocks; prefixes are reused whole (LRUPromptCache)", s.name)
            self.kind = "lru"
        if self.kind == "blocks":
            self.disk = self._disk_tier(prefill_rate)
            self.cache = PrefixCache(
                block_tokens=s.prefix_block_tokens, max_bytes=s.prompt_cache_bytes, kv_bits=s.kv_bits, kv_group_size=s.kv_group_size, disk=self.disk
            )
        else:
            self.cache = LRUPromptCache(max_size=max(1, self.entries), max_bytes=s.prompt_cache_bytes)

    def _disk_tier(self, prefill_rate: Any) -> DiskTier | None:
        """The block cache's disk tier, where a budget and a folder are given (prefix_disk.py)."""
        s = self.settings
        root = Path(s.prefix_disk_dir).expanduser() if s.prefix_disk_dir else prefix_disk.default_dir()
        if not s.prefix_disk_bytes or root is None or not Path(s.path).is_dir():
            return None
        identity = prefix_disk.model_identity(s.path, s.kv_bits, s.kv_group_size, s.prefix_block_tokens, "")
        try:
            tier = DiskTier(root, identity, s.prefix_disk_bytes)
        except OSError as e:  # an unwritable folder: the memory cache alone
            logger.warning("%s: no prefix disk tier at %s: %s", s.name, root, e)
            return None
        tier.prefill_rate = prefill_rate
        return tier

    def close(self, flush_s: float) -> None:
        """Free the kept KV (on the MLX thread, which made it); what is queued for the disk goes there first."""
        if self.disk is not None:
            self.disk.flush(flush_s)
            self.disk.close()
        self.cache = LRUPromptCache(max_size=1)

    @property
    def blocks(self) -> PrefixCache | None:
        """The block cache, where prefixes are reused through one."""
        return self.cache if isinstance(self.cache, PrefixCache) and self.entries > 0 else None

    @property
    def nbytes(self) -> int:
        return self.cache.nbytes if self.cache is not None else 0

    def stats(self) -> dict[str, float]:
        """The block cache's counters (lookups, hits, tokens given back, blocks made / evicted) and its disk tier's."""
        counted: dict[str, float] = dict(self.cache.stats) if isinstance(self.cache, PrefixCache) else {}
        if self.disk is not None:
            counted |= self.disk.stats  # blocks written, restored, refused
        return counted

    def match(self, tokens: list[int]) -> int:
        """How many leading tokens of a prompt the block cache holds, after reading back what the
        disk tier has of it (prefix_disk.py)."""
        blocks = self.blocks
        if blocks is None:
            return 0
        blocks.restore(tokens)
        return blocks.match(tokens)

    # ---- what a request gets back ----------------------------------------------------------
    def fetch(self, tokens: list[int], limit: int) -> tuple[list[Any] | None, int]:
        """A new row's cache (None: mlx-lm makes a plain one) and how many of `tokens` it holds:
        the longest cached prefix of at most `limit` tokens, from at least prompt_cache_min_tokens."""
        s = self.settings
        cache, rest = None, tokens
        if self.entries <= 0:
            pass
        elif isinstance(self.cache, PrefixCache):
            cache, reused = self.cache.fetch(tokens, limit=limit, min_tokens=s.prompt_cache_min_tokens)
            rest = tokens[reused:]
        elif isinstance(self.cache, LRUPromptCache) and self._reusable_prefix(tokens) >= max(1, s.prompt_cache_min_tokens):
            cache, rest = self.cache.fetch_nearest_cache(s.name, tokens)
        if cache is not None and not rest:  # at least one token is left to prefill: it gives the first logits
            if can_trim_prompt_cache(cache):
                trim_prompt_cache(cache, 1)
                rest = tokens[-1:]
            else:
                cache, rest = None, tokens
        cached = len(tokens) - len(rest)
        if cache is None and isinstance(self.cache, PrefixCache):  # a batch of rows it takes as views (block_rows.py)
            cache = block_rows.fresh(self.layers, s.kv_bits, s.kv_group_size)
        elif cache is None and s.kv_bits is not None:  # mlx-lm would make a plain one
            cache = fresh_caches(self.layers, s.kv_bits, s.kv_group_size)
        return cache, cached

    def _reusable_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the LRU cache could give back, found without copying anything
        (fetch_nearest_cache's own trie search; mlx-lm is pinned); all of them if unknown."""
        search = getattr(getattr(self.cache, "_trie", None), "search", None)
        if search is None:
            return len(tokens)
        found = search(self.settings.name, tokens)
        if found.exact is not None:
            return len(tokens)
        longer = min(len(tokens) - 1, found.common_prefix) if found.longer is not None else 0
        return max(len(found.shorter or ()), longer)

    # ---- what is kept ------------------------------------------------------------------------
    def worth_keeping(self, tokens: int, cached: int) -> bool:
        """A prompt of `tokens` is kept at its first token when it is long enough to be kept at all
        and adds at least a block to the `cached` the cache gave it."""
        s = self.settings
        return self.blocks is not None and tokens >= s.prompt_cache_min_tokens and tokens - cached >= s.prefix_block_tokens

    def keep_prompts(self, generator: Any, uids: list[int]) -> None:
        """The prompts of rows that just made their first token into the block cache (only the blocks
        it lacks are copied), so arrivals that begin alike reuse them while these rows still decode."""
        if not uids or not isinstance(self.cache, PrefixCache):
            return
        for layers, tokens in generator.extract_cache(uids).values():
            self.cache.insert(tokens, layers)

    def keep_finished(self, tokens: list[int], layer_caches: list[Any] | None) -> None:
        """A finished request's prompt and completion (`tokens`, its row's cache)."""
        if layer_caches is None or self.entries <= 0 or len(tokens) < self.settings.prompt_cache_min_tokens:
            return
        if isinstance(self.cache, PrefixCache):
            self.cache.insert(tokens, layer_caches)  # copies only the blocks it lacks
        elif isinstance(self.cache, LRUPromptCache):
            self.cache.insert_cache(self.settings.name, tokens[:], layer_caches, cache_type="assistant")

    def shrink(self, target_bytes: int) -> int:
        """Evict kept prefixes, least recently used first, down to `target_bytes`; returns the bytes freed."""
        cache = self.cache
        if cache is None:
            return 0
        before = cache.nbytes
        if isinstance(cache, PrefixCache):
            cache.shrink(target_bytes)
        else:
            cache.trim_to(n_bytes=target_bytes)
        freed = before - cache.nbytes
        if freed:
            buffer_cache.clear_past_keep()
        return freed
