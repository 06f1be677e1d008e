"""Rollout throughput of the on-policy phase: prompts decoded `--rows` at a time by a drafter alone, with whole trees
(what `measure_drafter` verifies) against chains (what `rollout_drafter` drafts), interleaved over `--rounds`.
Entry: "2026-12-06: accept-until-fail and training on the drafter's own mistakes, first measurements (bf16, a CPU with
AVX512-BF16)".

    .venv/bin/python scripts/lab/bench_rollout.py --heads runs/op/op/final --questions mt_bench.jsonl
"""

from __future__ import annotations

import argparse
import time

from specheads.formats.load import read_heads
from specheads.inference.bench.runner import drafter_alone
from specheads.inference.engine.rollout import rollout
from specheads.inference.engine.stats import GenerationStats
from specheads.questions import load_questions
from specheads.target import load_target, render_chat, stop_token_ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", required=True, help="a heads folder (a run's final/)")
    parser.add_argument("--kind", default=None, help="its drafter kind (default: read from its config.json)")
    parser.add_argument("--questions", default="humaneval", help="a question set name or JSONL file")
    parser.add_argument("--prompts", type=int, default=16, help="first turns decoded per rollout")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--rows", type=int, default=8, help="prompts decoded together")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    kind = args.kind or read_heads(args.heads).kind
    target, tokenizer = load_target("default")
    questions = load_questions(args.questions)[: args.prompts]
    prompts = [render_chat(tokenizer, [q.turns[0]]) for q in questions]
    stops = stop_token_ids(tokenizer, target)
    for round_ in range(args.rounds):
        for chain in (False, True):
            proposer = drafter_alone(target, kind, args.heads, None, chain=chain)
            start = time.perf_counter()
            outs = rollout(target, proposer, prompts, max_new_tokens=args.max_new_tokens, stop_token_ids=stops,
                           rows=args.rows)
            seconds = time.perf_counter() - start
            tokens = sum(len(o.output) for o in outs)
            total = GenerationStats(steps=sum(o.stats.steps for o in outs),
                                    accepted=sum(o.stats.accepted for o in outs))
            print(f"round {round_} {'chains' if chain else 'trees '}: {tokens} tokens in {seconds:.1f} s = "
                  f"{tokens / seconds:.1f} tok/s, tau {total.tau:.2f}", flush=True)


if __name__ == "__main__":
    main()
