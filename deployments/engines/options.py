"""The LLM engines' scheduling options, as ray-config.yaml gives them (app-wide and per model).
Plain pydantic, no MLX: the app builder and the registry validate them before anything loads."""

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class LLMEngineOptions(BaseModel):
    """How an LLM engine schedules its batch (LLMEngine's arguments of the same names): app-wide in
    ray-config.yaml's `llm_engine`, and per model in a registry entry's `llm_engine` (only the fields
    it sets, over the app's)."""

    model_config = ConfigDict(extra="forbid")

    # An arrival that comes while the batch decodes waits up to this many steps for others (or
    # until `prefill_batch` are waiting), so a group is prefilled and joins the batch at once: every
    # group costs a prefill and a merge, each a synchronous evaluation that drains the GPU's queue.
    # 8 steps and 32 a group: 0.45 -> 1.00 of the bare BatchGenerator at 64 streams on the H200;
    # then 8 -> 4 steps (H200, in process, one run): 16 streams 0.83 -> 1.03 of bare, TTFT p50
    # 153 -> 102 ms (bare's 83); 64 streams 1.08 -> 1.07, TTFT 239 -> 153 ms (bare's 119).
    admit_hold_steps: int = Field(default=4, ge=0, le=64)
    # ... but the wait ends once a step has passed with no new arrival (H200, 64 streams: TTFT p50
    # 159 -> 149 ms, the same tok/s; 16 streams: 114 -> 75 ms).
    admit_quiet_steps: int = Field(default=1, ge=0, le=64)
    # ... and only while at least this many rows decode (0: whenever the batch is busy); a smaller
    # batch's arrivals join at the next step. H200, 1B shape: 16 or 32 here lost throughput and
    # doubled TTFT p50 at 64 streams (285 -> 535-557 ms; docs/serve-path.md, "Admission").
    admit_hold_min_rows: int = Field(default=0, ge=0, le=1024)
    # An idle batch lets an arrival in at once, unless other arrivals are being prepared (templated
    # and tokenized) beside it: then it waits for them up to this long, so requests that come
    # together (a burst that waited for the model's load) are prefilled as one group, not the first
    # alone and the rest a prefill later. A request that comes alone never waits.
    admit_gather_ms: float = Field(default=20.0, ge=0, le=1000)
    # Prompt tokens of each prefilling row run in one engine step, between two decode steps (mlx-lm's
    # prefill_step_size, which its BatchGenerator already interleaves with decoding): a 3,000-token
    # prompt is prefilled over several steps and the streams decoding beside it keep their pace.
    # bench.engine.long_prefill: bench/results/engine-long-prefill.json.
    prefill_chunk_tokens: int = Field(default=512, ge=16, le=8192)
    # ... and after each chunk, this many steps only decode while rows do (0: a chunk every step):
    # the decoding streams' ITL p50 stays the bare engine's (one step in this many + 1 carries a
    # chunk) and the long prompt's first token comes that many times later.
    prefill_decode_steps: int = Field(default=0, ge=0, le=16)
    # Sequences prefilled together (mlx-lm's prefill_batch_size; its default is 8).
    prefill_batch: int = Field(default=32, ge=1, le=256)
    # ... and at most this many prompt tokens admitted and not yet prefilled (one longer prompt
    # alone excepted): groups of long prompts are split, so memory does not spike and a group's first
    # tokens do not all wait for its longest prefill. 1,024: agent turns (a long cached prefix, a few
    # hundred new tokens each) that arrive together come out in groups of a few, not one of 32;
    # short prompts still join 32 at a time (docs/peers-benchmark.md: CPU, 24 conversations,
    # turn-2/3 first tokens 0.64x vllm-mlx's where 16,384 gave 1.4x).
    max_prefill_tokens: int = Field(default=1024, ge=1)
    # A prompt prefix is kept and reused only from this many tokens: below it, copying and merging
    # the cached KV costs more than prefilling the prefix again.
    prompt_cache_min_tokens: int = Field(default=256, ge=0)
    # MLX buffer cache this engine keeps through mlx-lm's prefill, which otherwise hands every cached
    # buffer back to the device after each prefill chunk (deployments/engines/buffer_cache.py);
    # None: as much as the instance's KV reservation, which the policy already counts; 0: mlx-lm's
    # own behaviour. H200, 64 streams, in process: TTFT p50 260.7 -> 186.3 ms with the cache kept.
    prefill_cache_keep_mib: int | None = Field(default=None, ge=0)
    # Prompt prefixes kept for reuse (deployments/engines/prefix_cache.py): "blocks" stores each
    # prefix's KV once in blocks of `prefix_block_tokens` however many requests share it (models with
    # a sliding-window or SSM cache fall back to "lru", mlx-lm's LRUPromptCache of whole copies);
    # at most `prompt_cache_bytes`, least recently used blocks evicted first. CPU, llama-10m, 24
    # conversations x 3 turns over a 1,100-token system prompt: bench/results/engine-agent.json.
    prefix_cache: Literal["blocks", "lru"] = "blocks"
    prompt_cache_bytes: int = Field(default=512 * 2**20, ge=0)
    prefix_block_tokens: int = Field(default=128, ge=1, le=4096)
    # With blocks: the disk tier (deployments/engines/prefix_disk.py). Every full block is written to
    # the node's disk too, under `prefix_disk_dir` (None: `<the node's ORCHARD_STORE>/.prefixes`,
    # beside the model store and outside its budget; a node without a store: no tier), and a
    # prompt's blocks that memory lacks are read back from there, so a model that is evicted and
    # loaded again (or a restart) does not prefill a conversation's prefix again. At most
    # `prefix_disk_bytes` for all the node's models together, least recently used blocks removed
    # first (0: no tier).
    prefix_disk_bytes: int = Field(default=16 * 2**30, ge=0)
    prefix_disk_dir: str | None = None
    # With blocks: a prompt is kept once prefilled, and an arrival that begins like a prompt being
    # prefilled waits a step or two for its blocks instead of prefilling the same tokens beside it.
    share_prefill: bool = True
    # With blocks: a group is cut where right-padding its prefill to its longest uncached prompt
    # would cost more than this many times its own tokens (0: never cut).
    prefill_pad_ratio: float = Field(default=2.0, ge=0)
    # With blocks: a group's rows reuse only as much of their cached prefixes as leaves each the
    # group's longest uncached length to prefill (when that fits one prefill chunk), so mlx-lm
    # prefills the group unpadded and does not roll every row's cache into place after it (the
    # recomputed tokens are the padding it would run anyway). False: each row reuses all it can
    # and the group is right-padded.
    prefill_align: bool = True
    # A quantized KV cache (deployments/engines/quantized_cache.py): keys and values held in
    # `kv_bits` bits (8 or 4) with a scale and a bias per `kv_group_size` of them, so an instance's KV
    # reservation, its running requests' caches and its prefix cache all take about half (8 bits) or
    # a quarter (4 bits) of a 16-bit cache's bytes, and a node holds more instances (the registry
    # reserves the quantized size). None: the model's own dtype. Only models whose every layer is a
    # plain KV cache (no sliding window, no SSM state) take it; others fail to load with the reason.
    # SmolLM2-135M, greedy: bench/results/engine-kv-quant.json, docs/engines.md.
    kv_bits: Literal[4, 8] | None = None
    kv_group_size: Literal[32, 64, 128] = 64
    # Speculative decoding in the batch (deployments/engines/speculation.py): "prompt_lookup" drafts
    # up to `spec_max_drafts` tokens a row from its own prompt and output (n-gram matches, no draft
    # model), and one forward verifies every row's drafts; the depth follows each row's acceptance
    # and the step's measured cost, down to plain steps where it would not pay. "off": one token a
    # row per step. "draft": a draft model (`draft_model`: a registry model's name, or a folder,
    # absolute or under models_dir; a smaller model of the same tokenizer) proposes for up to
    # `draft_rows` rows (deployments/engines/draft.py), prompt lookup for the others; it is loaded
    # and evicted with the model, and its weights and KV cache are reserved with it.
    # docs/engines.md says when each pays.
    speculation: Literal["off", "prompt_lookup", "draft"] = "prompt_lookup"
    spec_max_drafts: int = Field(default=8, ge=1, le=32)
    # prompt lookup indexes a row's last `spec_lookup_window` prompt tokens and all its output (host
    # memory ~340 bytes a token a row, built on the MLX thread: deployments/engines/prompt_lookup.py)
    spec_lookup_window: int = Field(default=16384, ge=64, le=1 << 20)
    draft_model: str | None = Field(default=None, min_length=1, max_length=1000)
    draft_rows: int = Field(default=4, ge=1, le=64)
    # A load measures what the model holds (deployments/engines/measure.py): its weights and cache at
    # once, its activations (a few forward passes of the reserved batch: 1.4 s for llama-10m on this
    # CPU) only once the engine has been idle this many seconds, so the requests that waited for the
    # load are not kept waiting for those passes; a request that comes meanwhile stops them until the
    # next idle moment. Until then the instance reserves what its placement counted, under MLX's own
    # limit. None: measured in the load. A reload of the same weights and settings measures nothing (M1).
    measure_idle_s: float | None = Field(default=2.0, ge=0, le=3600)

    @model_validator(mode="after")
    def _draft_named(self) -> "LLMEngineOptions":
        if (self.speculation == "draft") != (self.draft_model is not None):
            raise ValueError("speculation 'draft' takes a draft_model (a smaller model of the same tokenizer), and only it does")
        return self
