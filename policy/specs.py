"""What a model asks of the cluster: its kind, its memory, and the operator's wishes for it."""

from typing import Literal

from pydantic import ByteSize, Field, model_validator

from policy._frozen import Frozen

ModelKind = Literal["llm", "vlm", "embedding", "rerank", "stt", "tts"]
DeviceKind = Literal["metal", "cuda", "cpu"]
Role = Literal["primary", "utility"]

MODEL_KINDS: tuple[ModelKind, ...] = ("llm", "vlm", "embedding", "rerank", "stt", "tts")
DEVICE_KINDS: tuple[DeviceKind, ...] = ("metal", "cuda", "cpu")


class ModelSpec(Frozen):
    """One registry entry. Memory is reserved as weights + KV for the reserved context and concurrency
    + a per-instance overhead, so admission counts what the instance will really hold, not a slot."""

    name: str = Field(min_length=1)
    kind: ModelKind
    # Sizes take integers or strings such as "4.5GiB" or "160KiB".
    weight_bytes: ByteSize
    # What the instance's KV cache holds per token: with a quantized cache (an LLM's kv_bits) the
    # registry gives the quantized size (deployments/estimate.py), so the reservation below shrinks
    # with it and a node holds more instances.
    kv_bytes_per_token: ByteSize = ByteSize(0)
    # Layers that hold less than the context (docs/residency.md, M1): sliding windows hold at most
    # `kv_window_tokens` tokens of `kv_window_bytes_per_token`; fixed-size state (linear attention,
    # SSMs) holds `kv_state_bytes` per sequence whatever its length.
    kv_window_bytes_per_token: ByteSize = ByteSize(0)
    kv_window_tokens: int = Field(default=0, ge=0)
    kv_state_bytes: ByteSize = ByteSize(0)
    # One prefill or decode step's activations at the reserved context, as the engine measured them
    # (0 before a load: the overhead covers them).
    activation_bytes: ByteSize = ByteSize(0)
    reserve_context_tokens: int = Field(default=4096, ge=0)
    reserve_concurrency: int = Field(default=1, ge=1)
    # None: use PolicyConfig.instance_overhead_bytes (process, imports, activations).
    overhead_bytes: ByteSize | None = None
    role: Role = "primary"
    pinned: bool = False
    keep_warm: bool = False
    # None: use PolicyConfig.default_idle_ttl_s. Keep-warm and pinned models are never idle-unloaded.
    idle_ttl_s: float | None = Field(default=None, gt=0)
    # Node constraints: a node qualifies only if it is in allowed_nodes (when given), carries every
    # required label, and offers `device` (when given; otherwise the node's first device is used).
    allowed_nodes: frozenset[str] | None = None
    required_labels: dict[str, str] = Field(default_factory=dict)
    device: DeviceKind | None = None
    min_copies: int = Field(default=0, ge=0)
    max_copies: int = Field(default=1, ge=1)
    # A load-time figure to use before one is measured; None: estimate from bytes.
    load_seconds_estimate: float | None = Field(default=None, ge=0)
    # Its weights come from the Hugging Face Hub when no node's store holds them (rule L1).
    hub: bool = False

    @model_validator(mode="after")
    def _copies_in_order(self) -> "ModelSpec":
        if self.min_copies > self.max_copies:
            raise ValueError(f"min_copies ({self.min_copies}) exceeds max_copies ({self.max_copies})")
        return self

    @property
    def kv_reserved_bytes(self) -> int:
        """The cache of `reserve_concurrency` sequences of `reserve_context_tokens` (M1)."""
        window = self.kv_window_bytes_per_token * min(self.reserve_context_tokens, self.kv_window_tokens)
        return (self.kv_bytes_per_token * self.reserve_context_tokens + window + self.kv_state_bytes) * self.reserve_concurrency
