"""Per-key limits (router/residency/limits.py), driven with explicit times: rpm, tpm (reserved from
max_tokens, corrected to what was used) and requests in flight trip with a 429 naming the limit and
recover when the window moves on or a request ends; the x-ratelimit-* headers say where a key stands."""

import pytest

from router.errors import STATUS
from router.residency.limits import Limiter, RateLimited, Tenant


def test_rpm_trips_with_retry_after_and_recovers_after_the_window():
    lim, key = Limiter(), Tenant(name="team-a", rpm=3)
    for i in range(3):
        lim.admit(key, f"t{i}", 0, now=100.0 + i)
        lim.finish(f"t{i}", 0, now=100.5 + i)
    with pytest.raises(RateLimited) as info:
        lim.admit(key, "t3", 0, now=110.0)
    e = info.value
    assert (e.limit, e.code, STATUS[e.code]) == ("rpm", "rate_limited", 429) and "rpm is 3" in e.message
    assert e.retry_after_s == pytest.approx(50.0)  # the oldest request leaves the window at 160
    assert lim.headers(key, 110.0)["x-ratelimit-remaining-requests"] == "0"
    lim.admit(key, "t4", 0, now=160.5)  # recovered
    assert lim.headers(key, 160.5)["x-ratelimit-remaining-requests"] == "0"  # 101, 102 and 160.5 in the window


def test_tpm_reserves_max_tokens_and_keeps_what_was_used():
    lim, key = Limiter(), Tenant(name="team-a", tpm=1000)
    lim.admit(key, "a", 600, now=0.0)
    with pytest.raises(RateLimited) as info:  # 600 held + 600 asked > 1000
        lim.admit(key, "b", 600, now=1.0)
    assert info.value.limit == "tpm"
    lim.finish("a", 150, now=2.0)  # it used 150 of its 600
    lim.admit(key, "b", 600, now=3.0)
    assert lim.headers(key, 3.0)["x-ratelimit-remaining-tokens"] == str(1000 - 150 - 600)
    lim.finish("b", None, now=4.0)  # usage unknown: the reservation counts
    assert lim.headers(key, 4.0)["x-ratelimit-remaining-tokens"] == str(1000 - 150 - 600)
    assert lim.headers(key, 64.5)["x-ratelimit-remaining-tokens"] == "1000"  # the window moved on


def test_concurrency_holds_until_a_request_ends_and_other_keys_are_not_counted():
    lim, key, other = Limiter(), Tenant(name="team-a", max_concurrent=2), Tenant(name="team-b", max_concurrent=1)
    lim.admit(key, "a", 0, now=0.0)
    lim.admit(key, "b", 0, now=0.0)
    with pytest.raises(RateLimited) as info:
        lim.admit(key, "c", 0, now=0.0)
    assert info.value.limit == "max_concurrent" and info.value.retry_after_s == 1.0
    lim.admit(other, "x", 0, now=0.0)  # a key of its own
    lim.finish("a", 0, now=1.0)
    lim.admit(key, "c", 0, now=1.0)
    lim.finish("unknown-ticket", 5, now=1.0)  # idempotent, and a stranger's end changes nothing
    assert lim.headers(key, 1.0)["x-ratelimit-remaining-concurrent"] == "0"


def test_a_key_without_limits_is_never_counted():
    lim, key = Limiter(), Tenant(name="free")
    for i in range(1000):
        lim.admit(key, f"t{i}", 10**6, now=0.0)
    assert lim.headers(key, 0.0) == {}
