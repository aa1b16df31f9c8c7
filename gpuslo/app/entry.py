"""The console script: the CLI, and one clear line (not a traceback) when a command runs in an
environment that lacks the extra it needs (`pip install gpuslo` alone is the slim core; each role
is an extra: gpuslo[agent], gpuslo[ingest], gpuslo[rules], gpuslo[dashboards], gpuslo[all])."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable, Sequence

#: the top-level module of every third-party distribution an extra adds (pyproject.toml's
#: [project.optional-dependencies]; tests/test_extras.py checks the two agree both ways)
OPTIONAL_MODULES = frozenset(
    {
        "attr",
        "chdb",
        "clickhouse_driver",
        "crc32c",
        "grafanalib",
        "grpc",
        "kafka",
        "numpy",
        "prometheus_client",
        "pyarrow",
        "pynvml",
    }
)

#: the extra each command needs
COMMAND_EXTRA = {
    "agent": "agent",
    "ingest": "ingest",
    "schema": "ingest",
    "rules": "rules",
    "dashboards": "dashboards",
    "report": "dashboards",
    "demo": "all",
}


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand named on the command line (the first word that is one), if any."""
    return next((word for word in argv if word in COMMAND_EXTRA), None)


def installed(module: str) -> bool:
    """Whether a top-level module can be found (imported or not)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a finder that refuses it; a module left without a spec
        return False


def missing_extra(
    exc: ModuleNotFoundError, argv: Sequence[str], is_installed: Callable[[str], bool] = installed
) -> str | None:
    """The line to print when `exc` is an optional dependency that is not installed, else None
    (also when the dependency is there but a part of it is missing: a broken install, which
    installing the extra would not mend, keeps its traceback)."""
    module = (exc.name or "").partition(".")[0]
    if module not in OPTIONAL_MODULES or is_installed(module):
        return None
    command = command_of(argv)
    extra = COMMAND_EXTRA.get(command or "", "all")
    who = f"gpuslo {command}" if command else "gpuslo"
    return (
        f"{who}: the Python module {module!r} is not installed; this command needs gpuslo[{extra}]: "
        f"pip install 'gpuslo[{extra}]'"
    )


def main(argv: Sequence[str] | None = None) -> int:
    from gpuslo.app.cli import main as cli_main

    words = list(sys.argv[1:] if argv is None else argv)
    try:
        return cli_main(words)
    except ModuleNotFoundError as exc:
        line = missing_extra(exc, words)
        if line is None:
            raise
        print(line, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
