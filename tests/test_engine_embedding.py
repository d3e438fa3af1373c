"""The embedding engine on the real all-MiniLM-L6-v2 weights."""

import asyncio

import numpy as np
import pytest

from deployments.engine import RequestError
from deployments.engines.embedding import EmbeddingEngine


@pytest.fixture(scope="module")
def engine(models_dir):
    e = EmbeddingEngine("all-minilm-l6-v2", str(models_dir / "all-minilm-l6-v2"))
    asyncio.run(e.load())
    yield e
    asyncio.run(e.stop())


def test_minilm_cosine_matches_sentence_transformers(engine):
    r = asyncio.run(engine.embed(["A man is eating food.", "A man is eating a piece of bread."]))
    a, b = map(np.array, r.vectors)
    assert r.dimensions == 384 and r.prompt_tokens > 10
    assert float(a @ b) == pytest.approx(0.7553, abs=1e-3)
    assert np.linalg.norm(a) == pytest.approx(1.0, abs=1e-5)


def test_batching_and_padding_do_not_change_vectors(engine):
    texts = ["short", "a much longer sentence that needs padding in its batch " * 3, "medium length text here"]

    async def scenario():
        together = await engine.embed(texts)
        alone = [await engine.embed([t]) for t in texts]
        concurrent = await asyncio.gather(*(engine.embed([t]) for t in texts))
        return together, alone, concurrent

    together, alone, concurrent = asyncio.run(scenario())
    for i in range(len(texts)):
        assert np.abs(np.array(together.vectors[i]) - np.array(alone[i].vectors[0])).max() < 1e-5
        # concurrent requests may share a batch (test below): the same vectors, as `together`
        assert np.abs(np.array(concurrent[i].vectors[0]) - np.array(alone[i].vectors[0])).max() < 1e-5


def test_requests_that_arrive_while_a_batch_runs_share_the_next_one(engine):
    """Eight single-string requests that arrive while the worker is busy run as one forward batch,
    each getting its own vectors and token count, equal to its solo result."""
    import time

    texts = [f"request number {i} with {'some ' * i}words" for i in range(8)]

    async def scenario():
        alone = [await engine.embed([t]) for t in texts]
        engine._worker.submit(time.sleep, 0.3)  # the worker is busy while all eight arrive
        before = engine.batches
        shared = await asyncio.gather(*(engine.embed([t]) for t in texts))
        return alone, shared, engine.batches - before

    alone, shared, batches = asyncio.run(scenario())
    assert batches == 1
    for a, s in zip(alone, shared, strict=True):
        assert s.prompt_tokens == a.prompt_tokens
        assert np.abs(np.array(s.vectors[0]) - np.array(a.vectors[0])).max() < 1e-5


def test_dimensions_truncate_and_renormalise(engine):
    r = asyncio.run(engine.embed("hello world", dimensions=64))
    v = np.array(r.vectors[0])
    assert r.dimensions == 64 and v.shape == (64,) and np.linalg.norm(v) == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("bad", [[], [""], ["ok", 3], None])
def test_bad_inputs_fail_alone(engine, bad):
    with pytest.raises(RequestError) as info:
        asyncio.run(engine.embed(bad))
    assert info.value.code == "invalid_request"
    assert len(asyncio.run(engine.embed(["still fine"])).vectors) == 1
    with pytest.raises(RequestError):
        asyncio.run(engine.embed(["x"], dimensions=1000))
