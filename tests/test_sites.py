"""The residency loop's view of where things are (router/residency/sites.py): the orders it hands
the effects (where a copy reads from, what it keeps, where a model server loads from) and store
reports against copies the loop saw end."""

from support.builders import spec

from cluster.node_report import CopyProgress, StoreReport
from deployments.manifest import ManifestEntry
from policy import Place
from policy.config import GIB
from router.residency.sites import Sites


def entry(name: str, folder: str | None, hub: bool = False) -> ManifestEntry:
    return ManifestEntry(
        name=name,
        kind="llm",
        path=f"org/{name}" if hub else name,
        hub=hub,
        folder=folder,
        weight_bytes=GIB,
        weights="real",
        architecture="x",
        source="x",
    )


def sites() -> Sites:
    s = Sites({"a": entry("a", "a"), "h": entry("h", "models--org--h", hub=True), "abs": entry("abs", None)})
    s.reported("n1", "ray-1", StoreReport(root="/s1", complete={"a": GIB}, unsealed={"u": 1}), asked_at=0)
    s.reported("n2", "ray-2", StoreReport(root="/s2"), asked_at=0)
    s.reported("n3", None, StoreReport(root="/s3", complete={"a": GIB}), asked_at=0)  # Ray does not know n3 (yet)
    return s


def test_a_copy_reads_from_holders_ray_knows_keeps_what_is_in_use_and_downloads_only_hub_models():
    s = sites()
    s.actors[("a", "n2")] = "a@n2#1"  # placed there, loading: its folder is in use
    order = s.fetch_order("a", "n2")
    assert order.needed and order.sources == ("n1",) and not order.hub and order.root == "/s2" and order.keep == ("a",)
    assert not s.fetch_order("a", "n1").needed  # held already
    hub = s.fetch_order("h", "n2")
    assert hub.needed and hub.hub and hub.sources == ()
    assert not s.fetch_order("h", "n2", background="L4").needed  # a background copy never downloads
    assert s.fetch_order("a", "n2", background="L4").keep == ("a",)
    assert s.fetch_order("h", "n1", background=None).keep == ()
    background = s.fetch_order("h", "n1", background="L4")
    assert background.keep == ("a", "u") and not background.needed  # it would keep every folder there; but nothing holds h
    assert not s.fetch_order("abs", "n2").needed and not s.fetch_order("a", "n9").needed  # no store folder / no store


def test_a_model_server_loads_from_the_store_that_holds_it_else_from_the_registry_path():
    s = sites()
    place = Place(model="a", node_id="n1", device="cpu", bytes=GIB)
    held = s.start_order(place, spec("a"), "a@n1#1")
    assert held.root == "/s1" and held.entry is not None and held.entry.path == "a" and held.ray_node_id == "ray-1"
    elsewhere = s.start_order(place.model_copy(update={"node_id": "n2"}), spec("a"), "a@n2#1")
    assert elsewhere.root is None and elsewhere.entry == s.entries["a"]


def test_a_report_asked_for_before_a_copy_ended_does_not_undo_it():
    s = sites()
    s.reported("n2", None, StoreReport(root="/s2", fetching={"a": CopyProgress(done_bytes=5, total_bytes=10, source="n1")}), asked_at=9)
    assert s.progress("a", "n2") == "copying from n1: 50% (0 of 0 MB) at 0.0 MB/s"
    s.added("n2", "a", GIB, now=10)
    assert s.holds("n2", "a") and s.progress("a", "n2") is None
    s.reported("n2", None, StoreReport(root="/s2", fetching={"a": CopyProgress(done_bytes=9, total_bytes=10)}), asked_at=9.5)  # stale
    assert s.holds("n2", "a") and s.progress("a", "n2") is None and s.holders("a") == ["n1", "n2"]
    s.reported("n2", None, StoreReport(root="/s2"), asked_at=11)  # asked after: it says what is there
    assert not s.holds("n2", "a")
    s.added("n2", "a", GIB, now=12)
    s.removed("n2", ["a"])
    s.reported("n2", None, StoreReport(root="/s2"), asked_at=11.5)
    assert not s.holds("n2", "a")
