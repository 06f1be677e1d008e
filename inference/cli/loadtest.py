"""`specheads loadtest`: the same greedy requests against running servers (`specheads.inference.serve.loadtest`)."""

from __future__ import annotations

import argparse
import os
import sys

from specheads.inference.cli import args as shared

NAME = "loadtest"
HELP = "concurrent streaming requests against running servers, compared in one run"
DESCRIPTION = ("Sends the same greedy chat requests to each server at each concurrency level (servers taking turns "
               "within a level) and reports requests/s, output tokens/s, p50/p99 latency and time to first token; "
               "every server's answers must agree.")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--server", action="append", required=True, metavar="LABEL=URL",
                   help="a running server, e.g. on=http://127.0.0.1:8001 (repeat to compare)")
    shared.add_questions(p, help="Spec-Bench/MT-bench JSONL whose first turns are sent", per_category_default=2,
                         per_category_help="first N questions of every category (default 2)")
    p.add_argument("--concurrency", type=shared.int_list, default=[1, 2, 4, 8, 16], metavar="C,C,...",
                   help="concurrency levels (default 1,2,4,8,16)")
    p.add_argument("--requests", type=int, default=2, metavar="K",
                   help="requests per level: K per client, and at least one per prompt (default 2)")
    shared.add_max_tokens(p, default=64, help="new tokens per answer (default 64)")
    shared.add_api_key(p, help="bearer token, if the servers have one (default: $SPECHEADS_API_KEY if set)")
    shared.add_output(p, help="write every level's figures (and the answers) to this JSON file")


def run(args: argparse.Namespace) -> None:
    from specheads.inference.serve.loadtest import loadtest, mismatches, save_results
    from specheads.questions import load_questions

    servers = [_server(item) for item in args.server]
    if len({label for label, _ in servers}) != len(servers):
        raise ValueError("--server labels must differ")
    if args.requests < 1 or args.max_tokens < 1:
        raise ValueError("--requests and --max-tokens must be >= 1")
    prompts = [q.turns[0] for q in load_questions(args.questions, per_category=args.per_category)]
    results = loadtest(servers, prompts, concurrency=args.concurrency,
                       requests=lambda c: max(len(prompts), args.requests * c),
                       max_tokens=args.max_tokens, api_key=args.api_key or os.environ.get("SPECHEADS_API_KEY"),
                       progress=lambda what: print(what, file=sys.stderr, flush=True))
    print(f"{'server':<10} {'conc':>4} {'req/s':>6} {'tok/s':>7} {'p50 s':>6} {'p99 s':>6} {'ttft p50':>8} "
          f"{'ttft p99':>8} {'failed':>6}")
    for r in results:
        print(f"{r.label:<10} {r.concurrency:>4} {r.requests_per_s:>6.3f} {r.output_tokens_per_s:>7.2f} "
              f"{r.latency_p50_s:>6.2f} {r.latency_p99_s:>6.2f} {r.ttft_p50_s:>8.2f} "
              f"{r.ttft_p99_s:>8.2f} {r.failed:>6}")
    problems = mismatches(results)
    for line in problems:
        print(f"mismatch: {line}", file=sys.stderr)
    print("every answer agreed across servers and levels" if not problems else f"{len(problems)} problems (above)")
    if args.output is not None:
        save_results(args.output, servers, results, max_tokens=args.max_tokens)
        print(f"wrote {args.output}")


def _server(item: str) -> tuple[str, str]:
    label, sep, url = item.partition("=")
    if not sep or not label or not url.startswith(("http://", "https://")):
        raise ValueError(f"--server {item!r}: write LABEL=URL, e.g. on=http://127.0.0.1:8001")
    return label, url.rstrip("/")
