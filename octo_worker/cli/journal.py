"""``octo-worker journal ...``: list, show, verify, prune, reseal, init-anchor, beside the daemon.

Every verb but ``init-anchor`` opens the journal read-only, or for
maintenance (``prune``, ``reseal``: rows only, never a head or the anchor
file the daemon replaces after each commit). Rows are shown as keys, tools,
states, fingerprints and revisions; payloads and failure messages as their
sizes (``record_summary``, ``record_detail`` of :mod:`octo_worker.inspection`,
which the console uses too).

It must never print a payload or a key, or move a revision; a failure
message only for ``show --reveal``, where the journal's data key is
configured, after the reveal is audited (:mod:`octo_worker.inspection`).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

from octo_common.errors import OctoError, OperationPruned
from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    CliError,
    Output,
    anchor_to_write,
    print_table,
    printable,
    state_line,
)
from octo_worker.cli.common import (
    Verbs,
    check_tokens,
    config_of,
    journal_store,
    parse_duration,
    storage_failure,
    verb_group,
)
from octo_worker.config import WorkerConfig
from octo_worker.inspection import (
    audit_reveal,
    check_reveal,
    record_detail,
    record_summary,
    revealed,
    who,
)
from octo_worker.storage.base import JournalStoreBase
from octo_worker.storage.configured import configured_store
from octo_worker.storage.postgres import PostgresJournalStore
from octo_worker.store import PruneReport, ResealReport, SqliteJournalStore

__all__ = [
    "cmd_journal_init_anchor",
    "cmd_journal_list",
    "cmd_journal_prune",
    "cmd_journal_reseal",
    "cmd_journal_show",
    "cmd_journal_verify",
    "register",
]


def register(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    """Add the ``journal`` verbs."""
    journal_verbs = verb_group(verbs, "journal", "inspect the journal database")
    jlist = journal_verbs.add_parser("list", parents=[common], help="list journal rows")
    jlist.add_argument("--scope", metavar="S", help="only this tenant scope (default: every one)")
    jlist.set_defaults(handler=cmd_journal_list)
    jshow = journal_verbs.add_parser("show", parents=[common], help="show one journal row")
    jshow.add_argument(
        "key", metavar="KEY", help="operation key (op-...) or compensation key (cmp-...)"
    )
    jshow.add_argument(
        "--scope", metavar="S", help="the key's tenant scope (default: every configured one)"
    )
    jshow.add_argument(
        "--reveal",
        action="store_true",
        help="also print a failed state's failure text (needs the journal's data key; "
        "each reveal is appended to failure-text-reveals.jsonl in the state directory)",
    )
    jshow.set_defaults(handler=cmd_journal_show)
    verify = journal_verbs.add_parser(
        "verify", parents=[common], help="integrity check and authenticate every row"
    )
    verify.set_defaults(handler=cmd_journal_verify)
    prune = journal_verbs.add_parser(
        "prune",
        parents=[common],
        help="forget the outcome of terminal rows not written for DURATION (never pending "
        "or running; the keys stay refused)",
    )
    prune.add_argument(
        "--older-than",
        type=parse_duration,
        required=True,
        metavar="DURATION",
        help="age of the last write: 30d, 12h, 45m, 90s, 2w",
    )
    prune.add_argument("--scope", metavar="S", help="only this scope (default: every scope)")
    prune.set_defaults(handler=cmd_journal_prune)
    reseal = journal_verbs.add_parser(
        "reseal",
        parents=[common],
        help="re-seal rows an old storage or data key sealed, with the active keys",
    )
    reseal.add_argument("--scope", metavar="S", help="only this scope (default: every scope)")
    reseal.set_defaults(handler=cmd_journal_reseal)
    anchor = journal_verbs.add_parser(
        "init-anchor",
        parents=[common],
        help="create the rollback anchor file from the database (storage.anchor)",
    )
    anchor.add_argument(
        "--force",
        action="store_true",
        help="replace an existing anchor (after restoring a backup on purpose)",
    )
    anchor.set_defaults(handler=cmd_journal_init_anchor)


async def _scopes_of(store: JournalStoreBase, wanted: str | None) -> list[str]:
    scopes = await store.scopes()
    if wanted is None:
        return scopes
    if wanted not in scopes:
        raise CliError(
            EXIT_CHECK_FAILED, f"scope {printable(wanted)!r} has no journal", "not_found"
        )
    return [wanted]


def _each_scope(
    config: WorkerConfig,
    wanted: str | None,
    action: Callable[[JournalStoreBase, str], Awaitable[PruneReport | ResealReport]],
) -> dict[str, dict[str, int]]:
    """``action`` on every scope of the journal (or ``wanted``): its report per scope."""

    async def run() -> dict[str, dict[str, int]]:
        async with journal_store(config, maintenance=True) as store:
            reports: dict[str, dict[str, int]] = {}
            for scope in await _scopes_of(store, wanted):
                try:
                    report = await action(store, scope)
                except OctoError as error:
                    raise storage_failure(f"scope {scope}", error) from None
                reports[scope] = dict(report._asdict())
            return reports

    return asyncio.run(run())


def cmd_journal_list(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)

    async def collect() -> list[dict[str, Any]]:
        async with journal_store(config) as store:
            summaries: list[dict[str, Any]] = []
            for scope in await _scopes_of(store, args.scope):
                try:
                    records = await store.list_records(scope)
                except OctoError as error:
                    raise storage_failure(f"scope {scope}", error) from None
                summaries.extend(record_summary(scope, r, rev) for r, rev in records)
            return summaries

    summaries = asyncio.run(collect())
    rows = [["SCOPE", "KEY", "TOOL", "STATE", "COMPENSATION", "REVISION"]]
    for item in summaries:
        rows.append(
            [
                item["scope"],
                item["operation_key"],
                item["tool"],
                item["state"],
                item["compensation_state"] or "-",
                str(item["revision"]),
            ]
        )
    if summaries:
        print_table(rows, out)
    else:
        out.line("no journal rows")
    out.document({"ok": True, "records": summaries})
    return EXIT_OK


def cmd_journal_show(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    check_tokens("KEY", [args.key])
    reveal = bool(getattr(args, "reveal", False))
    if reveal:
        check_reveal(config)

    pruned: list[str] = []

    async def find() -> list[dict[str, Any]]:
        async with journal_store(config) as store:
            found: list[dict[str, Any]] = []
            for scope in await _scopes_of(store, args.scope):
                try:
                    if args.key.startswith("cmp-"):
                        # A compensation lives in the row of the operation it undoes.
                        rows = await store.list_records(scope)
                        entries = [
                            (record, revision)
                            for record, revision in rows
                            if record.compensation is not None
                            and record.compensation.compensation_key == args.key
                        ]
                    else:
                        loaded = await store.load_records(scope, [args.key])
                        entry = loaded.get(args.key)
                        entries = [] if entry is None else [entry]
                except OperationPruned:
                    pruned.append(scope)  # the key is kept, its outcome is not
                    continue
                except OctoError as error:
                    raise storage_failure(f"scope {scope}", error) from None
                found.extend(record_detail(scope, *entry, reveal=reveal) for entry in entries)
            return found

    found = asyncio.run(find())
    if not found and pruned:
        raise CliError(
            EXIT_CHECK_FAILED,
            f"{args.key} was pruned in scope {pruned[0]}: its outcome is no longer kept "
            "(the key is refused if it arrives again)",
            OperationPruned.code,
        )
    if not found:
        raise CliError(EXIT_CHECK_FAILED, f"no journal row for {args.key}", "not_found")
    for item in found:
        if revealed(item):
            audit_reveal(
                config, operator=who(), via="journal show", scope=item["scope"], key=args.key
            )
    for index, item in enumerate(found):
        if index:
            out.line()
        for line in _detail_lines(item):
            out.line(line)
    out.document({"ok": True, "records": found})
    return EXIT_OK


def _detail_lines(item: Mapping[str, Any]) -> list[str]:
    fields: list[tuple[str, object]] = [
        ("scope:", item["scope"]),
        ("operation key:", item["operation_key"]),
        ("tool:", item["tool"]),
        ("input fingerprint:", item["input_fingerprint"]),
        ("state:", state_line(item)),
    ]
    if "failure_text" in item:
        fields.append(("failure text:", printable(item["failure_text"], 4096)))
    fields.append(("revision:", item["revision"]))
    compensation = item["compensation"]
    if compensation is None:
        fields.append(("compensation:", "none"))
    else:
        fields += [
            ("compensation key:", compensation["compensation_key"]),
            ("  input fingerprint", compensation["input_fingerprint"]),
            ("  grant fingerprint", compensation["grant_fingerprint"]),
            ("  state", state_line(compensation)),
        ]
        if "failure_text" in compensation:
            fields.append(("  failure text", printable(compensation["failure_text"], 4096)))
    return [f"{label:<20}{value}" for label, value in fields]


def cmd_journal_verify(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)

    async def verify() -> tuple[list[str], dict[str, dict[str, int]], list[str], str | None]:
        async with journal_store(config) as store:
            problems = await store.integrity_check()
            counts: dict[str, dict[str, int]] = {}
            without_digests: list[str] = []
            first: str | None = None
            if problems != ["ok"]:
                first = "integrity_check: " + "; ".join(problems[:3])
            # Every scope the store holds, with a head or not (a deleted head
            # row leaves rows without it, which a load refuses).
            for scope in await store.stored_scopes():
                scope_counts = counts.setdefault(scope, {})
                step = "head"
                try:
                    scope_counts["revision"] = await store.head_revision(scope)
                    # What a load checks, by the same calls: the set of rows
                    # against the sealed head (none deleted, put back or
                    # copied in), then the outbox and every session read back
                    # as a restore reads it.
                    step = "rows against the sealed head"
                    check = await store.verify_scope(scope)
                    scope_counts["rows"] = check.rows
                    if not check.digests:
                        without_digests.append(scope)
                    step = "sessions and outbox rows"
                    loaded = await store.load_scope(scope, every_session=True)
                    step = "journal rows"
                    scope_counts["journal_rows"] = len(await store.list_records(scope))
                    scope_counts["sessions"] = len(loaded.sessions)
                    scope_counts["outbox_rows"] = len(loaded.outbox)
                except OctoError as error:
                    # Each reader opens (authenticates) every row it returns;
                    # the first bad row stops this scope, not the others.
                    if first is None:
                        first = f"scope {scope}: {step}: {error.code}: {error}"
            try:
                # Every scope head against the store head: a scope deleted or
                # put back whole leaves no rows of its own to fail above.
                await store.verify_store()
            except OctoError as error:
                first = first or f"store head: {error.code}: {error}"
            return problems, counts, without_digests, first

    problems, counts, without_digests, first = asyncio.run(verify())
    out.line(f"integrity_check: {'ok' if problems == ['ok'] else 'FAIL'}")
    for scope, scope_counts in counts.items():
        parts = ", ".join(
            f"{name.replace('_', ' ')} {value}" for name, value in scope_counts.items()
        )
        out.line(f"scope {scope}: {parts}")
    for scope in without_digests:
        out.line(
            f"scope {scope}: no sealed row digest yet (an older journal schema): "
            "the daemon builds it at its next start; only the anchor was checked"
        )
    totals = {
        name: sum(c.get(name, 0) for c in counts.values())
        for name in ("journal_rows", "sessions", "outbox_rows")
    }
    out.line(
        f"verified {totals['journal_rows']} journal row(s), {totals['sessions']} session(s), "
        f"{totals['outbox_rows']} outbox row(s) in {len(counts)} scope(s)"
    )
    out.document(
        {
            "ok": first is None,
            "integrity_check": problems,
            "scopes": counts,
            "totals": totals,
            "without_row_digest": without_digests,
            "first_failure": first,
        }
    )
    if first is not None:
        out.line(f"FAIL: {first}")
        out.error(f"journal verify failed: {first}")
        return EXIT_CHECK_FAILED
    return EXIT_OK


def cmd_journal_prune(args: argparse.Namespace, out: Output) -> int:
    """Forget the outcome of old terminal rows; the store chooses them (never a
    pending or running one).

    A pruned key is kept as such: a frame that names it later is refused
    (``operation_pruned``), never admitted as new.
    """
    config = config_of(args)
    older_than = float(args.older_than)
    reports = _each_scope(config, args.scope, lambda store, scope: store.prune(scope, older_than))
    for scope, report in reports.items():
        out.line(
            f"scope {scope}: removed {report['removed']} row(s); kept {report['kept']} old "
            "row(s) that are not terminal (pending, running, or an open compensation)"
        )
    removed = sum(report["removed"] for report in reports.values())
    out.line(f"removed {removed} journal row(s) older than {args.older_than} s")
    out.document(
        {
            "ok": True,
            "older_than_seconds": args.older_than,
            "scopes": reports,
            "removed": removed,
        }
    )
    return EXIT_OK


def cmd_journal_reseal(args: argparse.Namespace, out: Output) -> int:
    """Re-seal every row an old key sealed (key rotation, step 4 in docs/operations.md).

    Revisions do not move: safe while the daemon runs.
    """
    config = config_of(args)
    reports = _each_scope(config, args.scope, lambda store, scope: store.reseal(scope))
    for scope, report in reports.items():
        out.line(
            f"scope {scope}: re-sealed {report['resealed']} row(s); "
            f"{report['current']} already under the active key(s)"
        )
    resealed = sum(report["resealed"] for report in reports.values())
    out.line(f"re-sealed {resealed} row(s) with storage key {config.storage_keyring().active_id}")
    out.document({"ok": True, "scopes": reports, "resealed": resealed})
    return EXIT_OK


def _init_shared_anchor(config: WorkerConfig, anchor: Path, out: Output) -> int:
    """The shared journal's anchor: its store head revision as it is now."""

    async def initialize() -> int:
        store = configured_store(config)
        try:
            assert isinstance(store, PostgresJournalStore)
            return await store.initialize_anchor()
        except OctoError as error:
            raise storage_failure(f"journal {config.journal_location()}", error) from None
        finally:
            with contextlib.suppress(Exception):
                await store.close()

    revision = asyncio.run(initialize())
    out.line(
        f"anchored store head revision {revision} of schema {config.storage.schema} in {anchor}"
    )
    out.document({"ok": True, "anchor": str(anchor), "store_revision": revision})
    return EXIT_OK


def cmd_journal_init_anchor(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    anchor = anchor_to_write(
        config.anchor_path,
        "storage.anchor",
        args.force,
        "--force re-anchors to the database as it is now, which accepts any rollback that "
        "happened: only after restoring a backup on purpose",
    )
    if config.shared_journal:
        return _init_shared_anchor(config, anchor, out)

    async def initialize() -> dict[str, int]:
        store = SqliteJournalStore(
            config.journal_path,
            config.storage_keyring(),
            anchor_path=anchor,
            data_keyring=config.data_keyring(),
        )
        try:
            await store.initialize_anchor()
            return {scope: await store.head_revision(scope) for scope in await store.scopes()}
        except OctoError as error:
            raise storage_failure(f"journal {config.journal_path}", error) from None
        finally:
            with contextlib.suppress(Exception):
                await store.close()

    heads = asyncio.run(initialize())
    out.line(f"anchored {len(heads)} scope(s) in {anchor}")
    for scope, revision in heads.items():
        out.line(f"  {scope}: revision {revision}")
    out.document({"ok": True, "anchor": str(anchor), "scopes": heads})
    return EXIT_OK
