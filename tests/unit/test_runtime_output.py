"""The command-line output both CLIs share: escaping, one-line errors, --json, closed pipes."""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
import structlog

from octo_common.payload import ToolPayload
from octo_common.runtime.output import (
    EXIT_BROKER,
    EXIT_CHECK_FAILED,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    Output,
    StdoutGone,
    anchor_to_write,
    broker_unreachable,
    common_options,
    drop_event,
    drop_exception_text,
    fail,
    one_line,
    print_table,
    printable,
    run_command,
    run_verb,
    state_detail,
    state_line,
)
from octo_common.states import Failed, Pending, Running, Succeeded


def output(json_mode: bool = False) -> tuple[Output, io.StringIO, io.StringIO]:
    stdout, stderr = io.StringIO(), io.StringIO()
    return Output("octo-test", json_mode, stdout, stderr), stdout, stderr


class _ClosedPipe(io.StringIO):
    def write(self, text: str) -> int:
        raise BrokenPipeError()


# Escaping untrusted text ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("plain text", "plain text"),
        ("tab\there\nnew\x1b[2J", "tab\\u0009here\\u000anew\\u001b[2J"),
        ("\x7f", "\\u007f"),
        ("é", "\\u00e9"),
        ("\u263a", "\\u263a"),
        ("\U0001f600", "\\U0001f600"),
        (b"ok\xff\xc3\xa9", "ok\\xff\\u00e9"),
        (42, "42"),
    ],
)
def test_printable_escapes_everything_outside_printable_ascii(value: object, shown: str) -> None:
    assert printable(value) == shown


def test_characters_above_latin_1_never_print_alike() -> None:
    # The worker's old escape kept only the low byte: U+013A, U+023A and U+263A
    # all printed as \x3a. Each now keeps its whole code point.
    shown = {printable(ch) for ch in ("\u013a", "\u023a", "\u263a", "\u003a", "\u00ba")}
    assert len(shown) == 5
    assert printable("\u023a") == "\\u023a"


def test_printable_is_bounded() -> None:
    assert printable("x" * 10, limit=4) == "xxxx..."
    assert printable("é" * 10, limit=12) == "\\u00e9\\u00e9..."
    assert printable("x" * 4, limit=4) == "xxxx"


def test_one_line_folds_every_run_of_white_space() -> None:
    assert one_line("  a\n\tb  c\r\n") == "a b c"


# Output and failures ----------------------------------------------------------------------


def test_human_mode_prints_lines_and_tables_and_no_document() -> None:
    out, stdout, stderr = output()
    out.line("first")
    print_table([["a", "long-cell", "x"], ["long-a", "b", "y"]], out)
    print_table([], out)
    out.document({"ignored": True})
    assert stdout.getvalue().splitlines() == [
        "first",
        "a       long-cell  x",
        "long-a  b          y",
    ]
    assert stderr.getvalue() == ""


def test_json_mode_prints_one_document_and_no_lines() -> None:
    out, stdout, _ = output(json_mode=True)
    out.line("ignored")
    out.document({"ok": True, "items": [1]})
    assert json.loads(stdout.getvalue()) == {"ok": True, "items": [1]}


@pytest.mark.parametrize("json_mode", [False, True])
def test_a_failure_is_one_line_on_stderr_and_with_json_one_error_document(
    json_mode: bool,
) -> None:
    out, stdout, stderr = output(json_mode)
    assert fail(out, 4, "journal storage:\n  broken", "storage_backend_error") == 4
    assert stderr.getvalue() == "octo-test: journal storage: broken\n"
    if json_mode:
        assert json.loads(stdout.getvalue()) == {
            "ok": False,
            "error": {"code": "storage_backend_error", "message": "journal storage: broken"},
        }
    else:
        assert stdout.getvalue() == ""


def test_a_closed_standard_output_is_its_own_exception() -> None:
    out = Output("octo-test", False, _ClosedPipe(), io.StringIO())
    with pytest.raises(StdoutGone):
        out.line("lost")


def test_a_usage_error_is_one_line_naming_the_verb() -> None:
    parser = OneLineParser(prog="octo-test")
    verbs = parser.add_subparsers(dest="verb", required=True, parser_class=OneLineParser)
    verbs.add_parser("show").add_argument("--count", type=int)
    with pytest.raises(CliError) as raised:
        parser.parse_args(["show", "--count", "many"])
    assert (raised.value.status, raised.value.code) == (EXIT_USAGE, "usage")
    assert raised.value.message.startswith("show: argument --count: invalid int value")
    assert raised.value.message.endswith("(see --help)")
    with pytest.raises(CliError) as root:
        parser.parse_args([])
    assert not root.value.message.startswith(":")


# Logging ------------------------------------------------------------------------------------


@pytest.mark.parametrize("form", ["instance", "tuple", "true"])
def test_exception_text_never_reaches_a_log_line(form: str) -> None:
    try:
        raise ValueError("adapter text with a secret")
    except ValueError as exc:
        info: Any = {"instance": exc, "tuple": (ValueError, exc, None), "true": True}[form]
        event = drop_exception_text(
            None, "error", {"event": "failed", "exc_info": info, "stack": "s", "exception": "e"}
        )
    assert event == {"event": "failed", "error_type": "ValueError"}


def test_the_processor_keeps_events_without_exceptions() -> None:
    assert drop_exception_text(None, "info", {"event": "ok", "n": 1}) == {"event": "ok", "n": 1}
    with pytest.raises(structlog.DropEvent):
        drop_event(None, "info", {})


# Running a verb ------------------------------------------------------------------------------


def _report(error: Exception) -> tuple[int, str, str] | None:
    if isinstance(error, LookupError):
        return (3, f"lookup: {error}", "lookup")
    return None


def _raising(error: BaseException) -> Any:
    def body() -> int:
        raise error

    return body


@pytest.mark.parametrize(
    ("error", "status", "line"),
    [
        (CliError(4, "journal storage: gone", "storage"), 4, "octo-test: journal storage: gone"),
        (KeyError("k"), 3, "octo-test: lookup: 'k'"),
        (ValueError("secret adapter text"), 1, "octo-test: internal error (ValueError)"),
    ],
)
def test_every_way_a_verb_ends_is_one_exit_status_and_one_line(
    error: Exception, status: int, line: str
) -> None:
    out, _, stderr = output()
    assert run_command(out, _raising(error), _report) == status
    assert stderr.getvalue().splitlines() == [line]


def test_a_verb_that_returns_keeps_its_status_and_ctrl_c_is_130() -> None:
    out, _, stderr = output()
    assert run_command(out, lambda: 0, _report) == 0
    assert run_command(out, _raising(KeyboardInterrupt()), _report) == 130
    assert stderr.getvalue() == ""


# The pieces both commands are built from ------------------------------------------------


def test_common_options_are_config_and_json() -> None:
    common = common_options("/etc/octo/x.toml", "x")
    parser = OneLineParser(prog="octo-test", parents=[common])
    assert vars(parser.parse_args([])) == {"config": "/etc/octo/x.toml", "json": False}
    assert vars(parser.parse_args(["--config", "a.toml", "--json"])) == {
        "config": "a.toml",
        "json": True,
    }
    assert "x configuration (default /etc/octo/x.toml)" in parser.format_help()


def verb_parser(handler: Any) -> Any:
    def build() -> OneLineParser:
        parser = OneLineParser(prog="octo-test")
        verbs = parser.add_subparsers(dest="verb", required=True, parser_class=OneLineParser)
        verb = verbs.add_parser("go", parents=[common_options("c.toml", "test")])
        verb.set_defaults(handler=handler)
        return parser

    return build


def test_run_verb_prepares_then_runs_the_chosen_handler(
    capsys: pytest.CaptureFixture[str],
) -> None:
    seen: list[str] = []

    def handler(args: Any, out: Output) -> int:
        seen.append(f"handler json={out.json_mode} config={args.config}")
        out.document({"ok": True})
        return 7

    status = run_verb(
        "octo-test",
        ["go", "--json"],
        verb_parser(handler),
        lambda error: None,
        lambda args: seen.append(f"prepare {args.verb}"),
    )
    assert status == 7
    assert seen == ["prepare go", "handler json=True config=c.toml"]
    assert json.loads(capsys.readouterr().out) == {"ok": True}


def test_run_verb_maps_an_error_through_report_and_help_exits_zero(
    capsys: pytest.CaptureFixture[str],
) -> None:
    def handler(args: Any, out: Output) -> int:
        raise KeyError("secret text")

    def report(error: Exception) -> tuple[int, str, str] | None:
        return (4, "mapped", "mapped_code") if isinstance(error, KeyError) else None

    assert run_verb("octo-test", ["go"], verb_parser(handler), report, lambda args: None) == 4
    assert capsys.readouterr().err == "octo-test: mapped\n"
    assert run_verb("octo-test", ["--help"], verb_parser(handler), report, print) == 0
    assert run_verb("octo-test", ["nope"], verb_parser(handler), report, print) == EXIT_USAGE


def test_state_detail_shows_sizes_never_content() -> None:
    assert state_detail(Pending()) == {"state": "pending"}
    assert state_detail(Running()) == {"state": "running"}
    assert state_detail(Succeeded(ToolPayload.text("héllo"))) == {
        "state": "succeeded",
        "payload": {"format": "text", "bytes": 6},
    }
    detail = state_detail(Succeeded(ToolPayload.json({"k": "secret"})))
    assert detail["payload"]["format"] == "json" and "secret" not in json.dumps(detail)
    assert state_detail(Failed("disk on fire")) == {"state": "failed", "message_bytes": 12}


def test_broker_unreachable_is_one_broker_error_line() -> None:
    error = broker_unreachable("amqp://127.0.0.1:5672/", "cannot connect (OSError)", "broker_x")
    assert (error.status, error.code) == (EXIT_BROKER, "broker_x")
    assert error.message == "broker amqp://127.0.0.1:5672/ unreachable: cannot connect (OSError)"


def test_anchor_to_write_is_configured_and_absent_unless_forced(tmp_path: Path) -> None:
    anchor = tmp_path / "ledger.anchor"
    with pytest.raises(CliError) as missing:
        anchor_to_write(None, "ledger.anchor", False, "--force replaces it")
    assert (missing.value.status, missing.value.code) == (EXIT_USAGE, "invalid_configuration")
    assert missing.value.message == "ledger.anchor is not configured"
    assert anchor_to_write(anchor, "ledger.anchor", False, "--force replaces it") == anchor
    anchor.write_text("{}")
    with pytest.raises(CliError) as exists:
        anchor_to_write(anchor, "ledger.anchor", False, "--force replaces it")
    assert (exists.value.status, exists.value.code) == (EXIT_CHECK_FAILED, "exists")
    assert exists.value.message == f"{anchor} already exists (--force replaces it)"
    assert anchor_to_write(anchor, "ledger.anchor", True, "--force replaces it") == anchor


def test_state_line_names_the_sizes_as_the_command_calls_them() -> None:
    assert state_line(state_detail(Pending())) == "pending"
    succeeded = state_detail(Succeeded(ToolPayload.json({"a": 1})))
    assert state_line(succeeded) == "succeeded (payload: json, 7 bytes)"
    assert state_line(succeeded, payload="output") == "succeeded (output: json, 7 bytes)"
    failed = state_detail(Failed("no such file"))
    assert state_line(failed) == "failed (failure message: 12 bytes)"
    assert state_line(failed, failure="failure text withheld") == (
        "failed (failure text withheld: 12 bytes)"
    )
