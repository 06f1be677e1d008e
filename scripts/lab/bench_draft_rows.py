"""Rows drafting together (`propose_many`) against rows drafting one by one, in one interleaved run.

For each batch size B, B prompts decode together in one engine with the given method; after the prefill and the
first draft, `--steps` engine steps are timed, with drafting batched or row by row in alternating rounds (the trees
are the same either way; only the time differs). Prints the median step and drafting times per B and mode.

    python scripts/lab/bench_draft_rows.py --method eagle --heads runs/eagle/final --questions mt_bench.jsonl
"""

from __future__ import annotations

import argparse
import statistics
import time
from unittest import mock

import specheads.inference.engine.engine as engine_module
from specheads.inference.engine.engine import Engine
from specheads.inference.methods import METHODS, make_proposer
from specheads.questions import load_questions
from specheads.target import load_target, render_chat


def one_by_one(proposers, ctxs):
    return [p.propose(c) for p, c in zip(proposers, ctxs)]


def run(model, proposer, prompts, steps: int, together: bool) -> tuple[list[float], list[float]]:
    engine = Engine(model, proposer, max_rows=len(prompts))
    seqs = [engine.add(p, max_new_tokens=16 * (steps + 2)) for p in prompts]
    engine.step()  # prefill
    engine.step()  # first draft (long catch-ups)
    step_s, draft_s = [], []
    with mock.patch.object(engine_module, "drafts_together", lambda ps: together and len(ps) > 1), \
            mock.patch.object(engine_module, "propose_rows",
                              engine_module.propose_rows if together else one_by_one):
        for _ in range(steps):
            before = sum(s.stats.draft_s for s in seqs)
            start = time.perf_counter()
            engine.step()
            step_s.append(time.perf_counter() - start)
            draft_s.append(sum(s.stats.draft_s for s in seqs) - before)
    engine.abort()  # the proposers free their rows of the shared head cache
    return step_s, draft_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="default")
    parser.add_argument("--method", required=True)
    parser.add_argument("--heads", help="the method's heads folder")
    parser.add_argument("--questions", required=True)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model, tokenizer = load_target(args.target, weight_layout="auto")
    options = METHODS.get(args.method).make_options({"heads": args.heads} if args.heads else {})
    proposer = make_proposer(args.method, model, options, None)
    prompts = [render_chat(tokenizer, [q.turns[0]]) for q in load_questions(args.questions, per_category=2)]
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    times = {(b, t): ([], []) for b in sizes for t in (True, False)}
    for r in range(args.rounds):
        for b in sizes:
            for together in ((True, False) if r % 2 == 0 else (False, True)):
                rows = [prompts[(r * b + i) % len(prompts)] for i in range(b)]
                step_s, draft_s = run(model, proposer, rows, args.steps, together)
                times[b, together][0].extend(step_s)
                times[b, together][1].extend(draft_s)
    print(f"{'batch':>5}  {'step ms together':>16}  {'step ms one by one':>18}  {'draft ms together':>17}  "
          f"{'draft ms one by one':>19}  {'draft ratio':>11}")
    for b in sizes:
        (st, dt), (so, do) = times[b, True], times[b, False]
        t, o = statistics.median(dt), statistics.median(do)
        print(f"{b:>5}  {1e3 * statistics.median(st):>16.1f}  {1e3 * statistics.median(so):>18.1f}  {1e3 * t:>17.1f}  "
              f"{1e3 * o:>19.1f}  {o / t:>10.2f}x")


if __name__ == "__main__":
    main()
