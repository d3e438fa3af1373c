"""The node model store (cluster/store.py) on real files: sealing hashes a folder put in by hand, a
copy is verified file by file and appears only complete, a cut-off copy resumes from its partial
files, a corrupted one is refused, and store folder names cannot leave the store."""

import hashlib
import os
import pickle
import shutil

import pytest

from cluster.store import PARTIAL, Store
from cluster.stored import MANIFEST, StoredFile, StoreError, StoreManifest


def _folder(root, name="m", sizes=(5000, 123, 0)):
    base = root / name
    (base / "sub").mkdir(parents=True)
    for i, size in enumerate(sizes):
        (base / ("sub" if i == 1 else "") / f"f{i}.bin").write_bytes(os.urandom(size))
    (base / "config.json").write_text("{}")
    (base / ".ready").write_text("")  # a loader's marker: copied too
    return base


def _reader(source: Store, folder: str, chunk: int = 1000, fail_after: int | None = None, corrupt: bool = False):
    calls = {"n": 0}

    def read(path: str, offset: int) -> bytes:
        calls["n"] += 1
        if fail_after is not None and calls["n"] > fail_after:
            raise ConnectionError("the source went away")
        data = source.read(folder, path, offset, chunk)
        return bytes([data[0] ^ 1]) + data[1:] if corrupt and data and offset == 0 else data

    return read, calls


def test_seal_hashes_a_folder_put_in_by_hand_and_notices_a_changed_file(tmp_path):
    base = _folder(tmp_path)
    store = Store(tmp_path)
    assert store.manifest("m") is None and store.inventory()["unsealed"] == {"m": 5123 + 2}
    manifest = store.seal("m")
    by_path = {f.path: f for f in manifest.files}
    assert set(by_path) == {"f0.bin", "sub/f1.bin", "f2.bin", "config.json", ".ready"}
    assert by_path["f0.bin"].sha256 == hashlib.sha256((base / "f0.bin").read_bytes()).hexdigest()
    assert store.inventory()["complete"] == {"m": manifest.total_bytes}
    (base / "f0.bin").write_bytes(b"short")
    assert store.manifest("m") is None  # a file no longer at its size: not complete


def test_a_copy_is_verified_and_appears_only_when_complete(tmp_path):
    source = Store(tmp_path / "a")
    _folder(tmp_path / "a")
    manifest = source.seal("m")
    target = Store(tmp_path / "b")
    read, _ = _reader(source, "m")

    def watching_read(path: str, offset: int) -> bytes:
        assert not (tmp_path / "b" / "m").exists()  # never a half folder under its own name
        return read(path, offset)

    seen: list[int] = []
    assert target.copy_in(manifest, watching_read, seen.append) == manifest.total_bytes
    assert seen[-1] == manifest.total_bytes and seen == sorted(seen)
    assert target.manifest("m") is not None and not (tmp_path / "b" / PARTIAL / "m").exists()
    for f in manifest.files:
        assert hashlib.sha256((tmp_path / "b" / "m" / f.path).read_bytes()).hexdigest() == f.sha256


def test_a_cut_off_copy_resumes_from_its_partial_files(tmp_path):
    source = Store(tmp_path / "a")
    _folder(tmp_path / "a", sizes=(20_000, 3000, 10))
    manifest = source.seal("m")
    target = Store(tmp_path / "b")
    read, _ = _reader(source, "m", fail_after=7)
    with pytest.raises(ConnectionError):
        target.copy_in(manifest, read)
    kept = target.inventory()["partial"]["m"]
    assert target.manifest("m") is None and 6000 <= kept <= 7000  # 7 chunks of at most 1000 bytes
    read, _ = _reader(source, "m")
    copied = target.copy_in(manifest, read)
    assert copied == manifest.total_bytes - kept  # only what the first copy had not written
    assert target.manifest("m") is not None


def test_a_corrupted_copy_is_refused_and_never_sealed(tmp_path):
    source = Store(tmp_path / "a")
    _folder(tmp_path / "a")
    manifest = source.seal("m")
    target = Store(tmp_path / "b")
    read, _ = _reader(source, "m", corrupt=True)
    with pytest.raises(StoreError) as e:
        target.copy_in(manifest, read)
    assert e.value.code == "checksum" and target.manifest("m") is None and not (tmp_path / "b" / "m").exists()
    assert not (tmp_path / "b" / PARTIAL / "m" / MANIFEST).exists()


@pytest.mark.parametrize("bad", ["../etc", "/abs", ".partial", "a/../../b", ""])
def test_store_folder_names_stay_inside_the_store(tmp_path, bad):
    with pytest.raises(StoreError) as e:
        Store(tmp_path).folder(bad)
    assert e.value.code == "bad_request"


@pytest.mark.parametrize("paths", [["a", "a/b"], ["x/y", "x"], ["f", "f"], ["../f"]])
def test_a_peer_manifest_that_cannot_be_written_is_refused_before_any_byte(tmp_path, paths):
    manifest = StoreManifest(folder="m", files=tuple(StoredFile(path=p, size=1, sha256="0" * 64) for p in paths))
    with pytest.raises(StoreError) as e:
        Store(tmp_path).copy_in(manifest, lambda files: pytest.fail("nothing is fetched"))
    assert e.value.code == "bad_request" and not (tmp_path / "m").exists()


def test_only_listed_files_of_a_complete_folder_are_served(tmp_path):
    _folder(tmp_path)
    store = Store(tmp_path)
    assert len(store.read("m", "f0.bin", 0, 10)) == 10  # sealed on the first read
    assert store.manifest("m") is not None
    with pytest.raises(StoreError):
        store.read("m", "nope.bin", 0, 10)
    assert pickle.loads(pickle.dumps(StoreError("checksum", "x"))).code == "checksum"  # crosses Ray whole
    with pytest.raises(StoreError):
        store.read("m", MANIFEST, 0, 10)


def test_the_disk_budget_removes_the_least_recently_used_unused_folders_first(tmp_path):
    for name in ("old", "used", "new"):
        _folder(tmp_path, name, sizes=(4000,))
    store = Store(tmp_path, budget_bytes=14_500)
    for name, when in (("old", 1000), ("used", 2000), ("new", 3000)):
        store.seal(name)
        os.utime(tmp_path / name / MANIFEST, (when, when))
    store.touch("new")  # just loaded: the most recent
    # 3 x ~4.4 KB stored (manifests included); 5 KB more must fit in 14.5 KB: one folder goes, the oldest not in use
    assert store.make_room("incoming", 5000, keep=frozenset({"used"})) == ["old"]
    assert not (tmp_path / "old").exists() and (tmp_path / "used").exists()
    # 9 KB more: only "new" may go, and that is not enough: disk_full names what is in use
    with pytest.raises(StoreError) as e:
        store.make_room("incoming", 14_000, keep=frozenset({"used"}))
    assert e.value.code == "disk_full" and "in use there: used" in e.value.message
    assert Store(tmp_path).make_room("incoming", 10**6) == []  # no budget: only the disk's free space counts


def test_a_sealed_folder_copied_in_by_hand_under_another_name_is_sealed_again(tmp_path):
    _folder(tmp_path, "a")
    store = Store(tmp_path)
    store.seal("a")
    shutil.copytree(tmp_path / "a", tmp_path / "b")  # its manifest says folder "a"
    assert store.manifest("b") is None and "b" in store.inventory()["unsealed"]
    assert store.seal("b").folder == "b" and store.manifest("b") is not None


def test_a_manifest_under_a_hidden_folder_does_not_break_the_inventory(tmp_path):
    _folder(tmp_path, "a")
    Store(tmp_path).seal("a")
    shutil.copytree(tmp_path / "a", tmp_path / ".trash" / "a")  # e.g. a file manager's bin
    assert set(Store(tmp_path).inventory()["complete"]) == {"a"}


def test_the_prefix_tier_beside_the_store_is_reported_and_not_counted_in_its_budget(tmp_path):
    store = Store(tmp_path, budget_bytes=10**9)
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    tier = tmp_path / ".prefixes" / "abc"
    tier.mkdir(parents=True)
    (tier / "k.safetensors").write_bytes(b"x" * 5000)
    assert store.used_bytes() == 2
    assert store.inventory()["prefix_bytes"] == 5000
