"""The four scenarios of the Lemonade residency discussion (../shared/reference), each showing what
a count-only slot policy does (policy.count_only_lru, today's anchor) and what Orchard does."""

from support.builders import cluster, inst, node, spec

from policy import ClusterState, Place, PolicyConfig, Reject, Wait, count_only_lru, ensure
from policy.config import GIB

NOW = 10_000.0
ORCHARD = PolicyConfig()  # the shipped defaults: margins, overhead, cost strategy


def overcommitted(state: ClusterState, place: Place) -> bool:
    n = state.node(place.node_id)
    kept = sum(i.bytes for i in n.instances if all(i.model != v.model for v in place.evict if v.node_id == n.node_id))
    return kept + place.bytes + n.foreign_bytes > n.usable_bytes


def test_scenario_1_unlimited_count_loads_a_second_huge_model_orchard_evicts_or_refuses():
    x, y = spec("oss-120b", gb=62), spec("other-120b", gb=60)
    st = cluster([node("strix", 96, inst("oss-120b", 62, last_used=NOW - 600))], [x, y])

    old = count_only_lru("other-120b", st, NOW, max_loaded_models=-1)
    assert isinstance(old, Place) and old.evict == () and overcommitted(st, old)  # try and hope: OOM or swap

    new = ensure("other-120b", st, NOW, ORCHARD)
    assert isinstance(new, Place) and [v.model for v in new.evict] == ["oss-120b"] and not overcommitted(st, new)

    # Pinned: the discussion's "Loading failed due to pinned model(s) blocking resources".
    pinned = cluster(st.nodes, [x.model_copy(update={"pinned": True}), y])
    refused = ensure("other-120b", pinned, NOW, ORCHARD)
    assert isinstance(refused, Reject) and refused.code == "blocked"
    assert "pinned models oss-120b hold 62.0 GiB" in refused.message and "strix" in refused.message

    # Busy: waited for, never evicted under a live request.
    busy = cluster([node("strix", 96, inst("oss-120b", 62, in_flight=1))], [x, y])
    assert isinstance(ensure("other-120b", busy, NOW, ORCHARD), Wait)


def test_scenario_2_keep_the_two_small_helpers_not_three_arbitrary_models():
    emb = spec("embedder", "embedding", gb=0.5, role="utility")
    rr = spec("reranker", "rerank", gb=1, role="utility")
    a, y = spec("llm-a", gb=40), spec("llm-y", gb=30)
    st = cluster(
        [
            node(
                "mac",
                64,
                inst("embedder", 0.5, last_used=NOW - 900),
                inst("reranker", 1, last_used=NOW - 800),
                inst("llm-a", 40, last_used=NOW - 700),
            )
        ],
        [emb, rr, a, y],
    )
    old = count_only_lru("llm-y", st, NOW, max_loaded_models=3, per_kind=False)
    assert [v.model for v in old.evict] == ["embedder"] and overcommitted(st, old)  # loses a helper and still OOMs

    new = ensure("llm-y", st, NOW, ORCHARD)
    assert [v.model for v in new.evict] == ["llm-a"] and not overcommitted(st, new)


def test_scenario_3_one_gpu_llm_plus_cpu_helpers_on_the_same_mac():
    x, y = spec("gpu-llm-x", gb=24), spec("gpu-llm-y", gb=24)
    stt = spec("speech", "stt", gb=1.5, device="cpu", role="utility")
    emb = spec("embedder", "embedding", gb=0.5, device="cpu", role="utility")
    st = cluster(
        [node("mac", 64, inst("gpu-llm-x", 24, last_used=NOW - 300), inst("speech", 1.5, device="cpu", last_used=NOW - 60))],
        [x, y, stt, emb],
    )
    # Count-only with 2 slots (set so speech can stay): two large LLMs end up on one GPU.
    old = count_only_lru("gpu-llm-y", st, NOW, max_loaded_models=2)
    assert old.evict == () and old.device == "metal"

    policy = ORCHARD.model_copy(update={"max_per_device_per_node": {"metal": 1, "cpu": 2, "total": 3}})
    new = ensure("gpu-llm-y", st, NOW, policy)
    assert [v.model for v in new.evict] == ["gpu-llm-x"] and new.device == "metal"
    helper = ensure("embedder", st, NOW, policy)
    assert isinstance(helper, Place) and helper.evict == () and helper.device == "cpu"


def test_scenario_4_evict_the_most_expendable_not_the_least_recent():
    emb = spec("embedder", "embedding", gb=0.3, role="utility")
    rr = spec("reranker", "rerank", gb=0.6, role="utility")
    idle = spec("idle-70b", gb=40)
    y = spec("primary", gb=30)
    st = cluster(
        [
            node(
                "mac",
                64,
                inst("embedder", 0.3, last_used=NOW - 600),
                inst("reranker", 0.6, last_used=NOW - 450),
                inst("idle-70b", 40, last_used=NOW - 300),
            )
        ],
        [emb, rr, idle, y],
    )
    old = count_only_lru("primary", st, NOW, max_loaded_models=3, per_kind=False)
    assert [v.model for v in old.evict] == ["embedder"] and overcommitted(st, old)

    new = ensure("primary", st, NOW, ORCHARD)
    assert [v.model for v in new.evict] == ["idle-70b"] and not overcommitted(st, new)
    assert new.bytes == 30 * GIB  # the test specs reserve no KV or overhead
