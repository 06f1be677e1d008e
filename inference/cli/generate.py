"""`specheads generate`: one prompt streamed to stdout, or a questions file answered into JSONL."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specheads.inference.cli import args as shared

NAME = "generate"
HELP = "generate text with a target and a proposer"
DESCRIPTION = "Generate with speculative decoding (greedy output equals plain greedy decoding)."


def add_arguments(p: argparse.ArgumentParser) -> None:
    shared.add_target(p)
    shared.add_method(p)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="one user message; the answer streams to stdout, stats go to stderr")
    shared.add_questions(p, group=src, limit_help="first N questions only",
                         per_category_help="first N questions of every category (a balanced subset)")
    p.add_argument("--turn", type=int, choices=(1, 2), default=1,
                   help="2: answer the second turn after the method's own first answer")
    shared.add_max_new_tokens(p)
    shared.add_sampling(p, seed_help="reproducible sampling: each question, turn and sample draws from its own "
                                     "stream derived from (seed, question_id, turn, sample)")
    p.add_argument("--num-samples", type=int, default=1, metavar="N",
                   help="draw N answers per question (or prompt), recorded with their sample index; "
                        "needs --temperature > 0")
    form = p.add_argument_group("structured outputs (exact with respect to the target masked by the grammar)")
    shape = form.add_mutually_exclusive_group()
    shape.add_argument("--json-schema", type=Path, metavar="FILE",
                       help="every answer is a JSON document this schema (a JSON file) accepts")
    shape.add_argument("--regex", metavar="PATTERN", help="every answer matches this regular expression")
    shape.add_argument("--structured", action="store_true",
                       help="each question's own response_format (a questions file's field, e.g. "
                            "data/structured.jsonl) constrains its answer")
    shared.add_model_settings(p)
    shared.add_output(p, help="write one JSON object per answer to this JSONL file")


def run(args: argparse.Namespace) -> None:
    # Heavy imports after argument parsing, so `--help` and usage errors are instant.
    from tqdm import tqdm

    from specheads.inference.engine.answers import answer, answer_row
    from specheads.inference.engine.engine import Engine
    from specheads.inference.engine.sampling import SamplingParams
    from specheads.questions import check_distinct_ids, load_questions
    from specheads.target import parse_device, stop_token_ids

    options = shared.method_options(args)
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
    if args.structured and questions is None:
        raise ValueError("--structured reads each question's response_format: it needs --questions FILE")
    grammar = _grammar(args)  # a bad schema or pattern fails before the model loads
    out_file = _open_output(args.output)  # fail now, not after minutes of generation

    model, tokenizer = shared.load_model(args)
    backend = shared.target_backend(args)
    engine = Engine(model, shared.make_method(args, options, model, tokenizer)[0], step=args.step,
                    compile=args.compile, backend=backend)
    settings = dict(num_turns=args.turn, max_new_tokens=args.max_new_tokens, sampling=sampling,
                    stop_token_ids=stop_token_ids(tokenizer, model))

    def constraint_for(response_format: dict | None = None):
        """A fresh grammar state per generation (None: unconstrained)."""
        from specheads.inference.engine.constraint import GrammarConstraint
        from specheads.inference.engine.grammar import grammar_from_request

        g = grammar_from_request({"response_format": response_format}) if response_format else grammar
        if g is None:
            return None
        return lambda: GrammarConstraint(g, tokenizer, vocab_size=engine.vocab_size,
                                         stop_token_ids=settings["stop_token_ids"])

    def record(question_id, sample: int, result, text: str) -> None:
        if out_file is not None:
            out_file.write(json.dumps(answer_row(question_id, sample, result, text)) + "\n")
            out_file.flush()

    try:
        if questions is None:
            for k in range(args.num_samples):
                result, text = answer(engine, tokenizer, [args.prompt], question_id=None, sample=k,
                                      on_tokens=_StreamPrinter(tokenizer), constraint=constraint_for(), **settings)
                print(file=sys.stdout, flush=True)
                print(json.dumps(result.stats.to_dict()), file=sys.stderr)
                record(None, k, result, text)
            return
        taus, speeds = [], []
        for q in tqdm(questions, desc=f"{args.method}", unit="q", file=sys.stderr):
            for k in range(args.num_samples):
                made = constraint_for(q.response_format if args.structured else None)
                result, text = answer(engine, tokenizer, q.turns, question_id=q.question_id, sample=k,
                                      constraint=made, **settings)
                taus.append(result.stats.tau)
                speeds.append(result.stats.tokens_per_s)
                record(q.question_id, k, result, text)
    finally:
        if out_file is not None:
            out_file.close()
    print(f"{args.method}: {len(questions)} questions x {args.num_samples} samples, "
          f"mean tau {sum(taus) / len(taus):.3f}, mean {sum(speeds) / len(speeds):.2f} tok/s", file=sys.stderr)


def _grammar(args: argparse.Namespace):
    """The grammar `--json-schema` or `--regex` asks for (None without either)."""
    from specheads.inference.engine.grammar import json_schema_grammar, regex_grammar

    if args.regex is not None:
        grammar = regex_grammar(args.regex)
    elif args.json_schema is not None:
        if not args.json_schema.is_file():
            raise ValueError(f"--json-schema {args.json_schema} does not exist; pass a JSON file holding the schema")
        grammar = json_schema_grammar(args.json_schema.read_text())
    else:
        return None
    grammar.check()
    return grammar


def _open_output(path: Path | None):
    if path is None:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    return path.open("w", encoding="utf-8")


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
