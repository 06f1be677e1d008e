"""Methods side by side on the same questions, interleaved per question so machine drift hits all alike.

Method specs: `ar`, `hf` (transformers `generate`), `ngram`, `draft:PATH`,
`draft:early-exit:N`, `eagle:HEADS_DIR`, `medusa:HEADS_DIR`. Every method answers the same rendered prompt; for greedy
runs each output is compared with `ar`'s (the exactness check).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from transformers import PreTrainedModel

from specheads.inference.engine import Engine
from specheads.inference.methods import METHODS, DraftLoader, MethodOptions, make_proposer
from specheads.inference.sampling import SamplingParams
from specheads.inference.stats import GenerationStats
from specheads.questions import Question

BASELINES = ("hf",)


@dataclass(frozen=True)
class MethodSpec:
    name: str  # as given, e.g. "draft:early-exit:8"
    method: str  # "ar", "hf", "ngram", "draft", ...
    arg: str | None = None  # draft model for draft, heads folder for medusa/eagle


def parse_methods(spec: str) -> list[MethodSpec]:
    """'ar,hf,ngram,draft:early-exit:8' -> specs; unknown names list the valid ones."""
    out = []
    for name in (s.strip() for s in spec.split(",")):
        if not name:
            continue
        method, _, arg = name.partition(":")
        if method not in METHODS and method not in BASELINES:
            raise ValueError(f"unknown method {method!r} in --methods; valid: {', '.join([*METHODS, *BASELINES])}")
        if method in ("draft", "eagle", "medusa") and not arg:
            raise ValueError(f"{method} needs a path: {method}:PATH" + (" or draft:early-exit:N" if method == "draft" else ""))
        out.append(MethodSpec(name=name, method=method, arg=arg or None))
    if not out:
        raise ValueError("--methods is empty; e.g. --methods ar,hf,ngram")
    return out


@dataclass
class Record:
    question_id: int | str
    category: str
    method: str
    output_ids: list[int]
    stats: GenerationStats
    matches_ar: bool | None = None  # greedy runs only
    first_mismatch: int | None = None


@dataclass
class MethodSummary:
    method: str
    questions: int
    new_tokens: int
    wall_s: float
    tokens_per_s: float  # total new tokens / total wall time
    speedup_vs_ar: float | None  # median over questions of per-question (tok/s) ratios
    speedup_vs_hf: float | None
    tau: float  # mean over questions
    acceptance_rate: float
    ttft_s: float  # median
    exact_matches: str = ""  # "k/n" for greedy runs
    extra: dict = field(default_factory=dict)


class _HFGenerate:
    """transformers `generate` as the external baseline, timed the same way as the engine."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model

    @torch.inference_mode()
    def generate(self, prompt: list[int], *, max_new_tokens: int, sampling: SamplingParams, stop_token_ids: list[int]):
        start = time.perf_counter()
        ids = torch.tensor([prompt], device=self.model.device)
        kwargs = dict(do_sample=False) if sampling.greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  eos_token_id=stop_token_ids or None, pad_token_id=(stop_token_ids or [0])[0], **kwargs)
        new = out[0, len(prompt):].tolist()
        stats = GenerationStats(new_tokens=len(new), steps=len(new), wall_s=time.perf_counter() - start,
                                finish_reason="stop" if new and new[-1] in stop_token_ids else "length")
        return new, stats


def run_bench(
    target: PreTrainedModel,
    specs: list[MethodSpec],
    questions: list[Question],
    render: Callable[[Question], list[int]],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_token_ids: list[int],
    load_draft: DraftLoader,
    warmup: int = 1,
) -> Iterator[Record]:
    """Yield one Record per (question, method), methods interleaved within each question.

    `warmup` questions are first run once per method and discarded (allocator and kernel warm-up).
    """
    runners = {}
    for spec in specs:
        if spec.method == "hf":
            runners[spec.name] = _HFGenerate(target)
        else:
            opts = MethodOptions(draft=spec.arg) if spec.method == "draft" else MethodOptions(heads=spec.arg)
            proposer = make_proposer(spec.method, target, opts, load_draft)
            runners[spec.name] = Engine(target, proposer)

    def run(name: str, prompt: list[int]) -> tuple[list[int], GenerationStats]:
        runner = runners[name]
        if isinstance(runner, _HFGenerate):
            return runner.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, stop_token_ids=stop_token_ids)
        res = runner.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling, stop_token_ids=stop_token_ids)
        return res.output_ids, res.stats

    for q in questions[:warmup]:
        for spec in specs:
            run(spec.name, render(q))
    for q in questions:
        prompt = render(q)
        for spec in specs:
            ids, stats = run(spec.name, prompt)
            yield Record(q.question_id, q.category, spec.name, ids, stats)


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def summarize(records: list[Record], greedy: bool) -> list[MethodSummary]:
    """Aggregate per method; speedups are medians of per-question ratios (robust to noisy machines)."""
    by_q: dict[int | str, dict[str, Record]] = {}
    for r in records:
        by_q.setdefault(r.question_id, {})[r.method] = r
    ar_name = next((r.method for r in records if r.method == "ar"), None)
    if greedy and ar_name:
        for per in by_q.values():
            ref = per.get(ar_name)
            for r in per.values():
                if ref is not None:
                    r.first_mismatch = first_mismatch(r.output_ids, ref.output_ids)
                    r.matches_ar = r.first_mismatch is None
    methods = list(dict.fromkeys(r.method for r in records))
    out = []
    for m in methods:
        rs = [per[m] for per in by_q.values() if m in per]

        def ratio(base: str, m: str = m) -> float | None:
            vals = [per[m].stats.tokens_per_s / per[base].stats.tokens_per_s
                    for per in by_q.values() if m in per and base in per and per[base].stats.tokens_per_s > 0]
            return statistics.median(vals) if vals else None

        tokens = sum(r.stats.new_tokens for r in rs)
        wall = sum(r.stats.wall_s for r in rs)
        drafted = sum(r.stats.drafted for r in rs)
        checked = [r for r in rs if r.matches_ar is not None]
        out.append(MethodSummary(
            method=m, questions=len(rs), new_tokens=tokens, wall_s=wall,
            tokens_per_s=tokens / wall if wall else 0.0,
            speedup_vs_ar=ratio("ar") if "ar" in methods else None,
            speedup_vs_hf=ratio("hf") if "hf" in methods else None,
            tau=statistics.mean(r.stats.tau for r in rs) if rs else 0.0,
            acceptance_rate=sum(r.stats.accepted for r in rs) / drafted if drafted else 0.0,
            ttft_s=statistics.median(r.stats.ttft_s for r in rs) if rs and any(r.stats.ttft_s for r in rs) else 0.0,
            exact_matches=f"{sum(r.matches_ar for r in checked)}/{len(checked)}" if checked else "",
        ))
    return out


def markdown_table(summaries: list[MethodSummary]) -> str:
    def fmt(x: float | None, spec: str = ".2f") -> str:
        return "-" if x is None else format(x, spec)

    lines = ["| method | tok/s | speedup vs ar | speedup vs hf | τ | acceptance rate | TTFT s | greedy == ar |",
             "|---|---|---|---|---|---|---|---|"]
    for s in summaries:
        lines.append(f"| {s.method} | {s.tokens_per_s:.2f} | {fmt(s.speedup_vs_ar)} | {fmt(s.speedup_vs_hf)} | "
                     f"{s.tau:.2f} | {s.acceptance_rate:.2f} | {fmt(s.ttft_s or None, '.3f')} | {s.exact_matches or '-'} |")
    return "\n".join(lines)
