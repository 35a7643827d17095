"""``octo-host keys generate``: a new random 32-byte key file (mode 0600).

It must never print a key, or overwrite an existing key file.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import secrets
from pathlib import Path
from typing import Final

from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_STORAGE,
    EXIT_USAGE,
    CliError,
    OneLineParser,
    Output,
)
from octo_host.cli.options import Verbs, token_arg

__all__ = ["cmd_keys_generate", "register"]

_KEY_BYTES: Final = 32


def register(verbs: Verbs, common: OneLineParser) -> None:
    """Add ``keys generate`` to the verbs."""
    keys = verbs.add_parser("keys", help="key files")
    key_verbs = keys.add_subparsers(
        dest="keys_verb", metavar="VERB", required=True, parser_class=OneLineParser
    )
    generate = key_verbs.add_parser(
        "generate", parents=[common], help="write a new random 32-byte key file (mode 0600)"
    )
    which = generate.add_mutually_exclusive_group(required=True)
    which.add_argument("--scope", type=token_arg, metavar="S", help="a scope key: DIR/S.key")
    which.add_argument(
        "--storage", type=token_arg, metavar="ID", help="a storage key: DIR/storage-ID.key"
    )
    generate.add_argument("--out", required=True, metavar="DIR", help="directory (0700)")
    generate.set_defaults(handler=cmd_keys_generate)


def cmd_keys_generate(args: argparse.Namespace, out: Output) -> int:
    name = f"{args.scope}.key" if args.scope is not None else f"storage-{args.storage}.key"
    if name in (".key", "..key") or name.startswith("."):
        raise CliError(EXIT_USAGE, f"{name!r} is not a usable file name", "usage")
    directory = Path(args.out)
    try:
        if not directory.exists():
            directory.mkdir(mode=0o700, parents=True)
            os.chmod(directory, 0o700)
        elif not directory.is_dir():
            raise CliError(EXIT_USAGE, f"--out: {directory} is not a directory", "usage")
    except OSError as exc:
        raise CliError(EXIT_STORAGE, f"--out: {directory}: {exc.strerror}", "io") from None
    path = directory / name
    try:
        fd = os.open(
            path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
        )
    except FileExistsError:
        raise CliError(
            EXIT_CHECK_FAILED, f"{path} already exists; refusing to overwrite a key", "exists"
        ) from None
    except OSError as exc:
        raise CliError(EXIT_STORAGE, f"{path}: {exc.strerror}", "io") from None
    try:
        os.fchmod(fd, 0o600)
        content = (secrets.token_bytes(_KEY_BYTES).hex() + "\n").encode("ascii")
        os.write(fd, content)
        os.fsync(fd)
    except OSError as exc:
        os.close(fd)
        with contextlib.suppress(OSError):
            path.unlink()
        raise CliError(EXIT_STORAGE, f"{path}: {exc.strerror}", "io") from None
    os.close(fd)
    with contextlib.suppress(OSError):
        dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    kind = "scope" if args.scope is not None else "storage"
    out.line(str(path))
    out.document({"ok": True, "kind": kind, "path": str(path)})
    return EXIT_OK
