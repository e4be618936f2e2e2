"""The ``sparseops`` command: one module per subcommand.

Each subcommand module (``sparseops/cli/<name>.py``) defines ``HELP`` (one line for ``sparseops --help``),
``add_arguments(parser)`` and ``run(args) -> int``; its docstring is the subcommand's description. It
imports torch and the ops inside ``run`` only, so that ``sparseops --help`` and ``--version`` answer
without importing torch. Registering a subcommand is one entry in :data:`SUBCOMMANDS`.
``python -m sparseops`` is the same command.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: the subcommands, in the order ``sparseops --help`` lists them (modules of this package)
SUBCOMMANDS = ("info", "check", "bench", "fit", "demo", "train")

PROG = "sparseops"


def _version() -> str:
    from sparseops import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    """The parser of every subcommand (imports the subcommand modules, which do not import torch)."""
    p = argparse.ArgumentParser(
        prog=PROG,
        description="sparseops: MoE token permute/unpermute with EP ranges and NSA selected attention.",
    )
    p.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = p.add_subparsers(dest="command", metavar="{" + ",".join(SUBCOMMANDS) + "}")
    for name in SUBCOMMANDS:
        mod = importlib.import_module(f"{__name__}.{name}")
        sp = sub.add_parser(name, help=mod.HELP, description=(mod.__doc__ or mod.HELP).strip())
        mod.add_arguments(sp)
        sp.set_defaults(func=mod.run)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the ``sparseops`` command line; returns the exit status (0 ok, 1 a check failed, 2 usage)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 2
        raise
