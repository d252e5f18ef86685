"""One entry point for a harness of several modes: `python -m benchmarks.<harness> MODE [options]` runs that mode's
module with the options (`MODE --help` lists them)."""

from __future__ import annotations

import importlib
import sys


def dispatch(harness: str, modes: dict[str, tuple[str, str]], argv: list[str] | None = None) -> None:
    """modes: name -> (module, one line on what it measures)."""
    argv = sys.argv[1:] if argv is None else argv
    listing = "\n".join(f"  {name:<10} {summary}" for name, (_, summary) in modes.items())
    usage = f"usage: python -m benchmarks.{harness} MODE [options]   (MODE --help for its options)\n\nmodes:\n{listing}"
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return
    if argv[0] not in modes:
        print(f"benchmarks.{harness}: unknown mode '{argv[0]}'; choose one of {', '.join(modes)}", file=sys.stderr)
        sys.exit(2)
    sys.argv = [f"python -m benchmarks.{harness} {argv[0]}", *argv[1:]]
    importlib.import_module(modes[argv[0]][0]).main()
