"""`specheads` command line: argv parsing and printing live here, never in the library."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

from specheads.gemm_layout import LAYOUTS
from specheads.inference.methods import METHODS, flag, option_flags


def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text with a target and a proposer",
                       description="Generate with speculative decoding (greedy output equals plain greedy decoding).")
    _add_target(p)
    p.add_argument("--method", default="ar", help="; ".join(f"{name}: {m.summary}" for name, m in METHODS.items())
                   + " (default ar)")
    _add_method_options(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message; the answer streams to stdout, stats go to stderr")
    src.add_argument("--questions", type=Path, help="Spec-Bench/MT-bench JSONL (question_id, category, turns)")
    p.add_argument("--limit", type=int, help="first N questions only")
    p.add_argument("--per-category", type=int, metavar="N", help="first N questions of every category (a balanced subset)")
    p.add_argument("--turn", type=int, choices=(1, 2), default=1,
                   help="2: answer the second turn after the method's own first answer")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, help="reproducible sampling: each question, turn and sample draws from its own "
                                            "stream derived from (seed, question_id, turn, sample)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="draw N answers per question (or prompt), recorded with their sample index; needs --temperature > 0")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    _add_weight_layout(p)
    _add_fp32_head(p)
    _add_adapter(p)
    p.add_argument("--output", type=Path, help="write one JSON object per answer to this JSONL file")
    p.set_defaults(func=_run_generate)


def _add_target(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="default", help="'default' (SmolLM2-135M-Instruct), an HF model id or a local folder")


def _add_method_options(p: argparse.ArgumentParser) -> None:
    methods = p.add_argument_group("method options", "each applies to the methods named in its help; giving one "
                                                     "that the chosen --method does not take is an error")
    for opt in option_flags():
        methods.add_argument(flag(opt.name), dest=opt.name, type=opt.type, help=opt.help)


def _add_weight_layout(p: argparse.ArgumentParser) -> None:
    p.add_argument("--weight-layout", default="auto", choices=LAYOUTS,
                   help="how linear weights are stored: auto (column-major for fp32 on CPU, where few-row GEMMs such as "
                        "a tree verify run 2-5x faster that way; packed for bf16 on a CPU with native bf16, where each "
                        "weight is packed once for oneDNN instead of at every product; row-major elsewhere), row, column, "
                        "packed. Only GEMM rounding changes")


def _add_fp32_head(p: argparse.ArgumentParser) -> None:
    p.add_argument("--fp32-head", action="store_true",
                   help="with --dtype bfloat16/float16: compute the target's final norm and LM head in fp32, so logits "
                        "near a tie round alike in one-token and tree steps (costs an fp32 LM head product per position)")


def _draft_loader(model, tokenizer, args: argparse.Namespace):
    """Loads a draft model (`draft:PATH`, `hf-assisted:PATH`) beside the target, refusing another vocabulary."""
    from specheads.inference.proposers.draft_model import check_same_vocabulary
    from specheads.target import load_target

    def load_draft(name: str):
        draft, draft_tok = load_target(name, device=args.device, dtype=model.dtype, weight_layout=args.weight_layout)
        check_same_vocabulary(model, tokenizer, draft, draft_tok)
        return draft

    return load_draft


def _add_adapter(p: argparse.ArgumentParser) -> None:
    p.add_argument("--adapter", metavar="DIR",
                   help="verify against the target with this LoRA adapter merged in (a medusa2 run's final/adapter): "
                        "greedy output then equals plain greedy decoding of the adapted target, not the original one")


def _run_generate(args: argparse.Namespace) -> None:
    # Heavy imports after argument parsing, so `--help` and usage errors are instant.
    from tqdm import tqdm

    from specheads.inference.engine import Engine
    from specheads.inference.sampling import SamplingParams
    from specheads.questions import check_distinct_ids, load_questions
    from specheads.target import load_target, parse_device, render_chat, stop_token_ids

    options = _options(args)
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.num_samples > 1 and sampling.greedy:
        raise ValueError("--num-samples N > 1 needs --temperature > 0: greedy answers are all the same")
    parse_device(args.device)
    questions = load_questions(args.questions, args.limit, args.per_category) if args.questions else None
    if questions is not None and args.seed is not None and not sampling.greedy:
        check_distinct_ids(questions, args.questions)  # seeded streams are keyed by question id
    if args.turn == 2 and questions is not None and any(len(q.turns) < 2 for q in questions):
        raise ValueError(f"--turn 2 needs two turns per question; {args.questions} has single-turn questions")
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        out_file = args.output.open("w", encoding="utf-8")  # fail now, not after minutes of generation

    model, tokenizer = load_target(args.target, device=args.device, dtype=args.dtype,
                                   weight_layout=args.weight_layout, fp32_head=args.fp32_head, adapter=args.adapter)

    engine = Engine(model, _method(args, options, model, tokenizer)[0])
    stops = stop_token_ids(tokenizer, model)

    def answer(question_id, turns: list[str], sample: int, stream: bool):
        """Answer turns[0] (and then turns[1] when --turn 2), each with the method's own history; every turn
        draws from the stream of (seed, question_id, turn, sample)."""
        history: list[str] = []
        result = None
        for i in range(args.turn):
            ids = render_chat(tokenizer, turns[: i + 1], history)
            printer = _StreamPrinter(tokenizer) if stream and i == args.turn - 1 else None
            result = engine.generate(ids, max_new_tokens=args.max_new_tokens, sampling=sampling.for_draw(question_id, i + 1, sample),
                                     stop_token_ids=stops, on_tokens=printer)
            history.append(tokenizer.decode(result.output_ids, skip_special_tokens=True))
        return result, history[-1]

    def record(question_id, sample: int, result, text: str) -> None:
        if args.output is not None:
            out_file.write(json.dumps({"question_id": question_id, "sample": sample, "output_ids": result.output_ids,
                                       "text": text, "stats": result.stats.to_dict()}) + "\n")
            out_file.flush()

    if questions is None:
        for k in range(args.num_samples):
            result, text = answer(None, [args.prompt], k, stream=True)
            print(file=sys.stdout, flush=True)
            print(json.dumps(result.stats.to_dict()), file=sys.stderr)
            record(None, k, result, text)
        if args.output is not None:
            out_file.close()
        return
    taus, speeds = [], []
    for q in tqdm(questions, desc=f"{args.method}", unit="q", file=sys.stderr):
        for k in range(args.num_samples):
            result, text = answer(q.question_id, list(q.turns), k, stream=False)
            taus.append(result.stats.tau)
            speeds.append(result.stats.tokens_per_s)
            record(q.question_id, k, result, text)
    if args.output is not None:
        out_file.close()
    print(f"{args.method}: {len(questions)} questions x {args.num_samples} samples, mean tau {sum(taus) / len(taus):.3f}, "
          f"mean {sum(speeds) / len(speeds):.2f} tok/s", file=sys.stderr)


class _StreamPrinter:
    """Prints decoded text as tokens arrive; decodes the whole answer so multi-token characters come out whole."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.shown = 0

    def __call__(self, new: list[int]) -> None:
        self.ids.extend(new)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        sys.stdout.write(text[self.shown :])
        sys.stdout.flush()
        self.shown = len(text)


def _add_bench(sub: argparse._SubParsersAction) -> None:
    from specheads.inference.bench import BASELINES

    p = sub.add_parser("bench", help="compare methods on the same questions in one run (Spec-Bench style)",
                       description="Run several methods over the same questions in one process, interleaved per "
                                   "question so machine drift hits all alike; write per-question results, overall "
                                   "and per-category tables, and plots.")
    _add_target(p)
    engine = [f"{name}:{m.arg_hint}" if m.arg else name for name, m in METHODS.items()]
    suffixes = [f"{name}:DIR@TREE ({', '.join(m.trees)})" for name, m in METHODS.items() if m.trees]
    suffixes += [f"{name}:DIR+lookup=N" for name, m in METHODS.items() if m.takes("lookup")]
    p.add_argument("--methods", default="ar,hf,ngram",
                   help=f"comma list of engine methods: {'; '.join(engine)}; also {'; '.join(suffixes)}; and the "
                        f"baselines {', '.join(BASELINES)} (hf = transformers generate, hf-assisted:PATH its assisted "
                        "generation with a draft model, hf-pld[:N] its prompt lookup). Default: ar,hf,ngram")
    p.add_argument("--questions", type=Path, required=True, help="Spec-Bench/MT-bench JSONL (question_id, category, turns)")
    p.add_argument("--limit", type=int, help="first N questions only (N >= 1; omit for all)")
    p.add_argument("--per-category", type=int, metavar="N",
                   help="first N questions of every category: a balanced subset (MT-bench lists its categories in blocks)")
    p.add_argument("--turns", type=int, choices=(1, 2), default=1,
                   help="2: also answer each question's second turn after the method's own first answer (MT-bench)")
    p.add_argument("--max-new-tokens", type=int, required=True)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); greedy runs check every output against ar's")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)
    p.add_argument("--warmup", type=int, default=1, help="questions run once per method before timing (default 1)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    _add_weight_layout(p)
    _add_fp32_head(p)
    _add_adapter(p)
    p.add_argument("--output", type=Path,
                   help="directory for results.jsonl, summary.json, summary.md, config.json and PNG plots")
    p.add_argument("--no-plots", action="store_true", help="write no PNG plots (then matplotlib is not needed)")
    p.add_argument("--report-to", choices=("none", "wandb"), default="none",
                   help="wandb: also log tables and charts as a W&B run (works with WANDB_MODE=offline)")
    p.add_argument("--wandb-project", help="W&B project (default: $WANDB_PROJECT or 'specheads')")
    p.add_argument("--diagnose", action="store_true",
                   help="also record where drafts are rejected: by draft position, by the class of the target's token "
                        "(whitespace, punctuation, structural, digits, word, end of turn) and by category, with the most "
                        "rejected tokens (diagnosis.json, tables in summary.md, diagnosis.png)")
    p.set_defaults(func=_run_bench)


def _check_writable(folder: Path) -> None:
    """Fail before any model loads, not after an hour of generation."""
    import tempfile

    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".write-check-"):
            pass
    except OSError as err:
        raise ValueError(f"output dir {folder} is not writable ({err.strerror or err}); pass --output a folder you "
                         "can write to or fix its permissions") from None


def _run_bench(args: argparse.Namespace) -> None:
    import datetime
    import tempfile

    import torch
    import transformers
    from tqdm import tqdm

    from specheads.inference import bench_report
    from specheads.inference.bench import build_runners, mark_exactness, parse_methods, run_bench
    from specheads.inference.divergence import attach_margins
    from specheads.inference.sampling import SamplingParams
    from specheads.questions import check_distinct_ids, load_questions
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
    parse_device(args.device)
    questions = load_questions(args.questions, args.limit, args.per_category)
    check_distinct_ids(questions, args.questions)  # results and seeded streams are keyed by question id
    if args.turns == 2 and any(len(q.turns) < 2 for q in questions):
        raise ValueError(f"--turns 2 needs two turns per question; {args.questions} has single-turn questions")
    if args.output is not None:
        _check_writable(args.output)
    if not args.no_plots and (args.output is not None or args.report_to == "wandb"):
        bench_report.require_plotting()
    if args.report_to == "wandb":
        bench_report.require_wandb()
    config = {"target": args.target, "methods": [s.name for s in specs], "questions": str(args.questions),
              "limit": args.limit, "per_category": args.per_category,
              "num_questions": len(questions), "turns": args.turns, "max_new_tokens": args.max_new_tokens,
              "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "seed": args.seed,
              "warmup": args.warmup, "device": args.device, "dtype": args.dtype,
              "weight_layout": args.weight_layout, "fp32_head": args.fp32_head, "adapter": args.adapter,
              "started": datetime.datetime.now().isoformat(timespec="seconds"),
              "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}

    # 2. Models, proposers and heads (a checkpoint for another target fails here, as one line).
    model, tokenizer = load_target(args.target, device=args.device, dtype=args.dtype,
                                   weight_layout=args.weight_layout, fp32_head=args.fp32_head, adapter=args.adapter)

    load_draft = _draft_loader(model, tokenizer, args)
    runners = build_runners(model, specs, load_draft, diagnose=args.diagnose)

    # 3. Run, appending each finished generation to results.jsonl as it comes (rewritten with exactness marks at the end).
    results = (args.output / "results.jsonl").open("w", encoding="utf-8") if args.output is not None else None
    records = []
    interrupted = False
    bar = tqdm(total=len(questions) * len(specs), desc="bench", unit="run", file=sys.stderr)
    try:
        for rec in run_bench(runners, tokenizer, questions, max_new_tokens=args.max_new_tokens, sampling=sampling,
                             stop_token_ids=stop_token_ids(tokenizer, model), turns=args.turns, warmup=args.warmup):
            records.append(rec)
            if rec.turn == args.turns:
                bar.update(1)
            bar.set_postfix_str(rec.method, refresh=False)
            if results is not None:
                results.write(json.dumps(bench_report.record_row(rec)) + "\n")
                results.flush()
    except KeyboardInterrupt:
        interrupted = True
        print(f"interrupted: reporting the {len(records)} generations that finished", file=sys.stderr)
    finally:
        bar.close()
        if results is not None:
            results.close()

    # 4. Report; in greedy runs, every divergence from ar gets the fp32 margin at which it happened.
    config["interrupted"] = interrupted
    if sampling.greedy:
        mark_exactness(records)
        if any(r.matches_ar is False for r in records):
            reference = model if model.dtype == torch.float32 else load_target(
                args.target, device=args.device, dtype="float32", weight_layout=args.weight_layout,
                adapter=args.adapter)[0]
            attach_margins(records, reference)
    report = bench_report.build_report(records, greedy=sampling.greedy, config=config)
    print(bench_report.markdown_table(report.overall))
    print()
    print(bench_report.markdown_table(report.by_category, with_category=True))
    for m in report.mismatches:
        margin = "" if m["margin_fp32"] is None else f" (fp32 logit margin {m['margin_fp32']:.4f})"
        print(f"mismatch: {m['method']} question {m['question_id']} turn {m['turn']} differs from ar at output token "
              f"{m['first_mismatch']}{margin}", file=sys.stderr)
    if report.mismatches:
        print(bench_report.mismatch_summary(report.mismatches), file=sys.stderr)
    diagnosis = _diagnosis(runners, tokenizer, model) if args.diagnose else None
    if diagnosis is not None:
        print()
        print(diagnosis[1])
    with tempfile.TemporaryDirectory() as scratch:
        plots: list[Path] = []
        if args.output is not None:
            plots = bench_report.write_report(report, records, args.output, plots=not args.no_plots)
        elif args.report_to == "wandb" and not args.no_plots:
            plots = bench_report.write_plots(report, records, Path(scratch))
        if diagnosis is not None and (args.output is not None or args.report_to == "wandb"):
            plots += _write_diagnosis(*diagnosis, args.output or Path(scratch), args)
        if args.report_to == "wandb":
            run_dir = bench_report.log_wandb(report, records, plots, run_dir=args.output, project=args.wandb_project,
                                             name=args.output.name if args.output is not None else None,
                                             tables=diagnosis[2] if diagnosis is not None else None)
            print(f"W&B run: {run_dir}", file=sys.stderr)
    if interrupted:
        raise KeyboardInterrupt


def _diagnosis(runners, tokenizer, model):
    """(summaries by method, their markdown, their W&B tables) from the runners' rejection logs."""
    from specheads.inference.diagnosis import diagnosis_markdown, diagnosis_tables, summarise
    from specheads.target import stop_token_ids
    from specheads.token_classes import token_classes

    classes = token_classes(tokenizer, model.config.get_text_config().vocab_size, stop_token_ids(tokenizer, model))
    summaries = {name: summarise(r.log, classes) for name, r in runners.items() if getattr(r, "log", None) is not None}

    def decode(token: int) -> str:
        return tokenizer.decode([token])

    return summaries, diagnosis_markdown(summaries, decode), diagnosis_tables(summaries, decode)


def _write_diagnosis(summaries, text: str, tables, folder: Path, args: argparse.Namespace) -> list[Path]:
    """diagnosis.json and the tables appended to summary.md (with --output), and diagnosis.png; returns the plots."""
    from specheads.inference.diagnosis import plot_diagnosis

    if args.output is not None:
        (folder / "diagnosis.json").write_text(
            json.dumps({name: d.to_json() for name, d in summaries.items()}, indent=2) + "\n", encoding="utf-8")
        with (folder / "summary.md").open("a", encoding="utf-8") as summary:
            summary.write("\n" + text)
    if args.no_plots:
        return []
    plot_diagnosis(summaries, folder / "diagnosis.png")
    return [folder / "diagnosis.png"]


def _add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve OpenAI-compatible completions and chat completions",
                       description="An OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /v1/models, "
                                   "/health, /metrics) decoding with speculation; output is exact (greedy requests "
                                   "equal plain greedy decoding). Requests are decoded together, up to --max-batch per step.")
    _add_target(p)
    p.add_argument("--method", default="ar", help="the proposer, as in generate (default ar)")
    _add_method_options(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: $SPECHEADS_API_KEY if set)")
    p.add_argument("--model-name", help="the model name clients send (default: the --target value)")
    p.add_argument("--max-batch", type=int, default=4,
                   help="requests decoded together, one verify forward per step for all (default 4)")
    p.add_argument("--max-queue", type=int, default=64, help="requests that may wait; more get HTTP 429 (default 64)")
    p.add_argument("--max-tokens", type=int, default=2048, help="the most new tokens one request may ask for (default 2048)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="seconds from arrival (queueing included) after which a request ends with finish_reason "
                        "'timeout' (default 600)")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get HTTP 413 (default 1 MiB)")
    p.add_argument("--speculation", choices=("on", "off", "adaptive"),
                   help="on: every step drafts; off: every step is plain; adaptive: draft only where this machine's "
                        "calibration says it pays, by batch size and each request's acceptance (needs --calibration). "
                        "Default: adaptive with --calibration, else on. Output is exact in every mode")
    p.add_argument("--calibration", type=Path, metavar="JSON",
                   help="what `specheads calibrate` wrote for this target, method and machine")
    _add_model_setting(p)
    p.set_defaults(func=_run_serve)


def _add_model_setting(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", help="auto (fp32 on CPU, bf16 on CUDA), float32, bfloat16, float16")
    _add_weight_layout(p)
    _add_fp32_head(p)
    _add_adapter(p)


def _options(args: argparse.Namespace):
    """`--method`'s options from the flags (checked: a flag the method does not take is refused)."""
    return METHODS.get(args.method).make_options({opt.name: getattr(args, opt.name) for opt in option_flags()})


def _method(args: argparse.Namespace, options, model, tokenizer):
    """The proposer `--method` and `options` name, and its label (`method_label`)."""
    from specheads.inference.methods import make_proposer, method_label

    return make_proposer(args.method, model, options, _draft_loader(model, tokenizer, args)), \
        method_label(args.method, options)


def _run_serve(args: argparse.Namespace) -> None:
    import os
    import signal
    import threading

    import uvicorn

    from specheads.inference.adaptive import check_profile, read_profile, speculation_policy
    from specheads.inference.engine import Engine
    from specheads.inference.metrics import ServerMetrics
    from specheads.inference.proposers.base import AutoregressiveProposer
    from specheads.inference.server import ServerSettings, create_app
    from specheads.inference.service import GenerationService, ServiceLimits
    from specheads.inference.verify_cost import machine_key, prepare_verify_costs
    from specheads.target import load_target, stop_token_ids

    options = _options(args)  # checked before anything loads
    mode = args.speculation or ("adaptive" if args.calibration else "on")
    if mode == "adaptive" and args.calibration is None:
        raise ValueError("--speculation adaptive needs --calibration JSON; write one with `specheads calibrate` "
                         "(same --target, --method and options)")
    if args.calibration is not None and mode != "adaptive":
        raise ValueError(f"--calibration is read by --speculation adaptive only, not {mode}; drop one of them")
    profile = read_profile(args.calibration) if args.calibration else None  # before the model loads
    limits = ServiceLimits(max_queue=args.max_queue, max_tokens=args.max_tokens, request_timeout_s=args.request_timeout)
    settings = ServerSettings(model_name=args.model_name or args.target,
                              api_key=args.api_key or os.environ.get("SPECHEADS_API_KEY") or None,
                              max_body_bytes=args.max_body_bytes)
    model, tokenizer = load_target(args.target, device=args.device, dtype=args.dtype,
                                   weight_layout=args.weight_layout, fp32_head=args.fp32_head, adapter=args.adapter)
    proposer, label = _method(args, options, model, tokenizer)
    if args.method != "ar":
        prepare_verify_costs(model, args.max_batch)
    if profile is not None:
        check_profile(profile, method=label, machine_key=machine_key(model), source=str(args.calibration))
        if profile.max_batch == 0:  # no step will draft: decode plainly, without the drafter's per-step upkeep
            logging.getLogger("specheads.serve").warning(
                "%s: speculation paid at no calibrated batch size (tau %.2f); serving with plain steps",
                args.calibration, profile.tau)
            proposer = AutoregressiveProposer()
    engine = Engine(model, proposer, max_rows=args.max_batch, speculation=speculation_policy(mode, profile))
    service = GenerationService(engine, stop_token_ids(tokenizer, model), ServerMetrics(settings.model_name), limits)
    app = create_app(service, tokenizer, settings)
    # The engine decodes in this (the main) thread, the HTTP server in another: see GenerationService.run.
    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    thread = threading.Thread(target=http.run, name="specheads-http", daemon=True)
    signal.signal(signal.SIGTERM, _interrupt)  # a plain kill stops the server as Ctrl-C does
    thread.start()
    try:
        service.run()
    except KeyboardInterrupt:
        pass
    finally:
        http.should_exit = True
        thread.join(timeout=30)
        service.close()


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _int_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _add_calibrate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("calibrate", help="measure where speculation pays on this machine, for serve's adaptive mode",
                       description="Times speculative and plain engine steps at each batch size for one target and "
                                   "method, and writes the JSON `specheads serve --speculation adaptive --calibration` "
                                   "reads: per batch size the step times, τ and the break-even τ.")
    _add_target(p)
    p.add_argument("--method", required=True, help="the proposer, with its options, exactly as serve will run it")
    _add_method_options(p)
    p.add_argument("--questions", type=Path, required=True,
                   help="Spec-Bench/MT-bench JSONL whose first turns are the prompts (the load serve should expect)")
    p.add_argument("--per-category", type=int, metavar="N", default=2, help="first N questions of every category (default 2)")
    p.add_argument("--batch-sizes", type=_int_list, default=[1, 2, 4, 8, 16], metavar="B,B,...",
                   help="batch sizes to measure (default 1,2,4,8,16; serve's --max-batch should not exceed the largest)")
    p.add_argument("--steps", type=int, default=24, help="timed steps per run (default 24)")
    p.add_argument("--rounds", type=int, default=3,
                   help="the fewest runs of each mode per batch size; more where needed to cover every prompt (default 3)")
    p.add_argument("--output", type=Path, required=True, help="the JSON file to write")
    _add_model_setting(p)
    p.set_defaults(func=_run_calibrate)


def _run_calibrate(args: argparse.Namespace) -> None:
    from tqdm import tqdm

    from specheads.inference.calibrate import calibrate
    from specheads.inference.verify_cost import prepare_verify_costs
    from specheads.questions import load_questions
    from specheads.target import load_target, render_chat

    options = _options(args)  # checked before anything loads
    questions = load_questions(args.questions, per_category=args.per_category)
    if args.output.is_dir():
        raise ValueError(f"--output {args.output} is a folder; name the JSON file to write")
    model, tokenizer = load_target(args.target, device=args.device, dtype=args.dtype,
                                   weight_layout=args.weight_layout, fp32_head=args.fp32_head, adapter=args.adapter)
    proposer, label = _method(args, options, model, tokenizer)
    if args.method != "ar":
        prepare_verify_costs(model, max(args.batch_sizes))
    prompts = [render_chat(tokenizer, [q.turns[0]]) for q in questions]
    bar = tqdm(total=len(set(args.batch_sizes)), desc="calibrating", unit="batch size")

    def progress(what: str) -> None:
        bar.set_postfix_str(what)
        bar.update(1)

    profile = calibrate(model, proposer, prompts, method=label, batch_sizes=args.batch_sizes, steps=args.steps,
                        rounds=args.rounds, progress=progress)
    bar.close()
    profile.save(args.output)
    print(f"{label} on {profile.machine}")
    shares = ", ".join(f"{s:.2f}" for s in profile.accept_per_position[:6])
    print(f"tau {profile.tau:.2f}, acceptance by position {shares}, mean draft depth {profile.mean_depth:.2f} "
          f"({len(questions)} prompts)")
    print(f"{'batch':>5}  {'plain ms':>9}  {'spec ms':>9}  {'break-even':>10}  pays")
    for c in profile.costs:
        print(f"{c.batch:>5}  {1e3 * c.plain_step_s:>9.1f}  {1e3 * c.spec_step_s:>9.1f}  {c.break_even:>10.2f}  "
              f"{'yes' if profile.pays(c.batch) else 'no'}")
    print(f"speculation pays up to batch {profile.max_batch}" if profile.max_batch else
          "speculation pays at no batch size here: adaptive serving will decode plainly")
    print(f"wrote {args.output}")


def _add_loadtest(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("loadtest", help="concurrent streaming requests against running servers, compared in one run",
                       description="Sends the same greedy chat requests to each server at each concurrency level "
                                   "(servers taking turns within a level) and reports requests/s, output tokens/s, "
                                   "p50/p99 latency and time to first token; every server's answers must agree.")
    p.add_argument("--server", action="append", required=True, metavar="LABEL=URL",
                   help="a running server, e.g. on=http://127.0.0.1:8001 (repeat to compare)")
    p.add_argument("--questions", type=Path, required=True, help="Spec-Bench/MT-bench JSONL whose first turns are sent")
    p.add_argument("--per-category", type=int, metavar="N", default=2, help="first N questions of every category (default 2)")
    p.add_argument("--concurrency", type=_int_list, default=[1, 2, 4, 8, 16], metavar="C,C,...",
                   help="concurrency levels (default 1,2,4,8,16)")
    p.add_argument("--requests", type=int, default=2, metavar="K",
                   help="requests per level: K per client, and at least one per prompt (default 2)")
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per answer (default 64)")
    p.add_argument("--api-key", help="bearer token, if the servers have one (default: $SPECHEADS_API_KEY if set)")
    p.add_argument("--output", type=Path, help="write every level's figures (and the answers) to this JSON file")
    p.set_defaults(func=_run_loadtest)


def _run_loadtest(args: argparse.Namespace) -> None:
    import os

    from specheads.inference.loadtest import loadtest, mismatches
    from specheads.questions import load_questions

    servers = []
    for item in args.server:
        label, sep, url = item.partition("=")
        if not sep or not label or not url.startswith(("http://", "https://")):
            raise ValueError(f"--server {item!r}: write LABEL=URL, e.g. on=http://127.0.0.1:8001")
        servers.append((label, url.rstrip("/")))
    if len({label for label, _ in servers}) != len(servers):
        raise ValueError("--server labels must differ")
    if args.requests < 1 or args.max_tokens < 1:
        raise ValueError("--requests and --max-tokens must be >= 1")
    prompts = [q.turns[0] for q in load_questions(args.questions, per_category=args.per_category)]
    results = loadtest(servers, prompts, concurrency=args.concurrency, requests=lambda c: max(len(prompts), args.requests * c),
                       max_tokens=args.max_tokens, api_key=args.api_key or os.environ.get("SPECHEADS_API_KEY"),
                       progress=lambda what: print(what, file=sys.stderr, flush=True))
    print(f"{'server':<10} {'conc':>4} {'req/s':>6} {'tok/s':>7} {'p50 s':>6} {'p99 s':>6} {'ttft p50':>8} "
          f"{'ttft p99':>8} {'failed':>6}")
    for r in results:
        print(f"{r.label:<10} {r.concurrency:>4} {r.requests_per_s:>6.3f} {r.output_tokens_per_s:>7.2f} "
              f"{r.latency_p50_s:>6.2f} {r.latency_p99_s:>6.2f} {r.ttft_p50_s:>8.2f} {r.ttft_p99_s:>8.2f} {r.failed:>6}")
    problems = mismatches(results)
    for line in problems:
        print(f"mismatch: {line}", file=sys.stderr)
    print("every answer agreed across servers and levels" if not problems else f"{len(problems)} problems (above)")
    if args.output is not None:
        from dataclasses import asdict

        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"servers": dict(servers), "max_tokens": args.max_tokens,
                                           "levels": [asdict(r) for r in results]}, indent=1), encoding="utf-8")
        print(f"wrote {args.output}")


def _add_export(sub) -> None:
    from specheads.formats import export_formats
    from specheads.formats.export import HF_FORMAT

    formats = [HF_FORMAT, *export_formats()]
    p = sub.add_parser("export", help="write trained heads in a format vLLM, SGLang or the Hub reads",
                       description="Write a training run's heads (or a heads folder) in another engine's format into a "
                                   "new folder, checked against what that engine's loader reads; optionally push it "
                                   "to the Hugging Face Hub.")
    p.add_argument("source", metavar="RUN_OR_HEADS_DIR", help="a training run's output_dir or a heads folder")
    p.add_argument("--to", dest="fmt", required=True, choices=formats,
                   help=f"{HF_FORMAT}: our format and a model card; " + "; ".join(_format_help()))
    p.add_argument("--output", required=True, help="a new (or empty) folder for the export")
    p.add_argument("--target", help="the target whose config the draft layers take (default: the one the heads were "
                                    "trained for)")
    p.add_argument("--verifier", help="the target's name written for the serving engine (default: the trained-for "
                                      "target; the default target's Hub id)")
    p.add_argument("--speculative-tokens", type=int, default=3, help="draft depth recorded where a format keeps one")
    p.add_argument("--push-to-hub", metavar="ORG/NAME", help="also publish the export as this Hub model repo")
    p.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")
    p.set_defaults(func=_run_export)


def _format_help() -> list[str]:
    from specheads.formats import EXPORTERS

    by_format: dict[str, list[str]] = {}
    for _, e in EXPORTERS.items():
        by_format.setdefault(e.format, []).append(f"{e.kind} heads for {e.loader}")
    return [f"{fmt}: {', '.join(what)}" for fmt, what in by_format.items()]


def _run_export(args: argparse.Namespace) -> None:
    from specheads.formats.export import export
    from specheads.hub import push_folder

    if args.private and not args.push_to_hub:
        raise ValueError("--private applies to --push-to-hub ORG/NAME only")
    done = export(args.source, args.fmt, args.output, target=args.target, verifier=args.verifier,
                  speculative_tokens=args.speculative_tokens)
    print(f"wrote {args.fmt} export to {done.folder}: {', '.join(done.files)} (verifier {done.verifier})")
    if args.push_to_hub:
        url = push_folder(done.folder, args.push_to_hub, private=args.private)
        print(f"pushed to {args.push_to_hub}: {url}")


def _train_passthrough(argv: list[str]) -> int:
    """`specheads train ...` runs the training recipe as its own module, so the engine never imports training code."""
    import os

    os.execv(sys.executable, [sys.executable, "-m", "specheads.train", *argv])
    return 0  # not reached


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specheads", description="Speculative-decoding drafters for a frozen target LLM.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("train", help="train heads: specheads train CONFIG.yaml [key=value ...] (same as python -m specheads.train)",
                   add_help=False)
    _add_generate(sub)
    _add_bench(sub)
    _add_serve(sub)
    _add_calibrate(sub)
    _add_loadtest(sub)
    _add_export(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["train"]:
        return _train_passthrough(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        args.func(args)
    except (ValueError, FileNotFoundError, OSError) as err:
        print(f"specheads {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
