"""llama.cpp's drafting settings for one drafter, target file and machine: chosen by measurement, cached.

llama.cpp drafts a chain: up to `--spec-draft-n-max` tokens, stopping early where the drafter's own probability of its
guess falls below `--spec-draft-p-min` (at the first position too: a step it is unsure of drafts nothing), and the
drafter file's precision sets what a draft step costs. What pays depends on how often the guesses are right, what
a verify of n+1 tokens costs against a one-token step on this target file, and the machine, so the settings are
measured, as the engine's node budget is:

1. one `llama-server` per candidate, all started at once on the same files (weights are mapped, so shared): plain
   decoding; the first drafter precision given (F32 in a full measurement) at every (n_max, p_min) of the grid
   (`GRID`); then the best of those with each other drafter precision given;
2. every calibration prompt asked of every server in turn, for `rounds` rounds (interleaved: a busy moment on the
   machine hits every candidate alike);
3. a candidate's speed is the median over prompts of its tok/s over plain's on the same prompt; the fastest wins if
   it is at least `MIN_GAIN` above plain, else the choice is to draft nothing, and the choice says why.

How much is measured is a `Measurement`: "full" (the grid on F32, then BF16 and Q8_0; 6 prompts, 2 rounds) or
"quick" (three settings on the Q8_0 drafter, 4 prompts, 1 round: a fourteenth of full's tokens, for a job with a
budget). A choice is cached per llama.cpp release, machine, thread count, target file, drafter files and
measurement under `$SPECHEADS_HOME/llamacpp/VERSION/draft-settings/`, measured once and read after; a quick request
takes a full choice where one is cached. Nothing here prints.
"""

from __future__ import annotations

import hashlib
import json
import logging
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from specheads.cached import stamp
from specheads.llamacpp.server import LlamaServer
from specheads.llamacpp.source import VERSION, llamacpp_home
from specheads.machine import cpu_name, vector_flags

log = logging.getLogger(__name__)

# (n_max, p_min) tried with the F32 drafter: a chain of 1 to 4, drafting always or only where the drafter is sure
GRID: tuple[tuple[int, float], ...] = tuple((n, p) for n in (1, 2, 4) for p in (0.0, 0.5, 0.8))
MIN_GAIN = 1.02  # a setting must beat plain decoding by this much (median ratio) to be recommended
CTX = 1024  # each server's context: a calibration prompt and its answer
MAX_PROMPT_TOKENS = CTX // 2
CALIBRATION_SKIP = 15000  # bundled ShareGPT conversations passed over: past the slices recipes train on
SPEC_TYPE = "draft-eagle3"
DRAFT_PRECISIONS = ("f32", "bf16", "q8_0")  # the drafter files measured (f32 first: the grid runs on it)


@dataclass(frozen=True)
class Measurement:
    """How much a choice measures: `grid` (n_max, p_min) on the first of `precisions`, the grid's best again with
    each other one, every candidate and plain asked `prompts` calibration prompts for `rounds` rounds of
    `max_new_tokens` tokens."""

    grid: tuple[tuple[int, float], ...]
    precisions: tuple[str, ...]
    prompts: int = 6
    rounds: int = 2
    max_new_tokens: int = 64


MEASUREMENTS: dict[str, Measurement] = {
    "full": Measurement(GRID, DRAFT_PRECISIONS),
    # for a budget (the main job): around what full measurement chose for P-EAGLE heads on a 2-core CPU (a cut at
    # 0.5 and the Q8_0 drafter the fastest, docs/results.md), one and two tokens cut at 0.5 and three cut at 0.8
    "quick": Measurement(((1, 0.5), (2, 0.5), (3, 0.8)), ("q8_0",), prompts=4, rounds=1, max_new_tokens=48),
}


@dataclass(frozen=True)
class DraftSettings:
    n_max: int  # --spec-draft-n-max; 0: draft nothing
    p_min: float = 0.0  # --spec-draft-p-min
    precision: str = "f32"  # the drafter file's

    def server_args(self) -> str:
        """The settings as llama-server's flags (none: plain decoding)."""
        if self.n_max == 0:
            return ""
        return f"--spec-draft-n-max {self.n_max}" + (f" --spec-draft-p-min {self.p_min:g}" if self.p_min else "")

    def label(self) -> str:
        return "no drafting" if self.n_max == 0 else f"n_max={self.n_max} p_min={self.p_min:g} {self.precision}"


@dataclass(frozen=True)
class Tried:
    settings: DraftSettings
    speedup: float  # median over prompts of tok/s over plain's
    tau: float  # tokens per target forward (llama.cpp's draft statistics)
    acceptance: float  # accepted / drafted (0 when nothing was drafted)


@dataclass(frozen=True)
class DraftChoice:
    settings: DraftSettings  # what to run (n_max 0: draft nothing)
    speedup: float  # its median ratio over plain (1.0 for drafting nothing)
    why: str  # one sentence for people
    tried: tuple[Tried, ...] = field(default=())
    machine: str = ""
    target: str = ""  # the target file's name
    measured: str = ""  # when, ISO time
    measurement: str = "full"  # how much was measured (`MEASUREMENTS`)

    def to_json(self) -> dict:
        return asdict(self)

    @staticmethod
    def from_json(data: Mapping) -> DraftChoice:
        tried = tuple(Tried(DraftSettings(**t["settings"]), t["speedup"], t["tau"], t["acceptance"])
                      for t in data.get("tried", ()))
        return DraftChoice(DraftSettings(**data["settings"]), data["speedup"], data["why"], tried,
                           data.get("machine", ""), data.get("target", ""), data.get("measured", ""),
                           data.get("measurement", "full"))


def choose(tried: Sequence[Tried], min_gain: float = MIN_GAIN) -> tuple[DraftSettings, float, str]:
    """The fastest candidate if it beats plain decoding by `min_gain`; else drafting nothing, with why."""
    if not tried:
        return DraftSettings(0), 1.0, "nothing was measured"
    best = max(tried, key=lambda t: t.speedup)
    if best.speedup >= min_gain:
        return best.settings, best.speedup, (f"{best.settings.label()} ran {best.speedup:.2f}x plain decoding "
                                             f"(τ {best.tau:.2f}), the fastest of {len(tried)} settings measured")
    return DraftSettings(0), 1.0, (f"drafting did not pay: the best of {len(tried)} settings measured, "
                                   f"{best.settings.label()}, ran {best.speedup:.2f}x plain decoding "
                                   f"(τ {best.tau:.2f}, acceptance {best.acceptance:.2f})")


def measure_draft_settings(target: Path, drafts: Mapping[str, Path], prompts: Sequence[list[int]], *,
                           max_new_tokens: int = 64, rounds: int = 2, threads: int | None = None,
                           cache_type: str | None = None, grid: Sequence[tuple[int, float]] | None = None,
                           binary: Path | None = None,
                           on_progress: Callable[[str], None] | None = None) -> DraftChoice:
    """Measure the candidates (module doc) on `prompts` (token ids, greedy) and choose. `drafts` maps a drafter
    precision to its GGUF file, the first one the grid runs on."""
    if not drafts:
        raise ValueError("no drafter file to measure")
    if not prompts:
        raise ValueError("no calibration prompts")
    first, *others = drafts
    candidates = [DraftSettings(n, p, first) for n, p in (GRID if grid is None else grid)]
    tried = _measure(target, drafts, candidates, prompts, max_new_tokens=max_new_tokens, rounds=rounds,
                     threads=threads, cache_type=cache_type, binary=binary, on_progress=on_progress)
    if others:  # the grid's best with each other precision
        best = max(tried, key=lambda t: t.speedup).settings
        again = [DraftSettings(best.n_max, best.p_min, p) for p in (first, *others)]
        tried = [t for t in tried if t.settings != best] + _measure(
            target, drafts, again, prompts, max_new_tokens=max_new_tokens, rounds=rounds, threads=threads,
            cache_type=cache_type, binary=binary, on_progress=on_progress)
    settings, speedup, why = choose(tried)
    return DraftChoice(settings, speedup, why, tuple(tried), machine=f"{cpu_name()} ({vector_flags()}), "
                       f"{threads or 'default'} threads", target=target_label(target),
                       measured=time.strftime("%Y-%m-%dT%H:%M:%S"))


def target_label(target: Path) -> str:
    """A target file for people: its name, or its folder's where the file is a cached conversion's model.gguf."""
    return target.parent.name if target.name == "model.gguf" else target.name


def _measure(target: Path, drafts: Mapping[str, Path], candidates: Sequence[DraftSettings],
             prompts: Sequence[list[int]], *, max_new_tokens: int, rounds: int, threads: int | None,
             cache_type: str | None, binary: Path | None,
             on_progress: Callable[[str], None] | None) -> list[Tried]:
    # candidate -1 is plain decoding; rate[i][k]: candidate i's tok/s on prompt k, one per round
    rate: dict[int, list[list[float]]] = {i: [[] for _ in prompts] for i in range(-1, len(candidates))}
    counts = {i: [0, 0, 0, 0] for i in range(len(candidates))}  # tokens, target forwards, accepted, drafted
    with ExitStack() as stack:
        plain = stack.enter_context(LlamaServer(target, threads=threads, cache_type=cache_type, ctx_size=CTX,
                                                binary=binary))
        servers = [stack.enter_context(LlamaServer(
            target, draft=drafts[s.precision], spec_type=SPEC_TYPE, draft_max=s.n_max, p_min=s.p_min,
            threads=threads, cache_type=cache_type, ctx_size=CTX, binary=binary)) for s in candidates]
        for r in range(rounds):
            for k, prompt in enumerate(prompts):
                if on_progress:
                    n = len(candidates)
                    on_progress(f"llama.cpp drafting settings: {n} setting{'s' * (n != 1)} and plain, round {r + 1} "
                                f"of {rounds}, prompt {k + 1} of {len(prompts)}")
                for i, server in [(-1, plain), *enumerate(servers)]:
                    done = server.complete(prompt, max_new_tokens=max_new_tokens)
                    rate[i][k].append(len(done.tokens) / max(done.wall_s, 1e-9))
                    if i >= 0:
                        for j, n in enumerate((len(done.tokens), done.steps, done.accepted, done.drafted)):
                            counts[i][j] += n
    # a prompt's speed: its best round (the least disturbed), as the node budget's timing takes its best
    base = [max(r) for r in rate[-1]]
    out = []
    for i, s in enumerate(candidates):
        ratios = [max(r) / b for r, b in zip(rate[i], base) if b > 0]
        tokens, steps, accepted, drafted = counts[i]
        out.append(Tried(s, statistics.median(ratios), tokens / max(steps, 1), accepted / drafted if drafted else 0.0))
    return out


def calibration_prompts(tokenizer, n: int = 6, max_tokens: int = MAX_PROMPT_TOKENS) -> list[list[int]]:
    """`n` first user turns of bundled ShareGPT conversations past `CALIBRATION_SKIP` (none of those reserved for
    evaluation), rendered with the target's chat template, each at most `max_tokens` tokens: what a chat
    engine's drafter is asked about, read by no recipe's default slice and by no bench."""
    from specheads.conversations import is_held_out, sharegpt_openings

    prompts: list[list[int]] = []
    for index, text in sharegpt_openings():
        if index < CALIBRATION_SKIP or is_held_out(text):
            continue
        rendered = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                 tokenize=False)
        ids = tokenizer(rendered, add_special_tokens=False)["input_ids"]
        if 8 <= len(ids) <= max_tokens:
            prompts.append(ids)
        if len(prompts) == n:
            break
    return prompts


def cache_path(target: Path, drafter: str, threads: int | None, version: str = VERSION,
               measurement: str = "full") -> Path:
    """Where the choice for drafter `drafter` (`drafter_id`) and `target` on this machine is kept: a folder per
    drafter, a file per machine, thread count, target file and measurement (full's without a suffix)."""
    machine = [cpu_name(), vector_flags(), str(threads), stamp(target)]
    key = hashlib.sha256("\n".join(machine).encode()).hexdigest()[:16]
    suffix = "" if measurement == "full" else f"-{measurement}"
    return llamacpp_home(version) / "draft-settings" / drafter / f"{target.stem}-{key}{suffix}.json"


def drafter_id(path: Path) -> str:
    """A drafter by its weights' contents: a heads folder's (or a run's final/) weights and config, or a GGUF
    file's bytes; so the same heads find their settings wherever they are copied or exported to."""
    path = Path(path)
    if (path / "final").is_dir():
        path = path / "final"
    files = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".json")) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"{path} holds no heads weights (.safetensors) to name the drafter by")
    digest = hashlib.sha256()
    for file in files:
        digest.update(file.name.encode())
        with open(file, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
    return digest.hexdigest()[:16]


def cached_choices(drafter: str, version: str = VERSION) -> list[DraftChoice]:
    """Every choice measured for drafter `drafter` on this machine's cache, any target file."""
    folder = llamacpp_home(version) / "draft-settings" / drafter
    return [DraftChoice.from_json(json.loads(p.read_text())) for p in sorted(folder.glob("*.json"))]


def draft_settings(target: Path, drafts: Mapping[str, Path], prompts: Callable[[int], Sequence[list[int]]], *,
                   drafter: str, threads: int | None = None, cache_type: str | None = None, remeasure: bool = False,
                   measurement: str = "full", **measure) -> DraftChoice:
    """The cached choice for drafter `drafter` (`drafter_id`; its files by precision `drafts`, those the measurement
    names among them) and `target` on this machine, measured first where there is none: `prompts(n)` is called only
    then, for the measurement's n calibration prompts. `measure` overrides the measurement's grid, rounds or tokens.
    A quick measurement takes a full one's choice where one is cached."""
    if measurement not in MEASUREMENTS:
        raise ValueError(f"measurement {measurement!r} is not one of {', '.join(MEASUREMENTS)}")
    path = cache_path(target, drafter, threads, measurement=measurement)
    if not remeasure:
        for cached in dict.fromkeys([cache_path(target, drafter, threads), path]):  # full's first
            if cached.is_file():
                return DraftChoice.from_json(json.loads(cached.read_text()))
    plan = MEASUREMENTS[measurement]
    files = {p: drafts[p] for p in plan.precisions if p in drafts}
    if not files:
        raise ValueError(f"the {measurement} measurement runs the drafter at {', '.join(plan.precisions)}; "
                         f"drafts has {', '.join(drafts) or 'none'}")
    measure = {"grid": plan.grid, "rounds": plan.rounds, "max_new_tokens": plan.max_new_tokens} | measure
    choice = measure_draft_settings(target, files, prompts(plan.prompts), threads=threads, cache_type=cache_type,
                                    **measure)
    choice = replace(choice, measurement=measurement)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(choice.to_json(), indent=1))
    tmp.replace(path)
    log.info("llama.cpp drafting settings for %s: %s (%s)", target.name, choice.settings.label(), choice.why)
    return choice
