"""Both command lines explain themselves: a version, help for every verb, option and
argument, and every exit status in the top-level help."""

from __future__ import annotations

import argparse
import importlib.metadata
from collections.abc import Iterator

import pytest

from octo_host.cli import main as host_main
from octo_host.cli.main import build_parser as host_parser
from octo_worker.cli import build_parser as worker_parser
from octo_worker.cli import main as worker_main

PARSERS = {"octo-worker": worker_parser, "octo-host": host_parser}


def parsers(
    parser: argparse.ArgumentParser, path: str
) -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from parsers(child, f"{path} {name}")


@pytest.mark.parametrize("prog", sorted(PARSERS))
def test_every_option_and_argument_has_help(prog: str) -> None:
    missing = []
    for path, parser in parsers(PARSERS[prog](), prog):
        for action in parser._actions:
            if isinstance(action, argparse._HelpAction | argparse._VersionAction):
                continue
            if isinstance(action, argparse._SubParsersAction):
                for choice in action._choices_actions:
                    if not choice.help:
                        missing.append(f"{path} {choice.dest}")
                continue
            if action.help == argparse.SUPPRESS:
                continue
            if not action.help:
                missing.append(
                    f"{path} {'/'.join(action.option_strings) or action.metavar or action.dest}"
                )
    assert missing == []


@pytest.mark.parametrize(("prog", "main"), [("octo-worker", worker_main), ("octo-host", host_main)])
def test_version_prints_the_installed_version(
    prog: str, main: object, capsys: pytest.CaptureFixture[str]
) -> None:
    assert callable(main)
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"{prog} {importlib.metadata.version('octo')}"


def test_worker_help_names_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert worker_main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for status in ("0 ok", "1 ", "2 usage", "3 broker", "4 storage", "5 run stopped"):
        assert status in text, status


def test_host_help_names_every_exit_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert host_main(["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())
    for status in ("0 ok", "1 refused", "2 usage", "3 broker", "4 storage"):
        assert status in text, status
