"""The incremental session state's pure parts: checkpoints, documents, request rows.

A commit persists ``SessionAuthorizer.checkpoint()`` (fixed size) in a
format 2 state document and one request row per newly retained id;
``read_session`` puts them back together exactly, and refuses a set of
request rows that the state does not count exactly.
"""

from __future__ import annotations

import msgspec
import pytest

from octo_common.authorizer import SessionAuthorizer
from octo_common.codec import encode_struct
from octo_common.errors import (
    InvalidToken,
    RecordLocationMismatch,
    RollbackDetected,
    SerializationError,
)
from octo_common.frames import AuthenticatorState
from octo_common.grants import CapabilityGrant, CapabilityManifest
from octo_common.messages import (
    OperationCompensationBinding,
    OperationCompensationRequest,
    OperationDispatchRequest,
    OperationReconcileResult,
)
from octo_common.payload import ToolPayload
from octo_common.states import Succeeded
from octo_worker.storage.changesets import prepare
from octo_worker.storage.documents import (
    NS_SESSION,
    NS_SESSION_REQUEST,
    RequestDocument,
    opening_document,
    read_session,
    request_document,
    request_item,
    request_location,
    state_document,
)
from octo_worker.storage.interface import (
    PersistedSession,
    RequestRow,
    SessionDocuments,
    WorkerCommit,
)

SCOPE = "tenant-a"
SESSION = "session-1"
TOOL = "count.effect"
MANIFEST = CapabilityManifest(SESSION, [CapabilityGrant(TOOL, "json", max_calls=2000)])
WINDOW = AuthenticatorState(5, 4, 0b1111)


def dispatch(n: int) -> OperationDispatchRequest:
    return OperationDispatchRequest(SESSION, f"d-{n}", TOOL, f"op-{n}", ToolPayload.json({"n": n}))


def served(count: int, completed: int) -> SessionAuthorizer:
    """``count`` dispatches authorized, the first ``completed`` of them answered."""
    authorizer = SessionAuthorizer(MANIFEST)
    for n in range(count):
        auth = authorizer.authorize_operation(dispatch(n))
        if n < completed:
            result = OperationReconcileResult(
                SESSION, f"d-{n}", TOOL, f"op-{n}", Succeeded(ToolPayload.json({}))
            )
            authorizer.validate_operation_result(auth, result)
    return authorizer


def persisted(
    authorizer: SessionAuthorizer, requests: list[bytes] | None = None
) -> PersistedSession:
    state = state_document(SCOPE, SESSION, "open", WINDOW, authorizer.checkpoint(), 0, {})
    if requests is None:
        requests = [
            request_document(SCOPE, SESSION, request_id, position)
            for position, request_id in enumerate(authorizer.retained_ids())
        ]
    opening = opening_document(SCOPE, SESSION, bytes(32), "reply-queue", MANIFEST)
    return PersistedSession(SESSION, "open", opening, state, 7, tuple(requests))


def test_a_checkpoint_counts_the_retained_ids_and_never_holds_them() -> None:
    authorizer = served(5, 3)
    checkpoint = authorizer.checkpoint()
    assert (checkpoint.retained, checkpoint.completed) == (5, 0b111)
    assert checkpoint.calls_by_tool == {TOOL: 5}
    assert authorizer.retained_ids(3) == ["d-3", "d-4"]
    many = served(1000, 1000).checkpoint()
    # The same fields, whatever the number of ids: only the numbers differ.
    assert (many.retained, many.completed) == (1000, (1 << 1000) - 1)


def test_the_state_of_an_earlier_checkpoint_is_its_prefix_of_the_ids() -> None:
    authorizer = served(3, 1)
    earlier = authorizer.checkpoint()
    authorizer.authorize_operation(dispatch(3))
    state = authorizer.export_state_at(earlier)
    assert [(r.request_id, r.completed) for r in state.request_ids] == [
        ("d-0", True),
        ("d-1", False),
        ("d-2", False),
    ]
    assert state.calls_by_tool == {TOOL: 3}
    assert authorizer.export_state().request_ids[-1].request_id == "d-3"
    restored = SessionAuthorizer.restore(MANIFEST, state)
    assert restored.export_state() == state
    assert restored.checkpoint() == earlier


def test_a_checkpoint_of_another_authorizer_with_more_ids_is_refused() -> None:
    with pytest.raises(ValueError):
        served(1, 0).export_state_at(served(2, 0).checkpoint())


def test_the_state_document_has_a_fixed_size() -> None:
    few = persisted(served(10, 10)).state
    many = persisted(served(1000, 1000)).state
    assert b'"format_version":2' in many
    assert len(many) - len(few) <= 8  # the digits of two counters


def test_read_session_puts_the_state_and_its_rows_back_together_exactly() -> None:
    authorizer = served(6, 4)
    stored = read_session(persisted(authorizer), SCOPE)
    assert stored.authorizer == authorizer.export_state()
    assert stored.request_rows == 6
    assert stored.authenticator == WINDOW
    rows = list(persisted(authorizer).requests)
    rows.reverse()  # the store returns them in no particular order
    assert read_session(persisted(authorizer, rows), SCOPE).authorizer == stored.authorizer


def test_a_missing_repeated_or_uncounted_request_row_is_a_rollback() -> None:
    authorizer = served(3, 3)
    rows = list(persisted(authorizer).requests)
    extra = request_document(SCOPE, SESSION, "d-9", 3)
    repeated = request_document(SCOPE, SESSION, "d-9", 1)
    for bad in (rows[:2], [*rows, extra], [*rows[:2], repeated, rows[2]]):
        with pytest.raises(RollbackDetected):
            read_session(persisted(authorizer, bad), SCOPE)


def test_a_request_row_of_another_session_or_scope_is_a_location_mismatch() -> None:
    authorizer = served(2, 0)
    rows = list(persisted(authorizer).requests)
    for stranger in (
        request_document(SCOPE, "session-2", "d-1", 1),
        request_document("tenant-b", SESSION, "d-1", 1),
    ):
        with pytest.raises(RecordLocationMismatch):
            read_session(persisted(authorizer, [rows[0], stranger]), SCOPE)


def test_a_request_row_not_in_its_written_form_or_a_stray_bit_is_refused() -> None:
    authorizer = served(2, 0)
    rows = list(persisted(authorizer).requests)
    spaced = rows[1].replace(b'"position":1', b'"position": 1')
    with pytest.raises(SerializationError):
        read_session(persisted(authorizer, [rows[0], spaced]), SCOPE)
    good = persisted(authorizer)
    stray = good.state.replace(b'"completed":"' + b"0" * 256, b'"completed":"' + b"0" * 255 + b"4")
    assert stray != good.state
    with pytest.raises(SerializationError):  # a completed flag past the 2 retained ids
        read_session(
            PersistedSession(SESSION, "open", good.opening, stray, 7, good.requests), SCOPE
        )


def test_format_1_state_with_request_rows_beside_it_is_a_rollback() -> None:
    from octo_worker.storage.documents import (
        AuthenticatorDocument,
        ReconciliationDocument,
        StateDocument,
    )

    authorizer = served(2, 1)
    old = encode_struct(
        StateDocument(
            1,
            SCOPE,
            SESSION,
            "open",
            AuthenticatorDocument(5, 4, f"{0b1111:0256x}"),
            authorizer.export_state(),
            ReconciliationDocument(0, {}),
        )
    )
    good = persisted(authorizer)
    inline = PersistedSession(SESSION, "open", good.opening, old, 7)
    stored = read_session(inline, SCOPE)
    assert (stored.authorizer, stored.request_rows) == (authorizer.export_state(), 0)
    with pytest.raises(RollbackDetected):
        read_session(PersistedSession(SESSION, "open", good.opening, old, 7, good.requests), SCOPE)


def test_a_request_document_names_its_session_and_request_in_its_item() -> None:
    document = request_document(SCOPE, SESSION, "d-1", 0)
    assert request_location(document, SCOPE, request_item(SESSION, "d-1")) == SESSION
    assert request_item(SESSION, "d-1") == "session-1/d-1"
    with pytest.raises(RecordLocationMismatch):
        request_location(document, SCOPE, request_item(SESSION, "d-2"))
    with pytest.raises(RecordLocationMismatch):
        request_location(document, "tenant-b", request_item(SESSION, "d-1"))


def test_a_commit_inserts_one_request_row_per_new_id_with_its_session() -> None:
    authorizer = served(3, 0)
    state = persisted(authorizer).state
    rows = (RequestRow(1, "d-1"), RequestRow(2, "d-2"))
    for chained in (False, True):
        documents = (
            SessionDocuments(state, link=2, after=1, requests=rows)
            if chained
            else SessionDocuments(state, base_revision=4, requests=rows)
        )
        writes, _ = prepare(SCOPE, WorkerCommit(sessions={SESSION: documents}))
        requests = [w for w in writes if w.namespace == NS_SESSION_REQUEST]
        assert [(w.item, w.base_revision, w.session) for w in requests] == [
            ("session-1/d-1", None, SESSION),
            ("session-1/d-2", None, SESSION),
        ]
        assert msgspec.json.decode(requests[1].document, type=RequestDocument) == (
            RequestDocument(1, SCOPE, SESSION, "d-2", 2)
        )
        assert [w.namespace for w in writes].count(NS_SESSION) == 1


@pytest.mark.parametrize(
    ("bad", "error"),
    [
        ((RequestRow(-1, "d-1"),), ValueError),
        ((RequestRow(1024, "d-1"),), ValueError),
        ((RequestRow(True, "d-1"),), ValueError),
        ((RequestRow(0, "D-1"),), InvalidToken),
        ((RequestRow(0, "a/b"),), InvalidToken),
    ],
)
def test_a_request_row_out_of_range_or_not_a_token_is_refused(
    bad: tuple[RequestRow, ...], error: type[Exception]
) -> None:
    state = persisted(served(1, 0)).state
    documents = SessionDocuments(state, base_revision=1, requests=bad)
    with pytest.raises(error):
        prepare(SCOPE, WorkerCommit(sessions={SESSION: documents}))


# Compensation identities go with the request id that admitted them ---------------------

CMP_MANIFEST = CapabilityManifest(
    SESSION, [CapabilityGrant(TOOL, "json", max_calls=10).with_compensation_limit(10)]
)


def compensate(request_id: str, cmp_key: str) -> OperationCompensationRequest:
    fingerprint = CMP_MANIFEST.grants[0].compensation_fingerprint()
    binding = OperationCompensationBinding(TOOL, "op-1", cmp_key, SCOPE, fingerprint)
    return OperationCompensationRequest(SESSION, request_id, binding, ToolPayload.json({}))


def compensated() -> SessionAuthorizer:
    """c-1 and c-3 admit two identities; c-2 is c-1 again (no new identity)."""
    authorizer = SessionAuthorizer(CMP_MANIFEST)
    authorizer.authorize_compensation(compensate("c-1", "cmp-a"))
    authorizer.authorize_compensation(compensate("c-2", "cmp-a"))
    authorizer.authorize_compensation(compensate("c-3", "cmp-b"))
    return authorizer


def test_an_identity_goes_with_the_request_id_that_admitted_it_not_with_the_state() -> None:
    authorizer = compensated()
    checkpoint = authorizer.checkpoint()
    assert checkpoint.compensation_identities == ()
    assert checkpoint.compensations_by_tool == {TOOL: 2}
    rows = authorizer.retained_rows(0)
    assert [(request_id, c is not None) for request_id, c in rows] == [
        ("c-1", True),
        ("c-2", False),
        ("c-3", True),
    ]
    state = authorizer.export_state()
    assert sorted(i.compensation_key for i in state.compensation_identities) == ["cmp-a", "cmp-b"]
    assert authorizer.admitted_at(checkpoint) == {"c-1": rows[0][1], "c-3": rows[2][1]}
    # Rewound to a checkpoint taken after c-1: one identity, still linked to it.
    again = SessionAuthorizer(CMP_MANIFEST)
    again.authorize_compensation(compensate("c-1", "cmp-a"))
    after_first = again.checkpoint()
    again.authorize_compensation(compensate("c-3", "cmp-b"))
    rewound = again.rewound(after_first)
    assert [i.compensation_key for i in rewound.export_state().compensation_identities] == ["cmp-a"]
    assert rewound.admitted_at(rewound.checkpoint()) == {"c-1": rows[0][1]}
    assert rewound.checkpoint() == after_first


def test_read_session_links_the_identities_of_the_rows_and_restores_them_exactly() -> None:
    authorizer = compensated()
    state = state_document(SCOPE, SESSION, "open", WINDOW, authorizer.checkpoint(), 0, {})
    requests = tuple(
        request_document(SCOPE, SESSION, request_id, position, compensation)
        for position, (request_id, compensation) in enumerate(authorizer.retained_rows(0))
    )
    opening = opening_document(SCOPE, SESSION, bytes(32), "reply-queue", CMP_MANIFEST)
    stored = read_session(PersistedSession(SESSION, "open", opening, state, 7, requests), SCOPE)
    assert stored.authorizer == authorizer.export_state()
    assert sorted(stored.admitted) == ["c-1", "c-3"]
    restored = SessionAuthorizer.restore(CMP_MANIFEST, stored.authorizer, admitted=stored.admitted)
    assert restored.retained_rows(0) == authorizer.retained_rows(0)
    assert restored.checkpoint() == authorizer.checkpoint()
    # A row that claims c-1's identity for c-2 as well: the identity twice, refused.
    twice = list(requests)
    twice[1] = request_document(SCOPE, SESSION, "c-2", 1, authorizer.retained_rows(0)[0][1])
    doubled = read_session(
        PersistedSession(SESSION, "open", opening, state, 7, tuple(twice)), SCOPE
    )
    with pytest.raises(SerializationError):
        SessionAuthorizer.restore(CMP_MANIFEST, doubled.authorizer, admitted=doubled.admitted)


def test_restore_refuses_a_link_to_an_id_not_retained_or_an_identity_not_held() -> None:
    authorizer = compensated()
    state = authorizer.export_state()
    identity = authorizer.retained_rows(0)[0][1]
    assert identity is not None
    other = msgspec.structs.replace(identity, compensation_key="cmp-z")
    for admitted in ({"c-9": identity}, {"c-2": other}, {"c-1": identity, "c-2": identity}):
        with pytest.raises(SerializationError):
            SessionAuthorizer.restore(CMP_MANIFEST, state, admitted=admitted)
    # Without links (a state written before them), every identity is kept unlinked.
    unlinked = SessionAuthorizer.restore(CMP_MANIFEST, state)
    assert len(unlinked.checkpoint().compensation_identities) == 2
    assert unlinked.export_state() == state
