"""The simulated cluster and model catalog: four Macs of different sizes, a few 10-70 GB LLMs and
many small embedders, rerankers, STT and TTS models. Sizes follow common MLX quantisations."""

from policy import ClusterState, ModelSpec, NodeState
from policy.config import GIB

KIB = 1024

# (node id, total GiB, usable GiB: macOS' recommended working set is about 75% of RAM)
NODES = [
    ("studio-128", 128, 96),
    ("studio-64", 64, 48),
    ("mini-48", 48, 36),
    ("mini-32", 32, 24),
]

# (name, kind, weights GiB, KV KiB per token, role)
LLMS = [
    ("llama-3.3-70b-8bit", "llm", 70, 320, "primary"),
    ("qwen2.5-72b-4bit", "llm", 40, 320, "primary"),
    ("gemma-3-27b-8bit", "llm", 28, 248, "primary"),
    ("mixtral-8x7b-4bit", "llm", 26, 128, "primary"),
    ("qwen2.5-32b-4bit", "llm", 18, 256, "primary"),
    ("phi-4-14b-4bit", "llm", 8, 200, "primary"),
    ("llama-3.1-8b-8bit", "llm", 8.5, 128, "primary"),
    ("qwen2.5-vl-7b-8bit", "vlm", 9, 56, "primary"),
    ("mistral-7b-8bit", "llm", 7.5, 128, "primary"),
    ("llava-1.6-7b-4bit", "vlm", 4.5, 128, "primary"),
]
SMALL = [
    ("all-minilm-l6", "embedding", 0.09, 0, "utility"),
    ("bge-small", "embedding", 0.13, 0, "utility"),
    ("e5-base", "embedding", 0.42, 0, "utility"),
    ("nomic-embed", "embedding", 0.55, 0, "utility"),
    ("bge-m3", "embedding", 2.2, 0, "utility"),
    ("gte-large", "embedding", 1.3, 0, "utility"),
    ("ms-marco-minilm", "rerank", 0.09, 0, "utility"),
    ("bge-reranker-base", "rerank", 1.1, 0, "utility"),
    ("jina-reranker-v2", "rerank", 0.55, 0, "utility"),
    ("mxbai-rerank-large", "rerank", 1.6, 0, "utility"),
    ("whisper-tiny", "stt", 0.07, 0, "utility"),
    ("whisper-small", "stt", 0.48, 0, "utility"),
    ("whisper-large-v3-turbo", "stt", 1.6, 0, "utility"),
    ("kokoro-82m", "tts", 0.33, 0, "utility"),
    ("csm-1b", "tts", 2.0, 0, "utility"),
]


def model_specs(keep_warm: frozenset[str] = frozenset()) -> list[ModelSpec]:
    """LLMs reserve 8K tokens of context for 2 concurrent requests; small models reserve nothing."""
    specs = []
    for name, kind, gb, kv_kib, role in LLMS + SMALL:
        specs.append(
            ModelSpec(
                name=name,
                kind=kind,
                weight_bytes=int(gb * GIB),
                kv_bytes_per_token=kv_kib * KIB,
                reserve_context_tokens=8192 if kv_kib else 0,
                reserve_concurrency=2,
                role=role,
                keep_warm=name in keep_warm,
            )
        )
    return specs


# The Lemonade discussion's setting: one machine, one user.
ONE_MAC = [("mac-64", 64, 48)]


def empty_cluster(specs: list[ModelSpec], nodes: list[tuple[str, int, int]] = NODES) -> ClusterState:
    states = tuple(
        NodeState(node_id=n, labels={"chip": "apple"}, devices=("metal", "cpu"), total_bytes=t * GIB, usable_bytes=u * GIB) for n, t, u in nodes
    )
    return ClusterState(nodes=states, catalog={s.name: s for s in specs})


def with_stores(state: ClusterState, layout: str) -> ClusterState:
    """Where the weights start (rule L1): "home": every model on the first (largest) node's store only;
    "spread": each model on one node's store, round robin; "everywhere": every model on every node."""
    nodes = [n.node_id for n in state.nodes]
    held: dict[str, set[str]] = {n: set() for n in nodes}
    for i, model in enumerate(sorted(state.catalog)):
        for node in nodes if layout == "everywhere" else [nodes[0] if layout == "home" else nodes[i % len(nodes)]]:
            held[node].add(model)
    return state.model_copy(update={"nodes": tuple(n.model_copy(update={"stored": frozenset(held[n.node_id])}) for n in state.nodes)})
