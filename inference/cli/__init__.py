"""`specheads` command line: argv parsing and printing live here, never in the library.

One module per subcommand, each with `NAME`, `HELP`, `DESCRIPTION`, `add_arguments(parser)` and `run(args)`;
the arguments several share are declared once in `args.py`. `main` builds the full arguments of only the
subcommand argv names, so `specheads --help` (and a subcommand that lists no methods) imports no torch.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Iterable

from specheads.inference.cli import bench, calibrate, export, generate, loadtest, serve, train

COMMANDS = {c.NAME: c for c in (train, generate, bench, serve, calibrate, loadtest, export)}


def _parser(full: Iterable[str]) -> argparse.ArgumentParser:
    """Every subcommand with its one-line help; those named in `full` with their arguments too."""
    parser = argparse.ArgumentParser(prog="specheads",
                                     description="Speculative-decoding drafters for a frozen target LLM.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    full = set(full)
    for name, command in COMMANDS.items():
        p = sub.add_parser(name, help=command.HELP, description=command.DESCRIPTION,
                           add_help=getattr(command, "ADD_HELP", True))
        if name in full:
            command.add_arguments(p)
            p.set_defaults(func=command.run)
    return parser


def build_parser() -> argparse.ArgumentParser:
    """The parser with every subcommand's full arguments (for docs and tests; `main` builds only what it needs)."""
    return _parser(COMMANDS)


def runs_llamacpp_here(argv: list[str]) -> bool:
    """Whether the command line runs llama.cpp's kernels in this process: `--backend llamacpp`, or a bench method with
    `+backend=llamacpp`."""
    return ("--backend=llamacpp" in argv or ("--backend", "llamacpp") in zip(argv, argv[1:])
            or any("+backend=llamacpp" in a for a in argv))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [train.NAME]:
        return train.run(argv[1:])
    # OpenMP threads that wait by sleeping, not spinning (unless the user chose otherwise), set before torch loads its
    # OpenMP runtime: beside another busy process a spinning thread that lost its core stalls every product, and a
    # two-thread step on a 2-core CPU took 2.0-2.4x its idle time where sleeping threads took 1.2x
    # (scripts/lab/bench_threads.py, docs/results.md 2026-12-05). Training keeps OpenMP's own default, and so does a
    # command that runs llama.cpp in this process (its kernels meet at an OpenMP barrier after every operation: with
    # sleeping threads a one-token step took about 2x as long; docs/results.md 2026-12-07).
    if not runs_llamacpp_here(argv):
        os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    # Only -v/-h come before the subcommand, so the first item that names one is it.
    parser = _parser([next((a for a in argv if a in COMMANDS), "")])
    args = parser.parse_args(argv)
    if args.command == train.NAME:
        parser.error("put train first: specheads train CONFIG.yaml [key=value ...]")
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"specheads {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0
