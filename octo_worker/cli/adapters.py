"""``octo-worker adapters list``: the adapter plug-ins installed, enabled and loadable.

Owns loading the enabled adapters exactly as the daemon does (options that
start with ``./`` resolved against the state directory), which ``check``
uses too, and the listing of every ``octo.adapters`` entry point with its
declarations and deadline. It must never call an adapter method that acts.
"""

from __future__ import annotations

import argparse
import importlib.metadata
from typing import Any

from octo_common.errors import MissingAdapter, OctoError
from octo_common.runtime.output import (
    EXIT_CHECK_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    CliError,
    Output,
    print_table,
)
from octo_worker.adapters.contract import (
    ADAPTER_ENTRY_POINT_GROUP,
    effective_adapter_deadline,
    load_adapters,
)
from octo_worker.cli.common import Verbs, config_of, verb_group
from octo_worker.config import WorkerConfig

__all__ = ["adapter_options", "cmd_adapters_list", "load_enabled", "register"]


def register(verbs: Verbs, common: argparse.ArgumentParser) -> None:
    """Add ``adapters list`` to the verbs."""
    adapter_verbs = verb_group(verbs, "adapters", "installed adapter plug-ins")
    alist = adapter_verbs.add_parser(
        "list", parents=[common], help=f"entry points of {ADAPTER_ENTRY_POINT_GROUP}"
    )
    alist.set_defaults(handler=cmd_adapters_list)


def adapter_options(config: WorkerConfig) -> dict[str, dict[str, Any]]:
    # The daemon resolves option values starting with "./" against the state
    # directory; the check and the listing load adapters exactly the same way.
    def value(item: Any) -> Any:
        if isinstance(item, str) and item.startswith("./"):
            return str(config.state_path(item[2:]))
        return item

    return {
        name: {key: value(item) for key, item in options.items()}
        for name, options in config.adapters.options.items()
    }


def load_enabled(config: WorkerConfig) -> Any:
    enabled = list(config.adapters.enabled)
    try:
        return load_adapters(enabled, options=adapter_options(config))
    except MissingAdapter as error:
        raise CliError(
            EXIT_USAGE,
            f"adapters.enabled: {error.code}: {error} is not an installed "
            f"{ADAPTER_ENTRY_POINT_GROUP} entry point",
            error.code,
        ) from None
    except OctoError as error:
        raise CliError(EXIT_USAGE, f"adapters.enabled: {error.code}: {error}", error.code) from None


def cmd_adapters_list(args: argparse.Namespace, out: Output) -> int:
    config = config_of(args)
    enabled = list(config.adapters.enabled)
    installed: dict[str, importlib.metadata.EntryPoint] = {}
    for entry in importlib.metadata.entry_points(group=ADAPTER_ENTRY_POINT_GROUP):
        installed.setdefault(entry.name, entry)  # the first on the path wins, as in loading
    missing = [name for name in enabled if name not in installed]
    registry = load_enabled(config) if not missing else None
    items: list[dict[str, Any]] = []
    for name in sorted(set(installed) | set(enabled)):
        found = installed.get(name)
        item: dict[str, Any] = {
            "name": name,
            "installed": found is not None,
            "enabled": name in enabled,
            "entry_point": None if found is None else found.value,
            "distribution": None if found is None or found.dist is None else found.dist.name,
        }
        adapter = None if registry is None else registry.get(name)
        if adapter is not None:
            safety = adapter.invocation_safety()
            contract = adapter.durable_operation_contract()
            item.update(
                {
                    "tool": getattr(adapter, "tool", None) or name,
                    "invocation_safety": None if safety is None else str(safety),
                    "durable_operation_contract": None if contract is None else str(contract),
                    "deadline_seconds": effective_adapter_deadline(
                        adapter, config.adapters.deadline_seconds
                    ),
                }
            )
        items.append(item)
    rows = [["ADAPTER", "ENABLED", "INSTALLED", "CONTRACT", "SAFETY", "DEADLINE"]]
    for item in items:
        rows.append(
            [
                item["name"],
                "yes" if item["enabled"] else "no",
                "yes" if item["installed"] else "NO",
                str(item.get("durable_operation_contract") or "-"),
                str(item.get("invocation_safety") or "-"),
                f"{item['deadline_seconds']:g}s" if "deadline_seconds" in item else "-",
            ]
        )
    print_table(rows, out)
    out.document({"ok": not missing, "adapters": items})
    if missing:
        out.error(
            f"enabled adapter(s) not installed: {', '.join(missing)} "
            f"(no {ADAPTER_ENTRY_POINT_GROUP} entry point)"
        )
        return EXIT_CHECK_FAILED
    return EXIT_OK
