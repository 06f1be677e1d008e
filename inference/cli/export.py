"""`specheads export`: trained heads in another engine's format (`specheads.formats.export`), optionally pushed."""

from __future__ import annotations

import argparse

from specheads.inference.cli import args as shared

NAME = "export"
HELP = "write trained heads in a format vLLM, SGLang, llama.cpp or the Hub reads"
DESCRIPTION = ("Write a training run's heads (or a heads folder) in another engine's format into a new folder, "
               "checked against what that engine's loader reads; optionally push it to the Hugging Face Hub.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specheads.formats.engines import FORMATS

    p.add_argument("source", metavar="RUN_OR_HEADS_DIR", help="a training run's output_dir or a heads folder; with "
                   "--to gguf also a target (a model folder, or 'default'), written as the GGUF llama.cpp loads")
    p.add_argument("--to", dest="fmt", required=True, choices=list(FORMATS),
                   help="; ".join(f"{fmt}: {what}" for fmt, what in FORMATS.items()) + " (which drafter kinds each "
                        "format takes: docs/cli.md; a kind a format cannot express is refused, naming those it can)")
    shared.add_output(p, required=True, type=None, help="a new (or empty) folder for the export")
    shared.add_target(p, default=None, help="the target whose config the draft layers take (default: the one the "
                                            "heads were trained for)")
    p.add_argument("--verifier", help="the target's name written for the serving engine (default: the trained-for "
                                      "target; the default target's Hub id)")
    p.add_argument("--speculative-tokens", type=int, help="draft depth recorded where a format keeps one (default: "
                   "3 for a chain drafter; a block drafter's own block, and at most that)")
    p.add_argument("--outtype", choices=["f32", "bf16", "q8_0", "q4_1"],
                   help="--to gguf: the tensors' precision (default f32; q4_1: the default target's shipped file)")
    p.add_argument("--push-to-hub", metavar="ORG/NAME", help="also publish the export as this Hub model repo")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")


def run(args: argparse.Namespace) -> None:
    from specheads.formats.export import export
    from specheads.hub import push_folder

    if args.private and not args.push_to_hub:
        raise ValueError("--private applies to --push-to-hub ORG/NAME only")
    done = export(args.source, args.fmt, args.output, target=args.target, verifier=args.verifier,
                  speculative_tokens=args.speculative_tokens, precision=args.outtype)
    print(f"wrote {args.fmt} export to {done.folder}: {', '.join(done.files)} (verifier {done.verifier})")
    if args.push_to_hub:
        url = push_folder(done.folder, args.push_to_hub, private=args.private)
        print(f"pushed to {args.push_to_hub}: {url}")
