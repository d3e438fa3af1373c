"""What a loaded model holds, as its own process measured it (deployments/engines/measure.py): the
figures its reservation comes from once it has loaded, beside the folder's estimate of the same."""

from pydantic import Field

from policy._frozen import Frozen

KV_STEP = 256  # mlx-lm's KVCache grows its buffers this many tokens at a time


class CacheShape(Frozen):
    """A decoder's cache per sequence: bytes per token of the layers that grow with the context, of
    the sliding-window layers (which stop at `window_tokens`), and the fixed-size state; the layer
    count of each kind."""

    full_bytes_per_token: int = Field(default=0, ge=0)
    window_bytes_per_token: int = Field(default=0, ge=0)
    window_tokens: int = Field(default=0, ge=0)
    state_bytes: int = Field(default=0, ge=0)
    layers: dict[str, int] = Field(default_factory=dict)  # "full", "window", "state", "latent", "none"

    def sequence_bytes(self, tokens: int, chunk: int = 1) -> int:
        """What one sequence of `tokens` holds at most while it prefills in chunks of `chunk` tokens:
        full layers' buffers rounded up to mlx-lm's 256-token steps, windows up to W - 1 + chunk."""
        held = -(-tokens // KV_STEP) * KV_STEP if tokens else 0
        window = min(held, self.window_tokens + max(chunk, 1) - 1) if self.window_tokens else 0
        return self.full_bytes_per_token * held + self.window_bytes_per_token * window + self.state_bytes

    @property
    def bytes_per_token(self) -> int:
        """Per token at a context past every window: the full layers' (the registry's kv_bytes_per_token)."""
        return self.full_bytes_per_token


class MeasuredMemory(Frozen):
    """What a loaded model holds, measured (module docstring); `estimated_*`: the folder's figures
    for the same, side by side."""

    weights_hash: str = ""
    weight_bytes: int = Field(ge=0)
    cache: CacheShape
    activation_bytes: int = Field(ge=0)  # one prefill step at the reserved context
    activation_base_bytes: int = Field(default=0, ge=0)  # ... at context 0
    activation_bytes_per_token: float = Field(default=0.0, ge=0)  # ... its growth per token of context
    prefill_rows: int = Field(default=1, ge=1)
    prefill_chunk: int = Field(default=1, ge=1)
    decode_rows: int = Field(default=0, ge=0)  # a decode step's rows and tokens a row (1 + drafts) as measured; 0: not said
    decode_tokens: int = Field(default=0, ge=0)
    reserve_context_tokens: int = Field(ge=0)
    reserve_concurrency: int = Field(ge=1)
    prefix_cache_bytes: int = Field(default=0, ge=0)  # the kept prefixes' budget (X4 counts them apart)
    seconds: float = Field(default=0.0, ge=0)
    estimated_weight_bytes: int = Field(default=0, ge=0)
    estimated_cache: CacheShape | None = None
    # The activation passes not run yet (`activation_bytes` 0): the engine measures them once it has
    # been idle for a moment after the load (measure.py's `provisional`, rule M1). Never reused.
    provisional: bool = False

    @property
    def kv_reserved_bytes(self) -> int:
        return self.reserve_concurrency * self.cache.sequence_bytes(self.reserve_context_tokens, self.prefill_chunk)

    @property
    def reserved_bytes(self) -> int:
        """Weights, the KV reservation and one prefill step: what the model may hold beside its kept prefixes."""
        return self.weight_bytes + self.kv_reserved_bytes + self.activation_bytes

    @property
    def limit_bytes(self) -> int:
        return self.reserved_bytes + self.prefix_cache_bytes

    @property
    def estimated_kv_reserved_bytes(self) -> int:
        """The folder estimate's KV reservation at the same context and concurrency (0 without one)."""
        shape = self.estimated_cache
        return self.reserve_concurrency * shape.sequence_bytes(self.reserve_context_tokens, self.prefill_chunk) if shape else 0

    def sequence_bytes(self, tokens: int) -> int:
        return self.cache.sequence_bytes(tokens, self.prefill_chunk)

    def longest_sequence(self) -> int:
        """The most tokens one sequence may hold within its share of the KV reservation (one of
        `reserve_concurrency`): mlx-lm's batch caches are as long as their longest row for every
        row, so a longer row beside others would hold more than the whole reservation."""
        share = self.cache.sequence_bytes(self.reserve_context_tokens, self.prefill_chunk)
        low, high = max(0, self.reserve_context_tokens - 1), self.reserve_context_tokens + 1
        while self.sequence_bytes(high) <= share and high < 2**31:
            low, high = high, high * 2
        while high - low > 1:
            mid = (low + high) // 2
            low, high = (mid, high) if self.sequence_bytes(mid) <= share else (low, mid)
        return low
