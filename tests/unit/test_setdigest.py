"""The incremental set digest (``octo_common.setdigest``): layout, algebra, bounds.

Every expected value is recomputed here with the ``blake3`` package from the
byte layout the module docstring writes out, never with the module itself.
"""

from __future__ import annotations

import random

import blake3
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octo_common.setdigest import (
    SET_DIGEST_BYTES,
    SetDigest,
    element_value,
)

DOMAIN = b"octo-test-rows-v1"
MODULUS = 1 << 4096


def _lp(data: bytes) -> bytes:
    return len(data).to_bytes(8, "big") + data


def expected_element(domain: bytes, namespace: str, name: str, revision: int) -> int:
    message = (
        b"octo-set-digest-v1"
        + _lp(domain)
        + _lp(namespace.encode())
        + _lp(name.encode())
        + revision.to_bytes(8, "big")
    )
    return int.from_bytes(blake3.blake3(message).digest(length=512), "big")


def expected_bytes(domain: bytes, rows: list[tuple[str, str, int]]) -> bytes:
    total = sum(expected_element(domain, *row) for row in rows) % MODULUS
    return total.to_bytes(512, "big")


def expected_fingerprint(domain: bytes, count: int, value: bytes) -> bytes:
    message = b"octo-set-digest-fingerprint-v1" + _lp(domain) + count.to_bytes(8, "big") + value
    return blake3.blake3(message).digest()


ROWS = [
    ("workflow-ledger", "release-42", 3),
    ("workflow-routes", "release-42", 1),
    ("workflow-ledger", "release-43", 7),
]


def test_an_element_is_the_512_byte_xof_of_its_framed_row() -> None:
    assert element_value(DOMAIN, "workflow-ledger", "release-42", 3) == expected_element(
        DOMAIN, "workflow-ledger", "release-42", 3
    )
    assert SET_DIGEST_BYTES == 512


def test_the_digest_is_the_sum_of_its_elements_modulo_2_to_the_4096() -> None:
    digest = SetDigest(DOMAIN)
    for row in ROWS:
        digest.add(*row)
    value = digest.to_bytes()
    assert value == expected_bytes(DOMAIN, ROWS)
    assert digest.count == 3
    assert digest.fingerprint() == expected_fingerprint(DOMAIN, 3, value)
    # The sum of three 4096-bit elements passes 2^4096 unless they are small:
    # the stored value is the reduced one, exactly 512 bytes.
    assert len(value) == 512


def test_the_empty_digest_is_zero_with_its_own_fingerprint() -> None:
    empty = SetDigest(DOMAIN)
    assert empty.to_bytes() == bytes(512)
    assert empty.count == 0
    assert empty.fingerprint() == expected_fingerprint(DOMAIN, 0, bytes(512))


@settings(max_examples=50, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.sampled_from(["workflow-ledger", "workflow-routes"]),
            st.text(alphabet="abc-0123", min_size=1, max_size=6),
            st.integers(min_value=1, max_value=2**64 - 1),
        ),
        max_size=12,
        unique_by=lambda row: (row[0], row[1]),
    ),
    seed=st.integers(),
)
def test_order_does_not_matter_and_of_agrees_with_adding(
    rows: list[tuple[str, str, int]], seed: int
) -> None:
    shuffled = list(rows)
    random.Random(seed).shuffle(shuffled)
    one, two = SetDigest(DOMAIN), SetDigest(DOMAIN)
    for row in rows:
        one.add(*row)
    for row in shuffled:
        two.add(*row)
    assert one == two == SetDigest.of(DOMAIN, shuffled)
    assert one.to_bytes() == expected_bytes(DOMAIN, rows)


def test_a_write_is_remove_old_add_new_and_undoes_exactly() -> None:
    digest = SetDigest.of(DOMAIN, ROWS)
    before = digest.copy()
    digest.replace("workflow-ledger", "release-42", 3, 4)
    assert digest.count == 3
    assert digest == SetDigest.of(DOMAIN, [("workflow-ledger", "release-42", 4), *ROWS[1:]])
    digest.replace("workflow-ledger", "release-42", 4, 3)
    assert digest == before
    digest.replace("workflow-ledger", "release-44", None, 1)  # a create
    assert digest.count == 4
    digest.replace("workflow-ledger", "release-44", 1, None)  # a removal
    assert digest == before


def test_a_deleted_row_and_a_row_rolled_back_alone_change_the_digest() -> None:
    truth = SetDigest.of(DOMAIN, ROWS)
    deleted = SetDigest.of(DOMAIN, ROWS[1:])
    rolled_back = SetDigest.of(DOMAIN, [("workflow-ledger", "release-42", 2), *ROWS[1:]])
    assert deleted != truth and deleted.fingerprint() != truth.fingerprint()
    assert rolled_back != truth and rolled_back.fingerprint() != truth.fingerprint()
    assert rolled_back.count == truth.count  # only the digest can tell


def test_fields_are_length_framed_and_domains_are_separate() -> None:
    # Without the length prefixes these two rows would hash the same bytes.
    assert element_value(DOMAIN, "ab", "c", 1) != element_value(DOMAIN, "a", "bc", 1)
    assert SetDigest.of(DOMAIN, ROWS) != SetDigest.of(b"octo-other-rows-v1", ROWS)
    assert (
        SetDigest.of(DOMAIN, ROWS).to_bytes()
        != SetDigest.of(b"octo-other-rows-v1", ROWS).to_bytes()
    )


def test_a_stored_digest_round_trips_and_wrong_shapes_are_refused() -> None:
    digest = SetDigest.of(DOMAIN, ROWS)
    again = SetDigest.from_bytes(DOMAIN, digest.to_bytes(), digest.count)
    assert again == digest
    again.add("workflow-ledger", "release-50", 1)
    assert again != digest  # independent objects
    with pytest.raises(ValueError):
        SetDigest.from_bytes(DOMAIN, bytes(511), 0)
    with pytest.raises(ValueError):
        SetDigest.from_bytes(DOMAIN, bytes(513), 0)
    with pytest.raises(ValueError):
        SetDigest.from_bytes(DOMAIN, bytes(512), -1)
    with pytest.raises(TypeError):
        SetDigest.from_bytes(DOMAIN, bytearray(512), 0)  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SetDigest.from_bytes(DOMAIN, bytes(512), True)


def test_bad_arguments_are_refused() -> None:
    digest = SetDigest(DOMAIN)
    with pytest.raises(ValueError):
        digest.remove("workflow-ledger", "release-42", 1)  # nothing to remove
    with pytest.raises(TypeError):
        SetDigest("octo-test-rows-v1")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        SetDigest(b"")
    with pytest.raises(TypeError):
        digest.add("workflow-ledger", "release-42", True)
    with pytest.raises(TypeError):
        digest.add("workflow-ledger", b"release-42", 1)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        digest.add("workflow-ledger", "release-42", -1)
    with pytest.raises(ValueError):
        digest.add("workflow-ledger", "release-42", 2**64)
    assert digest == SetDigest(DOMAIN)  # nothing refused changed it
    with pytest.raises(TypeError):
        hash(digest)
