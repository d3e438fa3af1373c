"""The LLM engine's scheduler on plain data: when held arrivals join the batch, how a group is cut,
how its rows align, and when a prefill chunk runs between decode steps. No MLX, no model."""

from dataclasses import dataclass, field

from deployments.engines.llm_scheduler import KVBudget, Scheduler, Settings
from deployments.wire.measured import CacheShape


@dataclass(eq=False)
class Arrival:
    rid: int
    tokens: list[int] = field(default_factory=list)
    step: int = 0
    max_tokens: int = 16


def prompt(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def scheduler(**settings) -> Scheduler[Arrival]:
    return Scheduler(Settings(**settings))


def test_an_idle_batch_admits_at_once_and_a_busy_one_holds_for_the_hold_steps():
    s = scheduler(admit_hold_steps=4, admit_quiet_steps=64)
    assert not s.admit_now(0)  # nothing held
    s.arrive(Arrival(0, prompt(10)))
    assert s.admit_now(0)  # idle
    assert not s.admit_now(3)  # busy: the arrival waits
    s.steps += 3
    assert not s.admit_now(3)
    s.steps += 1
    assert s.admit_now(3)  # waited admit_hold_steps


def test_the_hold_ends_when_arrivals_stop_or_a_group_is_full():
    quiet = scheduler(admit_hold_steps=8, admit_quiet_steps=1)
    quiet.arrive(Arrival(0, prompt(10)))
    assert not quiet.admit_now(5)
    quiet.steps += 1  # a step without an arrival
    assert quiet.admit_now(5)

    full = scheduler(admit_hold_steps=8, admit_quiet_steps=8, prefill_batch=3)
    for rid in range(2):
        full.arrive(Arrival(rid, prompt(10)))
    assert not full.admit_now(5)
    full.arrive(Arrival(2, prompt(10)))
    assert full.admit_now(5)


def test_a_small_batch_below_admit_hold_min_rows_admits_at_once():
    s = scheduler(admit_hold_steps=8, admit_quiet_steps=8, admit_hold_min_rows=4)
    s.arrive(Arrival(0, prompt(10)))
    assert s.admit_now(3) and not s.admit_now(4)


def test_a_group_keeps_within_max_prefill_tokens_and_the_rest_is_due():
    s = scheduler(max_prefill_tokens=1000)
    for rid in range(4):
        s.arrive(Arrival(rid, prompt(400, rid * 1000)))
    first = s.choose(None, lambda rid: None)
    assert [a.rid for a in first.arrivals] == [0, 1]  # 800 tokens; a third would make 1,200
    for a in first.arrivals:
        s.joined(first, a, 0)
    assert s.due and s.admit_now(8)  # the rest join as soon as there is room, without another hold
    assert s.choose(None, lambda rid: None).arrivals == []  # 800 still prefill
    s.answered(0)
    assert [a.rid for a in s.choose(None, lambda rid: None).arrivals] == [2]  # 400 in flight + 400
    s.answered(1)
    s.prefilling.clear()
    s.arrive(Arrival(9, prompt(5000)))
    assert [a.rid for a in s.choose(None, lambda rid: None).arrivals] == [3]  # 400 in flight, then 5,000 would pass it
    s.prefilling.clear()
    assert [a.rid for a in s.choose(None, lambda rid: None).arrivals] == [9]  # nothing in flight: a longer prompt joins alone
    assert s.stats["admitted_groups"] == 4 and s.stats["admitted_requests"] == 5


def test_a_group_is_cut_where_padding_would_cost_more_than_its_own_tokens():
    s = scheduler(prefill_pad_ratio=2.0, prompt_cache_min_tokens=256, share_prefill=False)
    cached = prompt(2000)
    s.arrive(Arrival(0, cached + prompt(100, 5000)))  # a later turn: 2,000 cached, 100 new
    s.arrive(Arrival(1, cached + prompt(80, 7000)))
    s.arrive(Arrival(2, prompt(1100, 9000)))  # a new conversation: 1,100 new
    group = s.choose(lambda tokens: 2000 if tokens[:2000] == cached else 0, lambda rid: None)
    assert [a.rid for a in group.arrivals] == [0, 1]  # the new conversation would pad all three rows to 1,100
    assert [a.rid for a in s.held] == [2] and s.due
    assert s.stats["group_prompt_tokens"] == 180 and s.stats["group_padded_tokens"] == 200


def test_rows_of_a_group_align_on_its_longest_uncached_prompt_within_one_chunk():
    s = scheduler(prefill_chunk=512, prompt_cache_min_tokens=256, share_prefill=False)
    cached = prompt(1000)
    s.arrive(Arrival(0, cached + prompt(100, 5000)))
    s.arrive(Arrival(1, cached + prompt(40, 7000)))
    group = s.choose(lambda tokens: 1000, lambda rid: None)
    assert group.align == 100
    assert s.prefix_limit(1040, group.align) == 940  # the shorter row recomputes 60 cached tokens
    assert s.prefix_limit(1100, group.align) == 1000
    assert s.prefix_limit(300, 100) == 299  # 200 cached would be below prompt_cache_min_tokens: all but one
    for arrival, cached_tokens in zip(group.arrivals, (1000, 940), strict=True):
        s.joined(group, arrival, cached_tokens)
    assert s.stats["aligned_tokens"] == 60 and s.stats["ragged_rows"] == 0
    assert s.prefilling == {0: 100, 1: 100}

    wide = scheduler(prefill_chunk=64, share_prefill=False)
    wide.arrive(Arrival(0, prompt(1100)))
    wide.arrive(Arrival(1, prompt(1040)))
    assert wide.choose(lambda tokens: 1000, lambda rid: None).align is None  # 100 > one chunk of 64
    alone = scheduler(share_prefill=False)
    alone.arrive(Arrival(0, prompt(1100)))
    assert alone.choose(lambda tokens: 1000, lambda rid: None).align is None  # a group of one


def test_an_arrival_that_begins_like_a_prompt_being_prefilled_waits_for_its_blocks():
    s = scheduler(prefix_block_tokens=128, max_prefill_tokens=4096)
    system = prompt(600)
    s.prefilling[7] = 600
    s.arrive(Arrival(0, system + [1, 2, 3]))
    s.arrive(Arrival(1, prompt(600, 10_000)))
    group = s.choose(lambda tokens: 0, lambda rid: system if rid == 7 else None)
    assert [a.rid for a in group.arrivals] == [1] and [a.rid for a in s.held] == [0]
    # ... and two arrivals of one group that begin alike: the second waits for the first's blocks
    t = scheduler(prefix_block_tokens=128)
    t.arrive(Arrival(0, system + [1]))
    t.arrive(Arrival(1, system + [2]))
    assert [a.rid for a in t.choose(lambda tokens: 0, lambda rid: None).arrivals] == [0]


def test_a_cancelled_arrival_leaves_the_held_ones():
    s = scheduler()
    s.arrive(Arrival(0, prompt(5)))
    s.arrive(Arrival(1, prompt(5)))
    assert s.withdraw(1).rid == 1 and s.withdraw(1) is None
    assert [a.rid for a in s.held] == [0]


def test_prefill_chunks_run_every_decode_steps_plus_one_while_rows_decode():
    s = scheduler(prefill_decode_steps=2)
    s.prefilling[0] = 1000
    assert s.prefill_now(1)  # only the prefilling row: every step prefills
    pattern = [s.prefill_now(3) for _ in range(6)]  # 2 rows decode beside it
    assert pattern == [False, False, True, False, False, True]
    s.answered(0)
    assert s.prefill_now(3)  # nothing prefills: the step is free to


def kv_budget(concurrency: int = 2, context: int = 1024, window: int = 0) -> KVBudget:
    """A model of 1 KiB a token in its full layers (and `window`: 4 KiB a token in sliding layers of
    that many tokens), reserving `concurrency` x `context` tokens, as measure.kv_budget makes it."""
    shape = CacheShape(full_bytes_per_token=1024, window_bytes_per_token=4096 if window else 0, window_tokens=window)
    return KVBudget(reserved_bytes=concurrency * shape.sequence_bytes(context), context_tokens=context, sequence_bytes=shape.sequence_bytes)


def joined_all(s: Scheduler[Arrival]) -> list[int]:
    group = s.choose(None, lambda rid: None)
    for a in group.arrivals:
        s.joined(group, a, 0)
    return [a.rid for a in group.arrivals]


def test_m4_an_arrival_joins_only_while_the_batch_fits_the_kv_reservation_and_waits_first_in_line():
    s = scheduler(max_prefill_tokens=10**6)
    s.kv = kv_budget(concurrency=2, context=1024)
    for rid in range(3):  # each may reach 600 + 400 tokens: a 1,024-token buffer, one share each
        s.arrive(Arrival(rid, prompt(600, rid * 1000), max_tokens=400))
    s.arrive(Arrival(3, prompt(10, 9000), max_tokens=10))  # small: it would fit beside the two
    assert joined_all(s) == [0, 1]
    assert [a.rid for a in s.held] == [2, 3] and s.stats["kv_waits"] == 1
    assert s.admit_now(2) and joined_all(s) == []  # the small one does not overtake the long one
    s.answered(0)
    assert joined_all(s) == []  # a prefill done frees no KV: the row still grows to its bound
    s.left(0)
    assert joined_all(s) == [2]  # a row gone: the long one joins first
    assert joined_all(s) == []  # ... and the small one waits: 3 rows at the longest's 1,024 tokens pass it
    s.left(1)
    assert joined_all(s) == [3]
    assert s.rows == {2: 1000, 3: 20}


def test_m4_the_batch_is_as_long_as_its_longest_row_for_every_row():
    # short rows fit many at a time, but beside a long one each counts at its length (left padding)
    s = scheduler(max_prefill_tokens=10**6)
    s.kv = kv_budget(concurrency=2, context=1024)
    for rid in range(8):
        s.arrive(Arrival(rid, prompt(100, rid * 1000), max_tokens=100))  # 256-token buffers
    assert joined_all(s) == list(range(8))  # 8 x 256 = the reservation's 2 x 1,024
    s.arrive(Arrival(8, prompt(10, 9000), max_tokens=5))
    assert joined_all(s) == []
    for rid in range(8):
        s.left(rid)
    s.arrive(Arrival(9, prompt(900, 0), max_tokens=100))  # 1,000 tokens: 1,024 for every row beside it
    assert joined_all(s) == [8, 9]
    s.arrive(Arrival(10, prompt(10, 5000), max_tokens=5))
    assert joined_all(s) == []  # a third row would be padded to 1,024 too


def test_m4_a_row_is_bounded_by_the_context_and_windows_stop_growing():
    budget = kv_budget(concurrency=1, context=1024, window=128)
    assert budget.row_tokens(1000, 5000) == 1024  # max_tokens past the context stops there ("length")
    # sliding layers hold their window (and a chunk) at any length: only the full layers grow
    assert budget.batch_bytes([1024, 10]) == 2 * (1024 * 1024 + 4096 * 128)
    # a verify step runs drafts past the longest row: a row that ends at a buffer step needs the next
    drafting = KVBudget(reserved_bytes=budget.reserved_bytes, context_tokens=1024, sequence_bytes=budget.sequence_bytes, overshoot=8)
    assert drafting.batch_bytes([768]) == budget.batch_bytes([776]) == budget.batch_bytes([1024]) > budget.batch_bytes([768])
    s = scheduler()
    s.kv = budget
    s.arrive(Arrival(0, prompt(1000), max_tokens=24))
    s.arrive(Arrival(1, prompt(10, 5000), max_tokens=5))
    assert joined_all(s) == [0] and [a.rid for a in s.held] == [1]


def test_m4_an_arrival_that_could_never_fit_alone_is_refused_and_the_rest_go_on():
    s = scheduler(max_prefill_tokens=10**6)
    s.kv = KVBudget(reserved_bytes=1024 * 256, context_tokens=4096, sequence_bytes=CacheShape(full_bytes_per_token=1024).sequence_bytes)
    s.arrive(Arrival(0, prompt(300), max_tokens=10))  # 512 tokens' buffer: more than the whole reservation
    s.arrive(Arrival(1, prompt(100, 1000), max_tokens=10))
    group = s.choose(None, lambda rid: None)
    assert [a.rid for a in group.refused] == [0] and [a.rid for a in group.arrivals] == [1]


def test_m4_without_a_kv_reservation_nothing_waits_and_a_broken_batch_frees_every_row():
    s = scheduler(max_prefill_tokens=10**6)
    for rid in range(4):
        s.arrive(Arrival(rid, prompt(5000, rid * 10_000), max_tokens=10_000))
    assert joined_all(s) == [0, 1, 2, 3] and s.rows == {}  # reserve_context_tokens 0: kv is None
    s.kv = kv_budget()
    s.rows = {7: 1000, 8: 1000}
    s.reset()
    assert s.rows == {} and s.prefilling == {}
