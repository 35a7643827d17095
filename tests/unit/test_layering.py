"""Import rules between the packages, read from the source (docs/architecture.md).

* The protocol modules of ``octo_common`` (everything outside
  ``octo_common/runtime/``) import no I/O module and nothing from
  ``octo_common.runtime``.
* ``octo_common.runtime`` is imported by ``octo_worker`` and ``octo_host``
  only, and imports neither of them.
* ``octo_worker`` and ``octo_host`` never import each other.

Every ``import`` statement counts, also one inside a function.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNTIME = "octo_common.runtime"
IO_MODULES = frozenset(
    {
        "asyncio",
        "sqlite3",
        "socket",
        "ssl",
        "aio_pika",
        "aiormq",
        "pamqp",
        "asyncpg",
        "psycopg",
        "subprocess",
        "selectors",
        "threading",
    }
)


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def imported(path: Path) -> Iterator[str]:
    """Every module name an import statement of ``path`` names (``from a import b``: a and a.b)."""
    source = path.read_text(encoding="utf-8")
    return imported_by(source, module_name(path), path.name == "__init__.py")


def imported_by(source: str, module: str, is_package: bool) -> Iterator[str]:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")
                if not is_package:
                    base = base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join([*base, node.module] if node.module else base)
            else:
                source = node.module or ""
            yield source
            for alias in node.names:
                yield f"{source}.{alias.name}"


def top(name: str) -> str:
    return name.split(".", 1)[0]


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


PROTOCOL_MODULES = [
    path for path in modules("octo_common") if not within(module_name(path), RUNTIME)
]


def test_the_protocol_modules_are_found() -> None:
    names = {module_name(path) for path in PROTOCOL_MODULES}
    assert {"octo_common.frames", "octo_common.transport", "octo_common.keyfile"} <= names
    assert not any(within(name, RUNTIME) for name in names)


@pytest.mark.parametrize("path", PROTOCOL_MODULES, ids=module_name)
def test_a_protocol_module_imports_no_io_module_and_no_runtime(path: Path) -> None:
    bad = sorted(
        {name for name in imported(path) if top(name) in IO_MODULES or within(name, RUNTIME)}
    )
    assert bad == [], f"{module_name(path)} imports {bad}"


def test_runtime_is_imported_only_by_the_worker_and_the_host() -> None:
    importers = {
        module_name(path)
        for package in ("octo_common", "octo_worker", "octo_host")
        for path in modules(package)
        if not within(module_name(path), RUNTIME)
        and any(within(name, RUNTIME) for name in imported(path))
    }
    assert importers, "nothing imports the runtime: this test would check nothing"
    assert {top(name) for name in importers} <= {"octo_worker", "octo_host"}, importers


@pytest.mark.parametrize("path", modules(RUNTIME.replace(".", "/")), ids=module_name)
def test_runtime_imports_neither_the_worker_nor_the_host(path: Path) -> None:
    bad = sorted({name for name in imported(path) if top(name) in ("octo_worker", "octo_host")})
    assert bad == [], f"{module_name(path)} imports {bad}"


@pytest.mark.parametrize(
    ("package", "other"), [("octo_worker", "octo_host"), ("octo_host", "octo_worker")]
)
def test_the_worker_and_the_host_never_import_each_other(package: str, other: str) -> None:
    bad = sorted(
        {
            f"{module_name(path)} -> {name}"
            for path in modules(package)
            for name in imported(path)
            if top(name) == other
        }
    )
    assert bad == []


def test_the_scanner_sees_imports_inside_functions_and_relative_ones() -> None:
    # A check of the checker: nested, relative and package-relative imports are found.
    assert module_name(ROOT / "octo_common" / "runtime" / "__init__.py") == RUNTIME
    source = "def f():\n    import sqlite3\n    from asyncio import sleep\nfrom . import runtime\n"
    names = set(imported_by(source, "octo_common.frames", is_package=False))
    assert {"sqlite3", "asyncio", "asyncio.sleep", "octo_common.runtime"} <= names
    names = set(imported_by("from .sqlite import x\n", RUNTIME, is_package=True))
    assert "octo_common.runtime.sqlite.x" in names


# Inside the host ---------------------------------------------------------------------------

# The host's pure core (a protocol as a pure state machine, as in h11): no I/O, and nothing
# from the host's I/O modules.
HOST_PURE = (
    "octo_host.plan",
    "octo_host.policy",
    "octo_host.ledger",
    "octo_host.ledger_json",
    "octo_host.ledger_records",
    "octo_host.retries",
    "octo_host.compensation",
    "octo_host.engine",
    "octo_host.kinds",
    "octo_host.reactions",
)


def host_modules() -> dict[str, Path]:
    return {module_name(path): path for path in modules("octo_host")}


def host_module_of(name: str, known: dict[str, Path]) -> str | None:
    """The octo_host module an imported name belongs to (``octo_host.ledger.X`` -> ledger)."""
    while name and name not in known:
        name = name.rpartition(".")[0]
    return name or None


@pytest.mark.parametrize("name", HOST_PURE)
def test_a_pure_host_module_imports_no_io_and_no_host_io_module(name: str) -> None:
    known = host_modules()
    bad = sorted(
        {
            imported_name
            for imported_name in imported(known[name])
            # The engine's id counter takes a lock: a lock is no I/O.
            if top(imported_name) in IO_MODULES - {"threading"}
            or within(imported_name, RUNTIME)
            or (
                top(imported_name) == "octo_host"
                and host_module_of(imported_name, known) not in HOST_PURE
            )
        }
    )
    assert bad == [], f"{name} imports {bad}"


def host_import_graph() -> dict[str, set[str]]:
    known = host_modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {host_module_of(imported_name, known) for imported_name in imported(path)}
        graph[name] = {target for target in targets if target is not None and target != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import path per cycle found by a depth-first walk (empty: none)."""
    found: list[list[str]] = []
    done: set[str] = set()

    def walk(node: str, path: list[str]) -> None:
        for target in sorted(graph.get(node, ())):
            if target in path:
                found.append([*path[path.index(target) :], target])
            elif target not in done:
                walk(target, [*path, target])
        done.add(node)

    for node in sorted(graph):
        if node not in done:
            walk(node, [node])
    return found


def test_the_host_modules_import_each_other_without_a_cycle() -> None:
    # Every import counts, one under TYPE_CHECKING too.
    graph = host_import_graph()
    assert graph["octo_host.engine"] >= {"octo_host.ledger", "octo_host.compensation"}
    assert cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    # A check of the checker.
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b"}, "b": set(), "c": {"b"}}) == []


# Inside the worker --------------------------------------------------------------------------

# What a session and its rules are built from: the storage interface and documents, never a
# backend (a second backend is added without touching them).
WORKER_BACKEND_FREE = (
    "octo_worker.session",
    "octo_worker.session.session",
    "octo_worker.session.decisions",
    "octo_worker.session.steps",
    "octo_worker.session.commits",
    "octo_worker.session.rules",
    "octo_worker.session.request_kinds",
    "octo_worker.hooks",
    "octo_worker.storage.interface",
    "octo_worker.storage.documents",
)
WORKER_BACKENDS = (
    "octo_worker.store",
    "octo_worker.storage.sqlite",
    "octo_worker.storage.sqlite_reader",
    "octo_worker.storage.sqlite_writer",
    "octo_worker.storage.sqlite_rows",
    "octo_worker.storage.sqlite_heads",
    "octo_worker.storage.postgres",
    "octo_worker.storage.postgres_sql",
    "octo_worker.storage.configured",
    "octo_common.runtime.sqlite",
    "octo_common.runtime.postgres",
)


@pytest.mark.parametrize("name", WORKER_BACKEND_FREE)
def test_the_session_and_its_rules_import_no_storage_backend(name: str) -> None:
    known = {module_name(path): path for path in modules("octo_worker")}
    bad = sorted(
        {
            imported_name
            for imported_name in imported(known[name])
            if top(imported_name) in ("sqlite3", "asyncpg")
            or any(within(imported_name, backend) for backend in WORKER_BACKENDS)
        }
    )
    assert bad == [], f"{name} imports {bad}"


def test_the_worker_modules_import_each_other_without_a_cycle() -> None:
    known = {module_name(path): path for path in modules("octo_worker")}
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        targets = {host_module_of(imported_name, known) for imported_name in imported(path)}
        graph[name] = {target for target in targets if target is not None and target != name}
    assert graph["octo_worker.session.session"] >= {"octo_worker.session.decisions"}
    assert cycles(graph) == []


# The worker's pure rules and values (pure state machines, as in h11): no I/O, and nothing
# from the worker's I/O modules. The session's decisions read these; the daemon and the
# session drive the I/O.
WORKER_PURE = (
    "octo_worker.journal",
    "octo_worker.hooks",
    "octo_worker.session.rules",
    "octo_worker.session.request_kinds",
    "octo_worker.session.state",
    "octo_worker.session.steps",
    "octo_worker.session.decisions",
    "octo_worker.daemon.routes",
    "octo_worker.adapters.context",
    "octo_worker.adapters.declarations",
    "octo_worker.storage.interface",
    "octo_worker.storage.documents",
    "octo_worker.storage.changesets",
    "octo_worker.storage.journal_items",
)


def worker_modules() -> dict[str, Path]:
    return {module_name(path): path for path in modules("octo_worker")}


@pytest.mark.parametrize("name", WORKER_PURE)
def test_a_pure_worker_module_imports_no_io_and_no_worker_io_module(name: str) -> None:
    known = worker_modules()
    bad = sorted(
        {
            imported_name
            for imported_name in imported(known[name])
            if top(imported_name) in IO_MODULES
            or within(imported_name, RUNTIME)
            or (
                top(imported_name) == "octo_worker"
                and host_module_of(imported_name, known) not in WORKER_PURE
            )
        }
    )
    assert bad == [], f"{name} imports {bad}"


def folder_of(name: str) -> str:
    """The folder of an octo_worker module: its package below octo_worker (``daemon``,
    ``session``...), or the module itself when it sits at the top (``journal``)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def worker_folder_graph() -> dict[str, set[str]]:
    known = worker_modules()
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        source = folder_of(name)
        targets = {host_module_of(imported_name, known) for imported_name in imported(path)}
        graph.setdefault(source, set()).update(
            folder_of(target)
            for target in targets
            if target is not None and folder_of(target) != source
        )
    return graph


def test_the_worker_folders_import_each_other_without_a_cycle() -> None:
    # A package's __init__ re-exporting its own modules stays inside its folder.
    graph = worker_folder_graph()
    assert {"daemon", "session", "adapters", "storage", "cli", "console"} <= set(graph)
    assert "session" in graph["daemon"] and "adapters" in graph["session"]
    assert cycles(graph) == []


def test_what_a_session_settles_a_delivery_through_imports_neither_daemon_nor_session() -> None:
    # The session's driver acks and replies through the transport: were it to import the
    # daemon, the session would reach back into the daemon on every handling.
    graph = worker_folder_graph()
    assert graph["transport"] <= {"hooks"}, graph["transport"]
    assert "transport" in graph["daemon"]


def test_at_most_eight_modules_sit_at_the_top_of_the_worker() -> None:
    top_level = sorted(path.name for path in (ROOT / "octo_worker").glob("*.py"))
    assert len(top_level) <= 8, top_level


def type_checking_defs(source: str) -> list[str]:
    """The functions an ``if TYPE_CHECKING:`` block of ``source`` declares."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.If)
            and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING"
        ):
            found += [
                item.name
                for child in node.body
                for item in ast.walk(child)
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef)
            ]
    return found


def test_no_worker_module_declares_methods_under_type_checking() -> None:
    # Parts are objects built with what they need, never mixins that declare each
    # other's methods for the type checker.
    stubs = {
        module_name(path): names
        for path in modules("octo_worker")
        if (names := type_checking_defs(path.read_text(encoding="utf-8")))
    }
    assert stubs == {}
    # A check of the checker.
    sample = "if TYPE_CHECKING:\n    class A:\n        async def part(self) -> None: ...\n"
    assert type_checking_defs(sample) == ["part"]


def classes_declaring_a_signature(source: str) -> set[str]:
    """The classes of ``source`` whose body holds an ``if TYPE_CHECKING:`` declaration."""
    return {
        node.name
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.ClassDef)
        and any(type_checking_defs(ast.unparse(item)) for item in node.body)
    }


# A struct's constructor signature is read from its fields: field specifiers
# shape it (a leading keyword, a constructor default, a part laid flat), and a
# constructor that normalises a value does so in ``__post_init__``. No class
# restates its signature, or any other method, for the type checker.
def test_no_class_declares_its_signature_for_the_type_checker() -> None:
    declaring = {
        f"{module_name(path)}.{name}"
        for package in ("octo_common", "octo_worker", "octo_host")
        for path in modules(package)
        for name in classes_declaring_a_signature(path.read_text(encoding="utf-8"))
    }
    assert declaring == set()
    # A check of the checker.
    sample = "class A:\n    if TYPE_CHECKING:\n        def __init__(self) -> None: ...\n"
    assert classes_declaring_a_signature(sample) == {"A"}
