"""The lease book's batch revocation (router/residency/leases.py): a refusal at scale names a
thousand busy instances, and the loop revokes the idle standing leases on them in one pass over the
book; it must answer and revoke as revoke_idle does, instance by instance."""

import itertools
import random

from policy import InstanceRef
from router.residency.leases import LeaseBook


def _books(seed: int) -> tuple[LeaseBook, LeaseBook, list[tuple[str, str]]]:
    """Two books with the same leases: requests' own, standing ones reported idle, busy or not yet
    heard from, on a few dozen instances; and the instances asked about (some with no lease)."""
    rng = random.Random(seed)
    books = LeaseBook(), LeaseBook()
    instances = [(f"n{n}", f"m{m}") for n in range(6) for m in range(8)]
    for node_id, model in rng.sample(instances, 30):
        for _ in range(rng.randint(1, 3)):
            holder = rng.choice([None, "ing-1", "ing-2"])
            for book in books:
                book.grant(InstanceRef(node_id=node_id, model=model), 1.0, holder, 2.0)
    lease_ids = [lease.lease_id for lease in books[0].all() if lease.holder is not None]
    for lease_id in rng.sample(lease_ids, len(lease_ids) // 2):
        holder = next(lease.holder for lease in books[0].all() if lease.lease_id == lease_id)
        assert holder is not None
        report = {lease_id: rng.choice([0, 0, 2])}
        for book in books:
            book.report(holder, report, 3.0)
    asked = rng.sample(instances, 40)
    return books[0], books[1], asked


def _revoked(book: LeaseBook) -> set[str]:
    """The leases asked back, as their holders read them."""
    return set(book.view("ing-1", {}).revoked + book.view("ing-2", {}).revoked)


def test_revoking_in_one_pass_answers_and_revokes_as_one_instance_at_a_time():
    for seed in range(20):
        one_by_one, batched, asked = _books(seed)
        expected = [one_by_one.revoke_idle(InstanceRef(node_id=n, model=m)) for n, m in asked]
        assert list(batched.revoke_idle_each(asked)) == expected
        assert _revoked(batched) == _revoked(one_by_one) and batched.version == one_by_one.version
        assert any(expected) and not all(expected)  # the seeds exercise both answers


def test_revoking_in_one_pass_stops_where_the_reader_stops():
    """any() over it revokes up to the first instance standing leases alone hold, as any() over
    revoke_idle calls did for an operator's load."""
    for seed in range(20):
        one_by_one, batched, asked = _books(seed)
        expected = any(one_by_one.revoke_idle(InstanceRef(node_id=n, model=m)) for n, m in asked)
        assert any(batched.revoke_idle_each(asked)) == expected
        assert _revoked(batched) == _revoked(one_by_one)


def test_an_instance_with_no_lease_is_not_held_by_standing_leases():
    book = LeaseBook()
    assert list(book.revoke_idle_each([("n1", "a"), ("n2", "b")])) == [False, False]
    assert list(itertools.islice(book.revoke_idle_each([]), 1)) == []


def test_the_book_by_instance_matches_its_leases_through_grants_and_ends():
    """`on` and `in_flight` read an index by instance; after every grant and end it lists what a
    scan of the whole book finds, and an instance whose leases all ended leaves nothing behind."""
    rng = random.Random(7)
    book = LeaseBook()
    refs = [InstanceRef(node_id=f"n{n}", model=f"m{m}") for n in range(3) for m in range(4)]
    for _ in range(400):
        live = book.all()
        if live and rng.random() < 0.45:
            book.end(rng.choice(live).lease_id)
        elif live and rng.random() < 0.05:
            book.end_on(rng.choice(refs))
        else:
            book.grant(rng.choice(refs), 1.0, rng.choice([None, "ing-1"]), 2.0)
        for ref in refs:
            scanned = {lease.lease_id for lease in book.all() if (lease.node_id, lease.model) == (ref.node_id, ref.model)}
            assert {lease.lease_id for lease in book.on(ref)} == scanned
            assert book.in_flight(ref) >= len(scanned)
    for lease in book.all():
        book.end(lease.lease_id)
    assert all(book.on(ref) == [] and book.in_flight(ref) == 0 for ref in refs)
    assert book._by_instance == {}
