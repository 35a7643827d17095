"""How ``octo-host`` reports a state, an operation and a verb's result.

This module owns the text and JSON shapes of what the worker verbs observed
and the exit status they end with (0 only for ``succeeded``).

It must never show a payload or a failure text: they become sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from octo_common.runtime.output import EXIT_CHECK_FAILED, EXIT_OK, Output, state_detail
from octo_common.states import TERMINAL_KINDS, StateKind
from octo_host.cli.context import PROG
from octo_host.client import HostRun
from octo_host.ledger import WorkflowOperation

__all__ = [
    "finish",
    "operation_doc",
    "operation_result",
    "result_lines",
    "state_text",
]


def state_text(detail: Mapping[str, Any]) -> str:
    text = str(detail["state"])
    if "failure_code" in detail:
        text += f" [{detail['failure_code']}]"
    payload = detail.get("payload")
    if payload is not None:
        text += f" (output: {payload['format']}, {payload['bytes']} bytes)"
    if "message_bytes" in detail:
        text += f" (failure text withheld: {detail['message_bytes']} bytes)"
    return text


def operation_doc(operation: WorkflowOperation) -> dict[str, Any]:
    compensation = operation.compensation
    return {
        "step": operation.step_id,
        "tool": operation.tool,
        "operation_key": operation.operation_key,
        "input_fingerprint": operation.input_fingerprint,
        "state": operation.state.value,
        "failure": operation.failure,
        "attempt": operation.attempt,
        "retry_of": operation.retry_of,
        "compensation": None
        if compensation is None
        else {
            "compensation_key": compensation.compensation_key,
            "state": compensation.state.value,
            "failure": compensation.failure,
            "tenant_scope": compensation.tenant_scope,
            "grant_fingerprint": compensation.grant_fingerprint,
            "input_fingerprint": compensation.input_fingerprint,
        },
    }


def operation_result(run: HostRun, key: str, state: Any, recorded: bool | None) -> dict[str, Any]:
    operation = run.operation(key)
    assert operation is not None
    document: dict[str, Any] = {
        "run": run.name,
        "operation_key": key,
        "step": operation.step_id,
        "tool": operation.tool,
        "observed": state_detail(state),
        "ledger_state": operation.state.value,
        "ledger_failure": operation.failure,
        "revision": run.revision,
    }
    if recorded is not None:
        document["newly_recorded"] = recorded
    if operation.retry_of is not None:
        # The last attempt of a step its retry policy retried: the whole chain.
        document["attempts"] = [
            {"operation_key": attempt.operation_key, "state": attempt.state.value}
            | ({} if attempt.failure is None else {"failure": attempt.failure})
            for attempt in run.ledger.attempts(key)
        ]
    return document


def _code(failure: str | None) -> str:
    return "" if failure is None else f" [{failure}]"


def result_lines(document: Mapping[str, Any]) -> list[str]:
    lines = [
        f"run:            {document['run']}",
        f"operation key:  {document['operation_key']}",
        f"step / tool:    {document['step']} / {document['tool']}",
        f"observed:       {state_text(document['observed'])}",
        f"ledger state:   {document['ledger_state']}{_code(document.get('ledger_failure'))}",
        f"revision:       {document['revision']}",
    ]
    if "compensation_key" in document:
        lines.insert(2, f"compensation:   {document['compensation_key']}")
    for number, attempt in enumerate(document.get("attempts", ()), start=1):
        failure = attempt.get("failure")
        state = attempt["state"] if failure is None else f"{attempt['state']} [{failure}]"
        lines.append(f"attempt {number}:      {attempt['operation_key']} {state}")
    return lines


def finish(
    out: Output, document: dict[str, Any], lines: list[str], state: StateKind, what: str
) -> int:
    """Print a verb's result; exit 0 only when ``state`` is ``succeeded``."""
    ok = state == StateKind.SUCCEEDED
    document = {"ok": ok, **document}
    for text in lines:
        out.line(text)
    out.document(document)
    if ok:
        return EXIT_OK
    if state in TERMINAL_KINDS:
        out.error(f"{what} ended {state.value}")
    else:
        out.error(f"{what} is still {state.value}; run {PROG} recover later")
    return EXIT_CHECK_FAILED
