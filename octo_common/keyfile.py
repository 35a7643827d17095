"""The one reader of key files and other private files.

Owns the file rule every key, storage key and password file obeys: the
path names a regular file (never a symbolic link, FIFO, directory or
device) with no permission bit for group or others, read with a bound. A
key file then holds exactly 32 raw bytes, or exactly 64 lowercase hex
characters and at most one trailing ``\\n``.

The file must be owned by the user the process runs as, and no directory
on its path may be writable (or owned) by anyone but that user or root, so
that nobody else can swap the file for one of theirs. The file is judged
where it really is: the directories above it are
resolved first (a key inside a symlinked directory, such as a systemd
credentials directory, is read), but the file itself must not be a link.

It lives beside the protocol rather than in :mod:`octo_common.runtime`
because the public ``ScopeKey.from_file`` of :mod:`octo_common.frames` is
built on it, and no protocol module imports the runtime. It does plain
``os`` reads only: no asyncio, no sqlite, no network. It must never put a
byte of a file's content into an exception, a log or a return value other
than the key itself; :class:`KeyFileRefused` names the path, the problem
and at most the file's mode or the OS error text.
"""

from __future__ import annotations

import os
import re
import stat
from typing import Final, Literal

from octo_common.limits import SCOPE_KEY_BYTES

__all__ = [
    "KEY_BYTES",
    "KeyFileRefused",
    "Refusal",
    "parse_key_content",
    "read_key_file",
    "read_private_file",
]

KEY_BYTES: Final = SCOPE_KEY_BYTES  # scope and storage keys are both 32 bytes
# One byte more than the longest valid key file (64 hex + "\n"): a longer
# file is refused without reading the rest.
_KEY_READ_LIMIT: Final = 2 * KEY_BYTES + 2
_LOWER_HEX64: Final = re.compile(rb"[0-9a-f]{64}\n?")

Refusal = Literal[
    "missing",
    "unopenable",
    "not_regular",
    "permissions",
    "owner",
    "directory",
    "unreadable",
    "format",
]


class KeyFileRefused(Exception):
    """A private file that breaks the rule; ``reason`` says which part.

    ``str()`` is one line naming the path (as given) and the problem; it
    never contains file content. Callers translate it into their own
    ``OctoError`` (``InvalidScopeKey``, ``InvalidStorageKey``,
    ``InvalidConfiguration``).
    """

    def __init__(self, reason: Refusal, path: str | os.PathLike[str], detail: str = "") -> None:
        self.reason: Refusal = reason
        self.path = os.fspath(path)
        self.detail = detail
        super().__init__(self._describe())

    def _describe(self) -> str:
        path = self.path
        if self.reason == "missing":
            return f"{path} does not exist"
        if self.reason == "unopenable":
            return f"cannot open {path} ({self.detail})"
        if self.reason == "not_regular":
            return f"{path} is not a regular file"
        if self.reason == "permissions":
            return (
                f"{path} grants permissions to group or others "
                f"(mode {self.detail}); run chmod 600 {path}"
            )
        if self.reason == "owner":
            return (
                f"{path} is owned by uid {self.detail}, not by the user this process runs as"
                f" (uid {os.geteuid()}); run chown to that user"
            )
        if self.reason == "directory":
            return f"{path}: {self.detail}"
        if self.reason == "unreadable":
            return f"cannot read {path} ({self.detail})"
        return f"{path} must hold 32 raw bytes or 64 lowercase hex characters"


def _strerror(exc: OSError) -> str:
    if exc.strerror:
        return exc.strerror
    return os.strerror(exc.errno) if exc.errno is not None else type(exc).__name__


def _resolved(path: str | os.PathLike[str]) -> str:
    """``path`` with its directories resolved and its last component kept as it is."""
    text = os.fspath(path)
    directory, name = os.path.split(text)
    if not name:  # "dir/": nothing to keep apart; the open refuses a directory
        return text
    return os.path.join(os.path.realpath(directory or os.curdir), name)


def _directory_problem(directory: str) -> str | None:
    """Why someone other than this user (or root) could replace a file in ``directory``.

    The directory itself must be owned by this user or root and writable by
    neither group nor others; each directory above it likewise, except that
    one with the sticky bit (``/tmp``) may be writable by others, who cannot
    then rename what they do not own.
    """
    allowed = {0, os.geteuid()}
    current = directory
    first = True
    while True:
        try:
            info = os.stat(current)
        except OSError as exc:
            return f"cannot inspect directory {current} ({_strerror(exc)})"
        if info.st_uid not in allowed:
            return f"directory {current} is owned by uid {info.st_uid}, not by this user or root"
        writable = info.st_mode & 0o022
        if writable and (first or not info.st_mode & stat.S_ISVTX):
            return (
                f"directory {current} is writable by group or others"
                f" (mode {info.st_mode & 0o7777:o}); run chmod go-w {current}"
            )
        parent = os.path.dirname(current)
        if parent == current:
            return None
        current, first = parent, False


def read_private_file(path: str | os.PathLike[str], limit: int) -> bytes:
    """At most ``limit`` bytes of a regular, private file that is not a link.

    Raises :class:`KeyFileRefused` with reason ``missing``, ``unopenable``
    (a symbolic link, no permission to read, ...), ``not_regular``,
    ``permissions`` (any bit of ``0o077``), ``owner`` (not owned by the
    user this process runs as), ``directory`` (a directory on its path that
    someone else may write or owns) or ``unreadable``.
    """
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    resolved = _resolved(path)
    try:
        # O_NONBLOCK: a FIFO must not block the open; it is then refused below.
        fd = os.open(resolved, flags | os.O_NONBLOCK)
    except FileNotFoundError:
        raise KeyFileRefused("missing", path) from None
    except OSError as exc:
        raise KeyFileRefused("unopenable", path, _strerror(exc)) from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise KeyFileRefused("not_regular", path)
        if info.st_mode & 0o077:
            raise KeyFileRefused("permissions", path, f"{info.st_mode & 0o777:o}")
        if info.st_uid != os.geteuid():
            raise KeyFileRefused("owner", path, str(info.st_uid))
        problem = _directory_problem(os.path.dirname(resolved))
        if problem is not None:
            raise KeyFileRefused("directory", path, problem)
        chunks: list[bytes] = []
        remaining = limit
        while remaining > 0:
            chunk = os.read(fd, remaining)
            if not chunk:
                break
            chunks.append(chunk)
            remaining -= len(chunk)
    except OSError as exc:
        raise KeyFileRefused("unreadable", path, _strerror(exc)) from None
    finally:
        os.close(fd)
    return b"".join(chunks)


def parse_key_content(content: bytes) -> bytes | None:
    """The 32-byte key a key file's content holds, or None when it holds none.

    Exactly 32 bytes are the key itself; otherwise exactly 64 lowercase hex
    characters with at most one trailing ``\\n``. Nothing is stripped.
    """
    if len(content) == KEY_BYTES:
        return bytes(content)
    if _LOWER_HEX64.fullmatch(content) is not None:
        return bytes.fromhex(content[: 2 * KEY_BYTES].decode("ascii"))
    return None


def read_key_file(path: str | os.PathLike[str]) -> bytes:
    """The 32 key bytes of a key file; :class:`KeyFileRefused` (``format`` too) otherwise."""
    key = parse_key_content(read_private_file(path, _KEY_READ_LIMIT))
    if key is None:
        raise KeyFileRefused("format", path)
    return key
