"""Methods side by side on the same questions, interleaved per question so machine drift hits all alike.

Which methods run is a list of method specs (`specheads.inference.bench.method_spec`): engine methods and the
transformers baselines. Every method answers the same rendered prompt; on a second turn each method sees
its own first answer. For greedy runs each output is compared with `ar`'s (the exactness check).

Running lives here; tables, files, plots and W&B live in `bench_report.py`.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from transformers import CompileConfig, PreTrainedModel, PreTrainedTokenizerBase
from transformers.generation.streamers import BaseStreamer

from specheads.draft_models import parallel_spec
from specheads.gemm_layout import plain_linears
from specheads.inference.bench.diagnosis import RejectionLog
from specheads.inference.bench.llamacpp_spec import plain_of
from specheads.inference.bench.method_spec import LLAMACPP, PLD_TOKENS, MethodSpec
from specheads.inference.engine.constraint import GrammarConstraint
from specheads.inference.engine.engine import Engine
from specheads.inference.engine.grammar import grammar_from_request
from specheads.inference.engine.proposer import Proposer
from specheads.inference.engine.rollout import Rollout, rollout
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.stats import GenerationStats
from specheads.inference.methods import METHODS, DraftLoader, make_proposer
from specheads.questions import Question
from specheads.target import render_chat

log = logging.getLogger(__name__)
STATIC_CACHE_BUCKET = 256  # hf-static sizes its static KV cache in multiples of this many positions


class Runner(Protocol):
    """One method behind one call; `measures_tau` is False where the steps are not visible (HF).

    A runner that sizes a buffer once for a whole run (hf-static's static KV cache) also has `reserve(positions)`;
    `run_bench` calls it before the warm-up with the most positions (prompt + answer) one generation can take.
    """

    measures_tau: bool

    def generate(self, prompt: list[int], *, max_new_tokens: int, sampling: SamplingParams,
                 stop_token_ids: list[int]) -> tuple[list[int], GenerationStats]: ...


class _EngineRunner:
    measures_tau = True

    def __init__(self, engine: Engine, log: RejectionLog | None = None, tokenizer: Any = None) -> None:
        self.engine = engine
        self.log = log  # its steps' first rejections (`--diagnose`), or None
        self.tokenizer = tokenizer  # set for `+structured=1`: each question's response_format becomes a grammar

    @property
    def structured(self) -> bool:
        return self.tokenizer is not None

    def generate(self, prompt: list[int], *, max_new_tokens: int, sampling: SamplingParams,
                 stop_token_ids: list[int], response_format: dict | None = None) -> tuple[list[int], GenerationStats]:
        constraint = None
        if response_format is not None:
            grammar = grammar_from_request({"response_format": response_format})
            if grammar is not None:
                constraint = GrammarConstraint(grammar, self.tokenizer, vocab_size=self.engine.vocab_size,
                                               stop_token_ids=stop_token_ids)
        res = self.engine.generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                                   stop_token_ids=stop_token_ids, constraint=constraint)
        return res.output_ids, res.stats


class _FirstTokenTimer(BaseStreamer):
    """HF `generate` pushes the prompt first, then each step's new tokens: the second push is the first token."""

    def __init__(self, start: float) -> None:
        self.start = start
        self.pushes = 0
        self.ttft_s = 0.0

    def put(self, value: torch.Tensor) -> None:
        self.pushes += 1
        if self.pushes == 2:
            self.ttft_s = time.perf_counter() - self.start

    def end(self) -> None:
        pass


class _HFGenerate:
    """transformers `generate` (plain, assisted or prompt lookup) as an external baseline, timed like the engine.

    Its steps are hidden inside `generate`, so it reports no τ or acceptance (steps stay 0).
    """

    measures_tau = False

    def __init__(self, model: PreTrainedModel, *, assistant: PreTrainedModel | None = None,
                 prompt_lookup_tokens: int | None = None) -> None:
        self.model = model
        self.extra: dict = {}
        if assistant is not None:
            self.extra["assistant_model"] = assistant
        if prompt_lookup_tokens is not None:
            self.extra["prompt_lookup_num_tokens"] = prompt_lookup_tokens

    @torch.inference_mode()
    def generate(self, prompt: list[int], *, max_new_tokens: int, sampling: SamplingParams,
                 stop_token_ids: list[int]) -> tuple[list[int], GenerationStats]:
        if sampling.seed is not None:
            torch.manual_seed(sampling.seed)  # HF samples from the global RNG: seed it with this draw's seed
        start = time.perf_counter()
        timer = _FirstTokenTimer(start)
        ids = torch.tensor([prompt], device=self.model.device)
        kwargs = dict(do_sample=False) if sampling.greedy else dict(
            do_sample=True, temperature=sampling.temperature, top_k=sampling.top_k or None, top_p=sampling.top_p)
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                  eos_token_id=stop_token_ids or None, pad_token_id=(stop_token_ids or [0])[0],
                                  streamer=timer, **kwargs, **self.extra)
        new = out[0, len(prompt):].tolist()
        stats = GenerationStats(new_tokens=len(new), wall_s=time.perf_counter() - start, ttft_s=timer.ttft_s,
                                finish_reason="stop" if new and new[-1] in stop_token_ids else "length")
        return new, stats


class _HFStaticGenerate(_HFGenerate):
    """transformers `generate` with a static KV cache and its one-token decode step compiled by `torch.compile`
    (the prefill runs eagerly): the fastest plain decoding transformers offers, on CPU as on GPU.

    `generate` compiles by itself only on accelerators (CUDA, XPU, ...); the `CompileConfig` flag below makes it
    compile on CPU too. Compilation happens in the first call, which `run_bench`'s warm-up discards; that call's
    time is logged once.

    The static cache is sized once for the whole run: the longest generation `reserve` is told, rounded up to a
    multiple of STATIC_CACHE_BUCKET, so prompts and turns of every length reuse one compiled graph. A larger cache
    costs a little attention over the unused positions at every step, as it does in any static-cache deployment; a
    new length would cost a recompile inside a timed generation. A generation that needs more than was reserved
    grows the cache to its own rounded length (transformers keeps the largest length a model has used) and
    recompiles, with a warning.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__(model)
        compile_config = CompileConfig()  # transformers' defaults: inductor, mode "reduce-overhead" (CUDA graphs)
        compile_config._compile_all_devices = True  # what transformers reads to compile on any device, CPU included
        self.extra.update(cache_implementation="static", compile_config=compile_config)
        self.cache_len = 0  # static cache positions; 0 until the first reserve or generation
        self.calls = 0

    def reserve(self, positions: int) -> None:
        self.cache_len = max(self.cache_len, -(-positions // STATIC_CACHE_BUCKET) * STATIC_CACHE_BUCKET)

    def generate(self, prompt: list[int], *, max_new_tokens: int, sampling: SamplingParams,
                 stop_token_ids: list[int]) -> tuple[list[int], GenerationStats]:
        reserved, need = self.cache_len, len(prompt) + max_new_tokens
        self.reserve(need)
        self.extra["max_cache_len"] = self.cache_len
        # torch.compile cannot trace oneDNN's packed weights: the layers run as plain linears on their own weights
        # (inductor's freezing, which would pack them for the graph, folds the static cache into constants too and
        # breaks the next generation)
        with plain_linears(self.model):
            new, stats = super().generate(prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                                          stop_token_ids=stop_token_ids)
        self.calls += 1
        if self.calls == 1:
            log.info("hf-static: the first generate took %.1f s, compiling the decode step for a static cache of %d "
                     "positions", stats.wall_s, self.cache_len)
        elif self.cache_len != reserved:
            log.warning("hf-static: a generation needed %d cache positions, more than the %d reserved; the static "
                        "cache grew to %d and the decode step recompiled within this generation's time", need,
                        reserved, self.cache_len)
        return new, stats


def build_runners(target: PreTrainedModel, specs: list[MethodSpec], load_draft: DraftLoader,
                  diagnose: bool = False, step: str = "auto", compile: bool = False,
                  tokenizer: Any = None, target_name: str | None = None,
                  on_progress: Callable[[str], None] | None = None) -> dict[str, Runner]:
    """One runner per spec, in order; loads draft models and heads, so a mismatched checkpoint fails here. With
    `diagnose`, every engine method records its steps' first rejections (`diagnosis.RejectionLog`, its `log`).
    Every engine method runs the target forward `step` and `compile` set (`Engine`'s arguments); a method's own
    `+compile=` suffix overrides `compile`. A `+structured=1` method decodes under each question's response_format,
    through `tokenizer` (which it needs). A llama.cpp method starts its server here, on `target_name`'s GGUF (the
    name the target was loaded by: `default` for the default target); `close_runners` stops it. Where a llama.cpp
    method measures its drafting settings first (minutes), `on_progress` is told how far it is."""
    runners: dict[str, Runner] = {}
    try:
        for spec in specs:
            runners[spec.name] = _build_runner(target, spec, load_draft, diagnose, step, compile, tokenizer,
                                               target_name, on_progress)
    except BaseException:
        close_runners(runners)
        raise
    return runners


def close_runners(runners: dict[str, Runner]) -> None:
    """Stop what runners hold outside this process (llama.cpp's servers)."""
    for runner in runners.values():
        if hasattr(runner, "close"):
            runner.close()


def _build_runner(target: PreTrainedModel, spec: MethodSpec, load_draft: DraftLoader, diagnose: bool, step: str,
                  compile: bool, tokenizer: Any, target_name: str | None,
                  on_progress: Callable[[str], None] | None = None) -> Runner:
    if spec.method == LLAMACPP:
        from specheads.inference.bench.llamacpp import LlamaCppRunner

        return LlamaCppRunner(spec.options, target_name or target.config.name_or_path, target.dtype,
                              tokenizer=tokenizer, on_progress=on_progress)
    if spec.method == "hf":
        return _HFGenerate(target)
    if spec.method == "hf-static":
        return _HFStaticGenerate(target)
    if spec.method == "hf-assisted":
        assistant = load_draft(spec.arg)
        if parallel_spec(assistant.config) is not None:
            raise ValueError(f"hf-assisted:{spec.arg} is a parallel drafter (a placeholder token past the target's "
                             f"vocabulary, K tokens per forward), which transformers' assisted generation cannot "
                             f"drive; bench it as draft:{spec.arg}")
        return _HFGenerate(target, assistant=assistant)
    if spec.method == "hf-pld":
        return _HFGenerate(target, prompt_lookup_tokens=int(spec.arg or PLD_TOKENS))
    log = RejectionLog() if diagnose else None
    proposer = make_proposer(spec.method, target, spec.options, load_draft)
    if spec.backend == "llamacpp":  # the target forward on llama.cpp's kernels, as `llamacpp` runs them
        from specheads.inference.engine.llamacpp_backend import llamacpp_backend

        gguf = spec.gguf or ("bf16" if target.dtype == torch.bfloat16 else "f32")
        backend = llamacpp_backend(target_name or target.config.name_or_path, gguf,
                                   threads=torch.get_num_threads())
        engine = Engine(target, proposer, speculation=log, backend=backend)
    else:
        engine = Engine(target, proposer, speculation=log, step=step,
                        compile=compile if spec.compile is None else spec.compile)
    if spec.structured and tokenizer is None:
        raise ValueError(f"{spec.name}: +structured=1 needs the target's tokenizer (build_runners tokenizer=)")
    return _EngineRunner(engine, log, tokenizer if spec.structured else None)


@dataclass
class Record:
    question_id: int | str
    category: str
    turn: int  # 1-based
    method: str
    prompt_ids: list[int]  # the rendered prompt this method answered (its own history on turn 2)
    output_ids: list[int]
    stats: GenerationStats
    measures_tau: bool = True  # False for HF baselines: τ and acceptance are unknown, not 0
    matches_ar: bool | None = None  # greedy runs only
    first_mismatch: int | None = None  # first output position that differs from ar's
    margin_fp32: float | None = None  # there, the target's fp32 logit gap between ar's token and this one
    # (divergence.py)
    structured: bool = False  # decoded under the question's response_format (`+structured=1`)


WARMUP_NEW_TOKENS = 32


def run_bench(
    runners: dict[str, Runner],
    tokenizer: PreTrainedTokenizerBase,
    questions: Sequence[Question],
    *,
    max_new_tokens: int,
    sampling: SamplingParams,
    stop_token_ids: list[int],
    turns: int = 1,
    warmup: int = 1,
    more: Callable[[], bool] = lambda: True,
) -> Iterator[Record]:
    """Yield one Record per (question, method, turn), methods interleaved within each question.

    0. Tell runners that size a buffer once (`reserve`) the most positions one generation of the run can take.
    1. Run the first `warmup` questions' first turn once per method, up to WARMUP_NEW_TOKENS new tokens, and
       discard them (allocator and kernel warm-up, HF's lazy set-up, hf-static's and `--compile`'s compilation:
       all of it happens in the prompt and the first few steps, so a whole answer would only add time).
    2. For each question, for each method: answer turn 1; for turn 2 render [user 1, the method's own
       answer 1, user 2] with the chat template and answer that. Before each question after the first, `more()`
       says whether to go on (a time budget): every method always answers the same questions.
    With a seed, each (question, turn) draws from its own stream (`SamplingParams.for_draw`), the same for
    every method.
    """
    if turns not in (1, 2):
        raise ValueError(f"turns must be 1 or 2, got {turns}")
    if turns == 2 and any(len(q.turns) < 2 for q in questions):
        raise ValueError("--turns 2 needs two turns per question; the questions file has single-turn questions")

    def gen(name: str, prompt: list[int], q: Question, turn: int,
            new_tokens: int = max_new_tokens) -> tuple[list[int], GenerationStats]:
        log = getattr(runners[name], "log", None)
        if log is not None:
            log.category = q.category
        # Every method draws with the question's own seed, so methods compare on equal randomness.
        extra = {"response_format": q.response_format} if getattr(runners[name], "structured", False) else {}
        return runners[name].generate(prompt, max_new_tokens=new_tokens,
                                      sampling=sampling.for_draw(q.question_id, turn), stop_token_ids=stop_token_ids,
                                      **extra)

    reserving = [r for r in runners.values() if hasattr(r, "reserve")]
    if reserving and questions:
        positions = _longest_generation(tokenizer, questions, max_new_tokens, turns)
        for runner in reserving:
            runner.reserve(positions)
    for q in questions[:warmup]:
        for name in runners:
            gen(name, render_chat(tokenizer, [q.turns[0]]), q, 1, min(max_new_tokens, WARMUP_NEW_TOKENS))
    for runner in runners.values():  # the warm-up is not diagnosed either
        log = getattr(runner, "log", None)
        if log is not None:
            log.clear()
    for i, q in enumerate(questions):
        if i and not more():
            return
        for name, runner in runners.items():
            history: list[str] = []
            for t in range(turns):
                prompt = render_chat(tokenizer, q.turns[: t + 1], history)
                ids, stats = gen(name, prompt, q, t + 1)
                yield Record(q.question_id, q.category, t + 1, name, prompt, ids, stats, runner.measures_tau,
                             structured=bool(getattr(runner, "structured", False)) and q.response_format is not None)
                history.append(tokenizer.decode(ids, skip_special_tokens=True))


def _longest_generation(tokenizer: PreTrainedTokenizerBase, questions: Sequence[Question], max_new_tokens: int,
                        turns: int) -> int:
    """The most positions (prompt + answer) one generation of the run can take. A second turn's prompt holds the
    method's own first answer, counted as `max_new_tokens` tokens; its text re-encoded can take a few more, which
    the runners' rounding up (or, past it, their growing) absorbs."""
    most = max(len(render_chat(tokenizer, q.turns[:1])) for q in questions)
    if turns == 2:
        most = max(most, max(len(render_chat(tokenizer, q.turns[:2], [""])) for q in questions) + max_new_tokens)
    return most + max_new_tokens


def first_mismatch(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def mark_exactness(records: list[Record], reference: str = "ar") -> None:
    """Set matches_ar / first_mismatch on every record whose (question, turn) also has a `reference` record; records
    decoded under a grammar compare with `reference` decoded under it (`ar+structured=1`)."""
    refs = {(r.question_id, r.turn, r.structured): r for r in records
            if r.method == reference or (r.structured and r.method == f"{reference}+structured=1")}
    for r in records:
        ref = refs.get((r.question_id, r.turn, r.structured))
        if ref is not None:
            r.first_mismatch = first_mismatch(r.output_ids, ref.output_ids)
            r.matches_ar = r.first_mismatch is None


@dataclass
class MethodSummary:
    method: str
    category: str  # "all", or one question category
    generations: int  # (question, turn) pairs summarised
    new_tokens: int
    wall_s: float
    tokens_per_s: float  # total new tokens / total wall time
    speedup_vs_ar: float | None  # median over generations of per-generation (tok/s) ratios
    speedup_vs_hf: float | None
    tau: float | None  # mean over generations of each one's τ; None for HF baselines
    acceptance_rate: float | None  # accepted / drafted over all steps; None when nothing was drafted
    accept_per_position: list[float] | None  # [i]: share of all steps accepting >= i+1 tokens
    ttft_s: float | None  # median; None where not measured
    draft_ms_per_step: float | None = None  # time in the proposer per target forward; None for HF baselines
    exact_matches: str = ""  # "k/n" outputs equal to ar's, greedy runs only
    # against plain llama.cpp where it ran: at the method's own precision for one drafting on llama.cpp (`plain_of`),
    # else at the run's
    speedup_vs_llamacpp: float | None = None


def _summary(method: str, category: str, records: list[Record], methods: list[str]) -> MethodSummary:
    by_gen: dict[tuple, dict[str, Record]] = {}
    for r in records:
        by_gen.setdefault((r.question_id, r.turn), {})[r.method] = r
    rs = [r for r in records if r.method == method]

    def ratio(base: str) -> float | None:
        # Per-generation ratios, then the median: robust to a noisy machine and to uneven answer lengths.
        vals = [per[method].stats.tokens_per_s / per[base].stats.tokens_per_s
                for per in by_gen.values() if method in per and base in per and per[base].stats.tokens_per_s > 0]
        return statistics.median(vals) if vals and base in methods else None

    tokens = sum(r.stats.new_tokens for r in rs)
    wall = sum(r.stats.wall_s for r in rs)
    timed = [r.stats.ttft_s for r in rs if r.stats.ttft_s > 0]
    checked = [r for r in rs if r.matches_ar is not None]
    tau = acceptance = per_position = draft_ms = None
    if rs and all(r.measures_tau for r in rs):
        tau = statistics.mean(r.stats.tau for r in rs)
        drafted = sum(r.stats.drafted for r in rs)
        acceptance = sum(r.stats.accepted for r in rs) / drafted if drafted else None
        steps = sum(r.stats.steps for r in rs)
        depth = max(len(r.stats.accepted_at_least) for r in rs)
        per_position = [sum(r.stats.accepted_at_least[i] for r in rs if i < len(r.stats.accepted_at_least)) / steps
                        for i in range(depth)] if steps else []
        # a runner that cannot see its drafting time (llama.cpp's) leaves it 0: unknown, not free
        timed_draft = any(r.stats.draft_s for r in rs)
        draft_ms = 1000 * sum(r.stats.draft_s for r in rs) / steps if steps and timed_draft else None
    return MethodSummary(
        method=method, category=category, generations=len(rs), new_tokens=tokens, wall_s=wall,
        tokens_per_s=tokens / wall if wall else 0.0, speedup_vs_ar=ratio("ar"), speedup_vs_hf=ratio("hf"),
        tau=tau, acceptance_rate=acceptance, accept_per_position=per_position,
        ttft_s=statistics.median(timed) if timed else None, draft_ms_per_step=draft_ms,
        exact_matches=f"{sum(r.matches_ar for r in checked)}/{len(checked)}" if checked else "",
        speedup_vs_llamacpp=ratio(plain_of(method) or LLAMACPP),
    )


def summarize(records: list[Record], *, greedy: bool, by_category: bool = False) -> list[MethodSummary]:
    """One summary per method (category "all"), or per (category, method) with `by_category`.

    For greedy runs the records are first marked against `ar`'s outputs (see `mark_exactness`).
    """
    if greedy:
        mark_exactness(records)
    methods = list(dict.fromkeys(r.method for r in records))
    groups: dict[str, list[Record]] = {"all": records}
    if by_category:
        groups = {}
        for r in records:
            groups.setdefault(r.category, []).append(r)
    return [_summary(m, cat, rs, methods) for cat, rs in groups.items() for m in methods
            if any(r.method == m for r in rs)]


def measure(
    target: PreTrainedModel,
    proposer: Proposer,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    sampling: SamplingParams = SamplingParams(),
    name: str = "proposer",
    on_record: Callable[[Record], None] | None = None,
) -> MethodSummary:
    """Measured τ of `proposer` on `prompts` (token ids), through the bench's own runner and summary.

    For a training recipe: the returned summary's `tau` (mean over prompts), `acceptance_rate`,
    `accept_per_position` and `tokens_per_s` are the numbers `specheads bench` would report for
    the same prompts. Greedy by default; `on_record` sees each prompt's record (e.g. for a progress bar).
    """
    runner = _EngineRunner(Engine(target, proposer))
    records = []
    for i, prompt in enumerate(prompts):
        ids, stats = runner.generate(list(prompt), max_new_tokens=max_new_tokens, sampling=sampling.for_draw(i),
                                     stop_token_ids=list(stop_token_ids))
        records.append(Record(i, "", 1, name, list(prompt), ids, stats))
        if on_record is not None:
            on_record(records[-1])
    if not records:
        raise ValueError("measure needs at least one prompt")
    return summarize(records, greedy=False)[0]


def measure_drafter(target: PreTrainedModel, kind: str, path: str, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                    load_draft: DraftLoader | None = None, tree: str | None = None) -> MethodSummary:
    """Measured τ of the drafter of `kind` saved at `path` on `prompts`, with nothing grafted on and its whole trees
    verified (`Method.heads_alone`: the heads' own τ, the same on every machine), or drafting the named `tree`
    ("chain3": as chain engines draft). One of training's two entries into inference (with `rollout_drafter`): a
    recipe calls these (and `drafts_trees`) and nothing else of the engine."""
    return measure(target, drafter_alone(target, kind, path, load_draft, tree=tree), prompts,
                   max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, name=kind)


def drafts_trees(kind: str) -> bool:
    """Whether the drafter of `kind` decodes the named trees `chainN` is one of (`measure_drafter` can name it);
    Medusa names its own trees, whose paths are its heads' (its chain is its `chain-4` preset)."""
    from specheads.inference.methods.tree_options import TREES

    method = METHODS.get(kind)
    return method.takes("tree") and set(method.trees) == set(TREES)


def rollout_drafter(target: PreTrainedModel, kind: str, path: str, prompts: Sequence[Sequence[int]], *,
                    max_new_tokens: int, stop_token_ids: Sequence[int] = (),
                    temperature: float = 0.0, seed: int | None = None, rows: int = 8) -> list[Rollout]:
    """`prompts` decoded `rows` at a time with the drafter of `kind` saved at `path`, alone as `measure_drafter`
    runs it but drafting chains (a token per level: a verify of `rows` whole trees costs several times a step of
    chains on a CPU, and where a chain fails is where the drafter's own first guess did), with where each step's
    draft failed (`rollout.py`): a recipe's on-policy phase. Greedy at temperature 0; else sampled, each prompt's
    draws seeded from `seed` and its place."""
    sampling = SamplingParams(temperature=temperature, seed=seed) if temperature > 0 else SamplingParams()
    return rollout(target, drafter_alone(target, kind, path, None, chain=True), prompts,
                   max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids, sampling=sampling, rows=rows)


def drafter_alone(target: PreTrainedModel, kind: str, path: str, load_draft: DraftLoader | None,
                  chain: bool = False, tree: str | None = None) -> Proposer:
    """The proposer of the drafter of `kind` saved at `path` with nothing grafted on and its whole trees verified
    (`Method.heads_alone`), drafting chains, or drafting the named `tree`."""
    method = METHODS.get(kind)  # a drafter kind's decoding method carries its name
    return method.builder()(target, method.heads_alone(path, chain, tree), load_draft)
