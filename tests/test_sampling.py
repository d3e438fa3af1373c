"""The engine's one batched sampler (deployments/engines/sampling.py) on real MLX arrays: each row's
filters remove exactly what mlx-lm's own top-p / min-p / top-k remove, draws stay inside what is
kept and follow the distribution, a seeded row ignores its neighbours, and it is called only the
way mlx-lm's GenerationBatch calls a shared sampler."""

import math

import mlx.core as mx
import pytest
from mlx_lm.generate import GenerationBatch, StopSequences
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

from deployments.engines.sampling import BatchSampler, RowSampling, _Row, filtered, sample

VOCAB = 64


def logprobs(rows: int, seed: int = 0) -> mx.array:
    x = mx.random.normal((rows, VOCAB), key=mx.random.key(seed)) * 3
    return x - mx.logsumexp(x, axis=-1, keepdims=True)


def mlx_lm_filtered(row: mx.array, s: RowSampling) -> mx.array:
    """What mlx-lm's make_sampler chain keeps of one row (top-p, then min-p, then top-k)."""
    if s.top_p < 1:
        row = apply_top_p(row, s.top_p)
    if s.min_p:
        row = apply_min_p(row, s.min_p)
    if s.top_k:
        row = apply_top_k(row, s.top_k)
    return row


SETTINGS = [
    RowSampling(1.0),
    RowSampling(0.7, top_p=0.9),
    RowSampling(1.0, top_p=0.3),
    RowSampling(1.3, min_p=0.1),
    RowSampling(1.0, top_k=5),
    RowSampling(0.8, top_p=0.8, min_p=0.05, top_k=10),
    RowSampling(1.0, top_p=0.95, top_k=2),
    RowSampling(0.5, min_p=0.3, top_k=40),
]


@pytest.mark.parametrize("chosen", [SETTINGS, SETTINGS[4:7]], ids=["some rows sorted", "every row sorted"])
def test_each_rows_filters_keep_what_mlx_lms_keep(chosen):
    lp = logprobs(len(chosen))
    ours = filtered(lp, chosen)
    for i, s in enumerate(chosen):
        theirs = mlx_lm_filtered(lp[i : i + 1], s)
        kept = (ours[i] > -math.inf).tolist()
        assert kept == (theirs[0] > -math.inf).tolist(), s
        assert 0 < sum(kept) <= (s.top_k or VOCAB)
    assert (ours[0] == lp[0]).tolist().count(True) > 0  # what is kept keeps its value


def test_draws_stay_in_what_is_kept_and_greedy_rows_take_the_top():
    lp = logprobs(len(SETTINGS) + 1, seed=1)
    settings = [*SETTINGS, RowSampling()]
    kept = filtered(lp, settings) > -math.inf
    rows = [_Row(s) for s in settings]
    for _ in range(50):
        drawn = sample(lp, rows).tolist()
        assert all(kept[i, t].item() for i, t in enumerate(drawn))
        assert drawn[-1] == mx.argmax(lp[-1]).item()


def test_a_draw_follows_the_rows_distribution_at_its_temperature():
    """Gumbel-max at temperature T is a categorical draw from softmax(logprobs / T): 4,000 rows of the
    same distribution, at two temperatures, against the exact probabilities."""
    mx.random.seed(3)
    base = logprobs(1, seed=2)[0, :8]
    base = base - mx.logsumexp(base)
    n = 4000
    for t in (1.0, 0.5):
        lp = mx.broadcast_to(base, (n, 8))
        drawn = sample(lp, [_Row(RowSampling(t)) for _ in range(n)])
        counts = [(drawn == k).sum().item() for k in range(8)]
        expected = mx.softmax(base / t).tolist()
        for k in range(8):
            assert abs(counts[k] / n - expected[k]) < 4 * math.sqrt(expected[k] * (1 - expected[k]) / n) + 1e-3, (t, k)


def test_a_seeded_row_draws_the_same_tokens_whatever_its_neighbours():
    lp = logprobs(6, seed=4)
    seeded = RowSampling(1.0, top_p=0.9, seed=7)

    def run(neighbours: list[RowSampling], steps: int = 8) -> list[int]:
        rows = [_Row(seeded), *(_Row(s) for s in neighbours)]
        tokens = []
        for _ in range(steps):
            tokens.append(sample(lp[: len(rows)], rows).tolist()[0])
        return tokens

    alone = run([])
    assert run(SETTINGS[:5]) == alone
    assert run([RowSampling(), RowSampling(1.0, seed=8)]) == alone
    other = [_Row(RowSampling(1.0, top_p=0.9, seed=8))]
    assert [sample(lp[:1], other).item() for _ in range(8)] != alone


def test_normalised_settings():
    assert RowSampling.of(0.0, 0.5, 0.1, 3, 9, VOCAB) == RowSampling()  # greedy ignores the rest
    assert RowSampling.of(1.0, 1.0, 0.0, VOCAB, None, VOCAB).top_k == 0  # past the vocabulary: off
    assert RowSampling.of(1.0, 0.0, 0.0, 0, None, VOCAB).top_p == 1.0  # top_p 0 is mlx-lm's "off" too


def test_it_samples_a_generation_batch_in_one_call_and_refuses_any_other_caller(models_dir):
    """mlx-lm's GenerationBatch (a real one, on llama-10m) calls a sampler all its rows share once with
    the whole batch; the rows' order comes from that batch (the contract the engine relies on; mlx-lm
    is pinned)."""
    import mlx_lm
    from mlx_lm.models.cache import make_prompt_cache

    model, _ = mlx_lm.load(str(models_dir / "llama-10m"))
    sampler = BatchSampler()
    uids = [11, 12, 13]
    for uid, s in zip(uids, [RowSampling(), RowSampling(1.0, top_k=1), RowSampling()], strict=True):
        sampler.add(uid, s)
    inputs = mx.array([1, 2, 3])
    expected = mx.argmax(model(inputs[:, None], cache=make_prompt_cache(model))[:, -1, :], axis=-1).tolist()
    batch = GenerationBatch(
        model, uids, inputs, make_prompt_cache(model), [[], [], []], [sampler] * 3, sampler, [[], [], []], [StopSequences()] * 3, [4, 4, 4]
    )
    assert sampler.calls == 1 and sampler.rows_sampled == 3
    assert batch._next_tokens.tolist() == expected  # greedy, top_k 1, greedy: each row's own top token
    with pytest.raises(RuntimeError, match="not by a batch of 3 rows"):
        sampler(logprobs(3))
