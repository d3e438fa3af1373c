"""Prefix-aware routing in the ingress (router/serving/affinity.py): the choice as a pure function,
the prefix keys of real request bodies, the bounded history, and a conversation's turns through
StandingLeases against the real residency controller (the residency service's handle replaced by
test_standing_leases' `Direct`, as there)."""

import asyncio

import pytest
from support.builders import spec
from support.loop import make
from test_standing_leases import Direct, settle

from router.protocols.openai import ChatCompletionRequest, CompletionRequest
from router.serving.affinity import PrefixHistory, choose, outcome, prefix_keys
from router.serving.lease import Leases

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 40}
TOOLS = [{"type": "function", "function": {"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}]


def chat(*messages: dict, tools: list | None = None, **extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "a", "messages": list(messages), "tools": tools, **extra})


def turns(conversation: str, n: int) -> list[dict]:
    """A conversation's messages up to its n-th user turn (the replies in between)."""
    out: list[dict] = [SYSTEM]
    for i in range(1, n + 1):
        out.append({"role": "user", "content": f"{conversation}: question {i}"})
        if i < n:
            out.append({"role": "assistant", "content": f"{conversation}: answer {i}"})
    return out


# ---- choose: in-flight counts and match lengths -> an instance ------------------------------------


def test_no_known_prefix_goes_to_the_least_loaded():
    assert choose([3, 1, 2], [0, 0, 0], 4) == 1


def test_the_longest_known_prefix_wins_within_the_bound():
    assert choose([0, 0], [1, 3], 4) == 1
    assert choose([4, 0], [3, 1], 4) == 0  # 4 more in flight: still within the bound


def test_an_instance_busier_than_the_bound_loses_its_affinity():
    assert choose([5, 0], [3, 0], 4) == 1
    assert choose([6, 1, 0], [3, 2, 0], 4) == 1  # the next longest prefix within the bound, not the least loaded


def test_ties_go_to_the_less_loaded_then_the_first():
    assert choose([2, 1, 1], [2, 2, 2], 4) == 1
    assert choose([0, 0], [2, 2], 4) == 0


def test_a_negative_bound_is_the_least_loaded_always():
    assert choose([1, 0], [5, 0], -1) == 1


def test_choose_refuses_mismatched_input():
    with pytest.raises(ValueError):
        choose([], [], 4)
    with pytest.raises(ValueError):
        choose([0, 1], [0], 4)


def test_outcome_names_what_routing_did():
    assert outcome(0, 0) == "miss"
    assert outcome(3, 3) == "hit"
    assert outcome(1, 3) == "overloaded"


# ---- prefix keys of real bodies -------------------------------------------------------------------


def test_a_later_turn_extends_the_earlier_turns_keys():
    one, two = prefix_keys(chat(*turns("c1", 1))), prefix_keys(chat(*turns("c1", 2)))
    assert len(one) == 2 and len(two) == 4  # the system head, then each message
    assert two[: len(one)] == one


def test_conversations_share_only_their_system_prompt_and_tools():
    a, b = prefix_keys(chat(*turns("c1", 2), tools=TOOLS)), prefix_keys(chat(*turns("c2", 2), tools=TOOLS))
    assert a[0] == b[0] and a[1] != b[1]
    assert prefix_keys(chat(*turns("c1", 2)))[0] != a[0]  # other tools: another head


def test_template_variables_change_every_key():
    plain, other = prefix_keys(chat(*turns("c1", 1))), prefix_keys(chat(*turns("c1", 1), chat_template_kwargs={"enable_thinking": False}))
    assert not set(plain) & set(other)


def test_a_completion_prompt_is_keyed_by_whole_steps():
    text = "x" * 1100
    keys = prefix_keys(CompletionRequest.model_validate({"model": "a", "prompt": text}))
    assert len(keys) == 2 and prefix_keys(CompletionRequest.model_validate({"model": "a", "prompt": text + "y" * 500}))[:2] == keys
    assert prefix_keys(CompletionRequest.model_validate({"model": "a", "prompt": "short"})) == ()
    assert len(prefix_keys(CompletionRequest.model_validate({"model": "a", "prompt": list(range(300))}))) == 2


# ---- the history --------------------------------------------------------------------------------


def test_the_history_matches_the_longest_prefix_sent_and_forgets_the_oldest():
    history = PrefixHistory(keys_per_instance=4, instances=2)
    first = prefix_keys(chat(*turns("c1", 1)))
    history.note(("n1", 1.0), first)
    assert history.match(("n1", 1.0), prefix_keys(chat(*turns("c1", 2)))) == 2
    assert history.match(("n1", 2.0), first) == 0  # a new incarnation of the same node knows nothing
    history.note(("n1", 1.0), prefix_keys(chat(*turns("c2", 2))))  # 4 keys more: c1's own key falls out
    assert history.match(("n1", 1.0), first) == 1  # the shared system head was noted again, so it stays
    history.note(("n2", 1.0), first)
    history.note(("n3", 1.0), first)
    assert history.match(("n1", 1.0), first) == 0  # three instances: the oldest is forgotten
    with pytest.raises(ValueError):
        PrefixHistory(keys_per_instance=0)


# ---- through StandingLeases, two held leases ------------------------------------------------------


async def two_held(max_extra: int = 4):
    """A replica holding standing leases on two copies of "a": the first taken by conversation c0,
    the second (while the first was busy) by c1's first turn. Both idle afterwards."""
    c, fx = make([spec("a", gb=3, max_copies=2)], nodes=(("n1", 4), ("n2", 4)), real_clock=True)
    leases = Leases(Direct(c), holder="ing-1", linger_s=30.0, max_extra_in_flight=max_extra)
    c0 = await leases.acquire("a", prefix=prefix_keys(chat(*turns("c0", 1))))
    await c.load("a", "n2" if c0.node_id == "n1" else "n1")
    await settle(0.5)  # the long poll says there are two copies
    c1 = await leases.acquire("a", prefix=prefix_keys(chat(*turns("c1", 1))))  # the first is busy: a lease on the other
    assert c1.node_id != c0.node_id and leases.standing is not None and len(leases.standing.held["a"]) == 2
    c0.release()
    c1.release()
    return c, leases, c0.node_id, c1.node_id


def test_a_conversations_next_turn_goes_where_its_first_went_when_loads_are_equal():
    async def scenario():
        c, leases, _, c1_node = await two_held()
        second = await leases.acquire("a", prefix=prefix_keys(chat(*turns("c1", 2))))
        third = await leases.acquire("a", prefix=prefix_keys(chat(*turns("c1", 3))))  # one in flight there now, none on the other
        return c1_node, second.node_id, third.node_id, c.acquires

    c1_node, second, third, acquires = asyncio.run(scenario())
    # Least-loaded routing sends the equally loaded turn 2 to the first lease held (c0's instance).
    assert second == c1_node and third == c1_node and acquires == 2


def test_a_conversations_next_turn_goes_elsewhere_when_its_instance_is_overloaded():
    async def scenario():
        c, leases, c0_node, c1_node = await two_held(max_extra=4)
        busy = [await leases.acquire("a", prefix=prefix_keys(chat(*turns("c1", 1)))) for _ in range(5)]  # all to c1's instance
        placed = {lease.node_id for lease in busy}
        turn2 = await leases.acquire("a", prefix=prefix_keys(chat(*turns("c1", 2))))  # 5 in flight there, 0 on the other
        return c0_node, c1_node, placed, turn2.node_id

    c0_node, c1_node, placed, turn2 = asyncio.run(scenario())
    assert placed == {c1_node} and turn2 == c0_node


def test_without_a_prefix_requests_go_to_the_least_loaded():
    async def scenario():
        c, leases, c0_node, c1_node = await two_held()
        held = [await leases.acquire("a") for _ in range(4)]
        return c0_node, c1_node, [lease.node_id for lease in held]

    c0_node, c1_node, nodes = asyncio.run(scenario())
    assert nodes == [c0_node, c1_node, c0_node, c1_node]
