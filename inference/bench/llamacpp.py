"""llama.cpp in the bench, on the same weights, interleaved with our methods and timed the same way (its method
names: `specheads.inference.bench.llamacpp_spec`).

Each method runs its own `llama-server` (`specheads.llamacpp.server`), started when the runners are built and
stopped when the run ends, with as many threads as torch uses. A request's wall time is the whole HTTP request,
as our runners time a whole `generate`; its tokens are llama.cpp's own ids (the prompt goes in as our ids, the
answer comes back as ids, nothing re-tokenized). τ is from llama.cpp's draft statistics: every target forward
commits one token more than it accepts, so steps = tokens - accepted (the prefill's token included, as ours).
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from specheads.inference.bench.llamacpp_spec import DEFAULT_DRAFT_MAX, LlamaCppOptions
from specheads.inference.engine.llamacpp_backend import CACHE_TYPES
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.stats import GenerationStats


def run_precision(options: LlamaCppOptions, dtype: torch.dtype) -> str:
    """The target GGUF's precision: the method's own, else the run's (bf16 for a bf16 run, f32 otherwise)."""
    return options.precision or ("bf16" if dtype == torch.bfloat16 else "f32")


class LlamaCppRunner:
    """One `llama-server` behind the bench's runner interface; `close()` stops it."""

    measures_tau = True

    def __init__(self, options: LlamaCppOptions, target: str, dtype: torch.dtype, threads: int | None = None,
                 tokenizer: Any = None, on_progress: Callable[[str], None] | None = None) -> None:
        from specheads.llamacpp.server import LlamaServer
        from specheads.llamacpp.target_gguf import target_gguf

        self.options = options
        self.precision = run_precision(options, dtype)
        model = target_gguf(target, self.precision)
        threads = threads or torch.get_num_threads()
        cache_type = CACHE_TYPES.get(self.precision)
        self._scratch = tempfile.TemporaryDirectory(prefix="specheads-llamacpp-")
        self.settings_text = ""  # how the drafting settings were chosen, for the report
        draft, draft_max, p_min = None, options.draft_max or DEFAULT_DRAFT_MAX, options.p_min or 0.0
        if options.heads is not None:
            drafts = self._draft_ggufs(options, target)
            if options.measured:
                draft_max, p_min, draft = self._measured(model, drafts, threads, cache_type, tokenizer, on_progress)
            else:
                draft = drafts[self._draft_precision()]
        spec_type = options.kind  # llama.cpp's own drafting, or none
        if options.heads is not None:  # no draft: measured not to pay here, so the row runs plain (report says why)
            spec_type = "draft-eagle3" if draft is not None else None
        self.server = LlamaServer(model, draft=draft, spec_type=spec_type, draft_max=draft_max, p_min=p_min,
                                  threads=threads, cache_type=cache_type)
        try:
            self.server.__enter__()
        except BaseException:
            self._scratch.cleanup()
            raise

    def _draft_precision(self) -> str:
        """The drafter's precision where the settings are given: f32, or bf16 beside a bf16 target."""
        return "bf16" if self.precision == "bf16" else "f32"

    def _draft_ggufs(self, options: LlamaCppOptions, target: str) -> dict[str, Path]:
        """The drafter as GGUF by precision: a .gguf file as is (its precision taken for any); heads exported at
        the precision used (`_draft_precision`), or, where the settings are measured, at every one measured."""
        from specheads.formats.export import export
        from specheads.llamacpp.draft_settings import MEASUREMENTS

        path = Path(str(options.heads))
        if path.suffix == ".gguf":
            return {"f32": path, self._draft_precision(): path}
        drafts = {}
        for precision in MEASUREMENTS[options.measure].precisions if options.measured else (self._draft_precision(),):
            done = export(path, "gguf", Path(self._scratch.name) / f"draft-{precision}", target=target,
                          precision=precision)
            drafts[precision] = done.folder / next(f for f in done.files if f.endswith(".gguf"))
        return drafts

    def _measured(self, model: Path, drafts: dict[str, Path], threads: int, cache_type: str | None,
                  tokenizer: Any, on_progress: Callable[[str], None] | None) -> tuple[int, float, Path | None]:
        """The settings measured fastest for these files on this machine (cached; measured now where not yet, each
        prompt's start told to `on_progress`)."""
        from specheads.llamacpp.draft_settings import calibration_prompts, draft_settings, drafter_id

        if tokenizer is None:
            raise ValueError("measuring llama.cpp's drafting settings needs the target's tokenizer (calibration "
                             "prompts); pass +draft_max=N to give them")
        choice = draft_settings(model, drafts, lambda n: calibration_prompts(tokenizer, n=n),
                                drafter=drafter_id(Path(str(self.options.heads))), threads=threads,
                                cache_type=cache_type, measurement=self.options.measure, on_progress=on_progress)
        s = choice.settings
        self.settings_text = f"{s.label()} ({choice.why}; {choice.measurement} measurement, {choice.measured})"
        return s.n_max, s.p_min, drafts[s.precision] if s.n_max else None

    def generate(self, prompt: list[int], *, max_new_tokens: int, sampling: SamplingParams,
                 stop_token_ids: list[int]) -> tuple[list[int], GenerationStats]:
        """llama.cpp stops at its vocabulary's end-of-generation tokens; the bench's stop tokens are the target's
        own, the same ones for the targets here (a GGUF's EOG set comes from the same tokenizer files)."""
        done = self.server.complete(prompt, max_new_tokens=max_new_tokens,
                                    temperature=0.0 if sampling.greedy else sampling.temperature,
                                    top_k=sampling.top_k or 0, top_p=sampling.top_p, seed=sampling.seed)
        tokens = done.tokens
        stats = GenerationStats(  # draft_steps and accepted_at_least stay 0 and empty: llama.cpp reports neither
new_tokens=len(tokens), steps=done.steps, drafted=done.drafted,
                                accepted=done.accepted, wall_s=done.wall_s,
                                finish_reason="stop" if tokens and tokens[-1] in stop_token_ids else "length")
        return tokens, stats

    def close(self) -> None:
        self.server.close()
        self._scratch.cleanup()
