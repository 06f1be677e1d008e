"""τ of EAGLE heads with and without the context vocabulary, interleaved in one run, greedy.

    .venv/bin/python scripts/lab/ablate_context_vocab.py HEADS_DIR [HEADS_DIR ...] [--tree cpu] [--per-category 3]

Also reports how many of `ar`'s output tokens lie outside each head's draft vocabulary, and how many of
those the prompt or earlier output already held (what the context vocabulary can make draftable).
Every run must reproduce `ar`'s output; the script stops at the first that does not.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from specheads.formats.load import load_heads
from specheads.inference import Engine
from specheads.inference.methods.tree_options import named_tree
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.eagle import EagleProposer
from specheads.questions import load_questions
from specheads.target import load_target, render_chat, stop_token_ids


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("heads", nargs="+")
    p.add_argument("--tree", default="cpu")
    p.add_argument("--questions", default="humaneval")
    p.add_argument("--per-category", type=int, default=3)
    p.add_argument("--max-new-tokens", type=int, default=128)
    args = p.parse_args()
    target, tokenizer = load_target("default", dtype="float32")
    stops = stop_token_ids(tokenizer, target)
    questions = load_questions(args.questions, per_category=args.per_category)
    heads = {path: load_heads(path, target, kind="eagle") for path in args.heads}
    engines = {(path, flag): Engine(target, EagleProposer(head, named_tree(args.tree), context_vocab=flag))
               for path, head in heads.items() for flag in (False, True)}
    ar = Engine(target, AutoregressiveProposer())
    taus: dict[tuple[str, bool], list[float]] = {key: [] for key in engines}  # per generation, as the bench
    outside = {path: [0, 0] for path in heads}  # ar tokens outside the draft vocabulary, of which seen before
    n_tokens = 0
    for q in questions:
        prompt = render_chat(tokenizer, [q.turns[0]])
        reference = ar.generate(prompt, max_new_tokens=args.max_new_tokens, stop_token_ids=stops).output_ids
        n_tokens += len(reference)
        for path, head in heads.items():
            vocab = set(head.draft_ids.tolist()) if head.draft_ids is not None else None
            seen = set(prompt)
            for t in reference:
                if vocab is not None and t not in vocab:
                    outside[path][0] += 1
                    outside[path][1] += t in seen
                seen.add(t)
        for key, engine in engines.items():
            res = engine.generate(prompt, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
            if res.output_ids != reference:
                raise SystemExit(f"{key[0]} (context_vocab={key[1]}) differs from ar on question {q.question_id}")
            taus[key].append(res.stats.tau)
    print(f"{len(questions)} questions, {n_tokens} ar tokens, tree {args.tree}; all outputs equal ar")
    for path in heads:
        off, on = (statistics.mean(taus[(path, flag)]) for flag in (False, True))
        out, seen = outside[path]
        print(f"{path}: τ {off:.3f} -> {on:.3f} with the context vocabulary; "
              f"{out / n_tokens:.1%} of ar tokens outside the draft vocabulary, {seen} of those {out} seen before")


if __name__ == "__main__":
    torch.manual_seed(0)
    main()
