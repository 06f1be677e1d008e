"""Time the two grammar engines that serving stacks use for structured outputs, llguidance and xgrammar, on the
default target's tokenizer and the JSON schemas of data/structured.jsonl.

For each schema it compiles the grammar, then walks a valid answer (a JSON document the schema accepts, tokenized by
the target's tokenizer) one token at a time, filling the next-token bitmask before each token and consuming it, then
rolls the whole answer back (what tree verification does for every branch). It reports the median over `--reps`
rounds of each part, in microseconds per token for the walk and the rollback. Neither package is imported by the
library: this script is how the structured-output backend was chosen (docs/results.md).

    .venv/bin/pip install xgrammar     # the set-up installs llguidance only
    .venv/bin/python scripts/lab/compare_grammar_backends.py --reps 20
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# A valid answer per question, written for its schema.
ANSWERS = {
    "s01": {"name": "Lumen desk lamp", "price": 34.99, "colour": "matte green"},
    "s02": [{"city": "Oslo", "population": 709000}, {"city": "Bergen", "population": 286000},
            {"city": "Trondheim", "population": 212000}],
    "s03": {"date": "4 March", "attendees": ["Ana", "Bo", "Chen"],
            "decisions": ["move the launch to April", "hire one more tester"]},
    "s04": {"port": 8080, "host": "127.0.0.1", "workers": 4, "logging": {"level": "info"}},
}


def schemas() -> dict[str, dict]:
    rows = [json.loads(line) for line in (ROOT / "data/structured.jsonl").read_text().splitlines() if line.strip()]
    return {r["question_id"]: r["response_format"]["json_schema"]["schema"] for r in rows if "response_format" in r}


def time_llguidance(tokenizer, schema: dict, ids: list[int], reps: int) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lt

    t0 = time.perf_counter()
    lltok = llguidance.hf.from_tokenizer(tokenizer)
    tok_s = time.perf_counter() - t0
    mask = lt.allocate_token_bitmask(1, lltok.vocab_size)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    return _walk(tok_s, lambda: llguidance.LLMatcher(lltok, grammar, log_level=0),
                 lambda m: lt.fill_next_token_bitmask(m, mask, 0), lambda m, t: m.consume_token(t), ids, reps)


def time_xgrammar(tokenizer, schema: dict, ids: list[int], reps: int) -> dict[str, float]:
    import xgrammar as xgr

    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    tok_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)

    def matcher():  # a fresh compiler each round, as the other backend compiles afresh (no cache between requests)
        compiler = xgr.GrammarCompiler(info, cache_enabled=False)
        return xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))

    return _walk(tok_s, matcher, lambda m: m.fill_next_token_bitmask(mask, 0), lambda m, t: m.accept_token(t),
                 ids, reps)


def _walk(tok_s: float, matcher, fill, consume, ids: list[int], reps: int) -> dict[str, float]:
    """Per round: build the matcher (compile), walk `ids` filling the mask before each token, roll them all back."""
    walks, rolls, compiles = [], [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        m = matcher()
        compiles.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for t in ids:
            fill(m)
            assert consume(m, t), t
        walks.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        m.rollback(len(ids))
        rolls.append(time.perf_counter() - t0)
    return _summary(tok_s, compiles, walks, rolls, len(ids))


def _summary(tok_s: float, compiles: list[float], walks: list[float], rolls: list[float], n: int) -> dict[str, float]:
    return {"tokenizer_ms": 1e3 * tok_s, "compile_ms": 1e3 * statistics.median(compiles),
            "mask_and_consume_us_per_token": 1e6 * statistics.median(walks) / n,
            "rollback_us_per_token": 1e6 * statistics.median(rolls) / n, "tokens": n}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default=None, help="target directory (default: the converted default target)")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    for package in ("llguidance", "xgrammar"):
        if importlib.util.find_spec(package) is None:
            raise SystemExit(f"this comparison needs {package}: .venv/bin/pip install {package}")
    from transformers import AutoTokenizer

    from specheads.target import resolve_target

    tokenizer = AutoTokenizer.from_pretrained(resolve_target(args.target or "default"))
    print("| question | backend | tokens | compile ms | mask+consume µs/token | rollback µs/token "
          "| tokenizer set-up ms |")
    print("|---|---|---|---|---|---|---|")
    for qid, schema in schemas().items():
        ids = tokenizer(json.dumps(ANSWERS[qid]), add_special_tokens=False)["input_ids"]
        for name, timer in (("llguidance", time_llguidance), ("xgrammar", time_xgrammar)):
            r = timer(tokenizer, schema, ids, args.reps)
            print(f"| {qid} | {name} | {r['tokens']} | {r['compile_ms']:.1f} | "
                  f"{r['mask_and_consume_us_per_token']:.1f} | {r['rollback_us_per_token']:.2f} | "
                  f"{r['tokenizer_ms']:.0f} |")


if __name__ == "__main__":
    main()
