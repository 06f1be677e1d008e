"""`specheads bench`: several methods over the same questions in one process (`specheads.inference.bench.run`)."""

from __future__ import annotations

import argparse
import sys
from collections import Counter

from specheads.inference.cli import args as shared

NAME = "bench"
HELP = "compare methods on the same questions in one run (Spec-Bench style)"
DESCRIPTION = ("Run several methods over the same questions in one process, interleaved per question so machine "
               "drift hits all alike; write per-question results, overall and per-category tables, and plots.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from specheads.inference.bench.method_spec import BASELINES
    from specheads.inference.methods import METHODS

    shared.add_target(p)
    engine = [f"{name}:{m.arg_hint}" if m.arg else name for name, m in METHODS.items()]
    suffixes = [f"{name}:DIR@TREE ({', '.join(m.trees)})" for name, m in METHODS.items() if m.trees]
    suffixes += [f"{name}:DIR+lookup=N" for name, m in METHODS.items() if m.takes("lookup")]
    suffixes.append("any engine method +compile=1 or +compile=0 (with or without --compile, whatever the flag)")
    p.add_argument("--methods", default="ar,hf,ngram",
                   help=f"comma list of engine methods: {'; '.join(engine)}; also {'; '.join(suffixes)}; and the "
                        f"baselines {', '.join(BASELINES)} (hf = transformers generate, hf-static the same with its "
                        "static cache and torch.compile, hf-assisted:PATH its assisted generation with a draft model, "
                        "hf-pld[:N] its prompt lookup); and llama.cpp on the same weights: llamacpp[@PRECISION] "
                        "(f32, bf16, q8_0, q4_1; default: the run's dtype), llamacpp+KIND:DIR[@PRECISION]"
                        "[+draft_max=N][+p_min=P] with heads exported to GGUF (without settings: those measured "
                        "fastest here, cached; +measure=quick: a smaller grid), and "
                        "llamacpp+MODE[@PRECISION][+draft_max=N] with "
                        "llama.cpp's own drafting (ngram-simple, ngram-mod, ngram-map-k, ngram-map-k4v, ngram-cache); "
                        "any engine method takes +backend=llamacpp[+gguf=PRECISION] to run on llama.cpp's kernels "
                        "(docs/llamacpp.md). Default: ar,hf,ngram")
    shared.add_questions(p, limit_help="first N questions only (N >= 1; omit for all)",
                         per_category_help="first N questions of every category: a balanced subset (MT-bench lists "
                                           "its categories in blocks)")
    p.add_argument("--turns", type=int, choices=(1, 2), default=1,
                   help="2: also answer each question's second turn after the method's own first answer (MT-bench)")
    shared.add_max_new_tokens(p)
    shared.add_sampling(p, temperature_help="0 = greedy (default); greedy runs check every output against ar's")
    p.add_argument("--warmup", type=int, default=1, help="questions run once per method before timing (default 1)")
    p.add_argument("--max-minutes", type=float, metavar="M",
                   help="begin no question after M minutes (the warm-up counted): every method answers the same "
                        "questions, and the categories take turns, so the questions answered are a balanced subset")
    shared.add_model_settings(p)
    shared.add_output(p, help="directory for results.jsonl, summary.json, summary.md, config.json and PNG plots")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots (then matplotlib is not needed)")
    p.add_argument("--report-to", choices=("none", "wandb"), default="none",
                   help="wandb: also log tables and charts as a W&B run (works with WANDB_MODE=offline)")
    p.add_argument("--wandb-project", help="W&B project (default: $WANDB_PROJECT or 'specheads')")
    p.add_argument("--diagnose", action="store_true",
                   help="also record where drafts are rejected: by draft position, by the class of the target's "
                        "token (whitespace, punctuation, structural, digits, word, end of turn) and by category, with "
                        "the most rejected tokens (diagnosis.json, tables in summary.md, diagnosis.png)")


def run(args: argparse.Namespace) -> None:
    from specheads.inference.bench import report as bench_report
    from specheads.inference.bench import run as bench_run
    from specheads.inference.bench.method_spec import parse_methods
    from specheads.inference.bench.runner import build_runners, close_runners
    from specheads.inference.engine.sampling import SamplingParams
    from specheads.questions import check_distinct_ids, interleave_categories, load_questions
    from specheads.target import load_target, parse_device, stop_token_ids

    # 1. Every check that needs no model, so bad input costs no loading time.
    specs = parse_methods(args.methods)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.limit is not None and args.limit < 1:
        raise ValueError(f"--limit must be >= 1 (or omitted for all questions), got {args.limit}")
    if args.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {args.warmup}")
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise ValueError(f"--max-minutes must be > 0 (or omitted for no time budget), got {args.max_minutes}")
    parse_device(args.device)
    # categories in turn, so the questions a time budget or Ctrl-C leaves answered are balanced
    questions = interleave_categories(load_questions(args.questions, args.limit, args.per_category))
    check_distinct_ids(questions, args.questions)  # results and seeded streams are keyed by question id
    if args.turns == 2 and any(len(q.turns) < 2 for q in questions):
        raise ValueError(f"--turns 2 needs two turns per question; {args.questions} has single-turn questions")
    bench_run.check_output(args.output, plots=not args.no_plots, report_to=args.report_to)
    config = bench_run.run_config({
        "target": args.target, "methods": [s.name for s in specs], "questions": str(args.questions),
        "limit": args.limit, "per_category": args.per_category, "num_questions": len(questions), "turns": args.turns,
        "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "seed": args.seed, "warmup": args.warmup, "max_minutes": args.max_minutes,
        "device": args.device, "dtype": args.dtype,
        "weight_layout": args.weight_layout, "step": args.step, "compile": args.compile,
        "fp32_head": args.fp32_head, "adapter": args.adapter})

    # 2. Models, proposers and heads (a checkpoint for another target fails here, as one line).
    model, tokenizer = shared.load_model(args)
    runners = build_runners(model, specs, shared.draft_loader(model, tokenizer, args), diagnose=args.diagnose,
                            step=args.step, compile=args.compile, tokenizer=tokenizer, target_name=args.target,
                            on_progress=lambda text: print(text, file=sys.stderr, flush=True))
    config["machine"] = bench_run.machine(model)
    # llama.cpp rows whose drafting settings were measured: what was chosen, and why
    config["llamacpp_settings"] = {name: text for name, r in runners.items() if (text := getattr(r, "settings_text",
                                                                                                  ""))}
    print(bench_report.machine_text(config["machine"]), file=sys.stderr)

    # 3. Run, then report; in greedy runs every divergence from ar gets the fp32 margin at which it happened.
    try:
        records, interrupted = bench_run.collect(
            runners, tokenizer, questions, output=args.output, max_new_tokens=args.max_new_tokens, sampling=sampling,
            stop_token_ids=stop_token_ids(tokenizer, model), turns=args.turns, warmup=args.warmup,
            max_minutes=args.max_minutes)
    finally:
        close_runners(runners)  # llama.cpp's servers
    config["machine"]["verify_cost"] = bench_run.verify_cost_used(model)
    if interrupted:
        print(f"interrupted: reporting the {len(records)} generations that finished", file=sys.stderr)
    finished = Counter(r.question_id for r in records if r.turn == args.turns)
    config["questions_answered"] = sum(n == len(runners) for n in finished.values())  # by every method
    done = bench_run.finish(
        records, runners, model, tokenizer, greedy=sampling.greedy, config={**config, "interrupted": interrupted},
        load_fp32=lambda: load_target(args.target, device=args.device, dtype="float32",
                                      weight_layout=args.weight_layout, adapter=args.adapter)[0],
        diagnose=args.diagnose, output=args.output, plots=not args.no_plots, report_to=args.report_to,
        wandb_project=args.wandb_project)
    _print_report(done)
    if interrupted:
        raise KeyboardInterrupt


def _print_report(done) -> None:
    from specheads.inference.bench import report as bench_report
    from specheads.inference.bench.llamacpp_spec import plain_of

    if answered := bench_report.answered_text(done.report.config):
        print(answered)
    print(bench_report.markdown_table(done.report.overall))
    print()
    print(bench_report.markdown_table(done.report.by_category, with_category=True))
    for m in done.report.mismatches:
        margin = "" if m["margin_fp32"] is None else f" (fp32 logit margin {m['margin_fp32']:.4f})"
        print(f"mismatch: {m['method']} question {m['question_id']} turn {m['turn']} differs from ar at output token "
              f"{m['first_mismatch']}{margin}", file=sys.stderr)
    if done.report.mismatches:
        print(bench_report.mismatch_summary(done.report.mismatches), file=sys.stderr)
    for method, equal in done.report.llamacpp_exact.items():
        print(f"{method}: {equal} outputs equal to {plain_of(method)}'s (llama.cpp's own "
              "exactness)", file=sys.stderr)
    if done.diagnosis is not None:
        print()
        print(done.diagnosis)
    if done.wandb_run is not None:
        print(f"W&B run: {done.wandb_run}", file=sys.stderr)
