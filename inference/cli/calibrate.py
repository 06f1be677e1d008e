"""`specheads calibrate`: where speculation pays on this machine, the JSON serve's adaptive mode reads."""

from __future__ import annotations

import argparse
from pathlib import Path

from specheads.inference.cli import args as shared

NAME = "calibrate"
HELP = "measure where speculation pays on this machine, for serve's adaptive mode"
DESCRIPTION = ("Times speculative and plain engine steps at each batch size for one target and method, and writes "
               "the JSON `specheads serve --speculation adaptive --calibration` reads: per batch size the step times, "
               "τ and the break-even τ.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_target(p)
    shared.add_method(p, default=None, help="the proposer, with its options, exactly as serve will run it")
    shared.add_questions(p, help="Spec-Bench/MT-bench JSONL whose first turns are the prompts (the load serve should "
                                 "expect)",
                         per_category_default=2, per_category_help="first N questions of every category (default 2)")
    p.add_argument("--batch-sizes", type=shared.int_list, default=[1, 2, 4, 8, 16], metavar="B,B,...",
                   help="batch sizes to measure (default 1,2,4,8,16; serve's --max-batch should not exceed the "
                        "largest)")
    p.add_argument("--steps", type=int, default=24, help="timed steps per run (default 24)")
    p.add_argument("--rounds", type=int, default=3,
                   help="the fewest runs of each mode per batch size; more where needed to cover every prompt "
                        "(default 3)")
    shared.add_output(p, required=True, help="the JSON file to write")
    shared.add_model_settings(p)


def run(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from specheads.inference.proposers.verify_cost import prepare_verify_costs
    from specheads.inference.serve.calibrate import calibrate
    from specheads.questions import load_questions
    from specheads.target import render_chat

    options = shared.method_options(args)  # checked before anything loads
    questions = load_questions(args.questions, per_category=args.per_category)
    if args.output.is_dir():
        raise ValueError(f"--output {args.output} is a folder; name the JSON file to write")
    model, tokenizer = shared.load_model(args)
    proposer, label = shared.make_method(args, options, model, tokenizer)
    backend_for = None if args.backend == "torch" else (lambda rows: shared.target_backend(args, max_rows=rows))
    if args.method != "ar":
        prepare_verify_costs(model if backend_for is None else backend_for(1), max(args.batch_sizes))
    prompts = [render_chat(tokenizer, [q.turns[0]]) for q in questions]
    bar = tqdm(total=len(set(args.batch_sizes)), desc="calibrating", unit="batch size")

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(1)

    profile = calibrate(model, proposer, prompts, method=label, batch_sizes=args.batch_sizes, steps=args.steps,
                        rounds=args.rounds, progress=progress, step=args.step,
                        compile=args.compile, backend_for=backend_for)
    bar.close()
    profile.save(args.output)
    _print_profile(profile, label, len(questions), args.output)


def _print_profile(profile, label: str, prompts: int, output: Path) -> None:
    print(f"{label} on {profile.machine}")
    shares = ", ".join(f"{s:.2f}" for s in profile.accept_per_position[:6])
    print(f"tau {profile.tau:.2f}, acceptance by position {shares}, mean draft depth {profile.mean_depth:.2f} "
          f"({prompts} prompts)")
    print(f"{'batch':>5}  {'plain ms':>9}  {'spec ms':>9}  {'break-even':>10}  pays")
    for c in profile.costs:
        print(f"{c.batch:>5}  {1e3 * c.plain_step_s:>9.1f}  {1e3 * c.spec_step_s:>9.1f}  {c.break_even:>10.2f}  "
              f"{'yes' if profile.pays(c.batch) else 'no'}")
    print(f"speculation pays up to batch {profile.max_batch}" if profile.max_batch else
          "speculation pays at no batch size here: adaptive serving will decode plainly")
    print(f"wrote {output}")
