"""One `specheads bench` run end to end, around `runner.run_bench`: the output checks made before any model loads,
the answers streamed to results.jsonl as they finish (Ctrl-C keeps what finished), then the exactness marks with
their fp32 margins, the report files, the rejection diagnosis and the W&B run.

The caller loads the target and builds the runners (`runner.build_runners`) in between, and prints what `finish`
returns; nothing here parses arguments or prints.
"""

from __future__ import annotations

import datetime
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from tqdm import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specheads.gemm_choice import describe, known
from specheads.gemm_layout import linear_layout
from specheads.inference.bench import report as bench_report
from specheads.inference.bench.divergence import attach_margins
from specheads.inference.bench.report import BenchReport
from specheads.inference.bench.runner import Record, Runner, mark_exactness, run_bench
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.proposers.verify_cost import cached_verify_cost
from specheads.machine import hardware_name, vector_flags
from specheads.questions import Question


@dataclass
class BenchOutcome:
    report: BenchReport
    diagnosis: str | None  # the rejection diagnosis as markdown (with `diagnose`)
    wandb_run: str | None  # the W&B run's folder (with report_to="wandb")


def check_output(output: Path | None, *, plots: bool, report_to: str) -> None:
    """Fail before any model loads, not after an hour of generation: the folder is writable and the plotting and
    W&B packages the run will need are installed."""
    if output is not None:
        try:
            output.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(dir=output, prefix=".write-check-"):
                pass
        except OSError as err:
            raise ValueError(f"output dir {output} is not writable ({err.strerror or err}); pass --output a folder "
                             "you can write to or fix its permissions") from None
    if plots and (output is not None or report_to == "wandb"):
        bench_report.require_plotting()
    if report_to == "wandb":
        bench_report.require_wandb()


def run_config(settings: dict) -> dict:
    """config.json: what was asked for, when it started and the library versions."""
    return {**settings, "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}


def machine(model: PreTrainedModel) -> dict:
    """Where the run ran, for config.json and summary.md: the CPU and the flags that choose its kernels, the threads,
    the target's weight layout and, where products run on measured kernels, which kernel each weight shape (the
    target's, its lean forward's fused ones, the drafters') takes at each row count. Call it once the runners are
    built."""
    device = next(model.parameters()).device
    layout = linear_layout(model)
    return {"device": hardware_name(device),
            "cpu_flags": vector_flags(), "threads": torch.get_num_threads(), "weight_layout": layout,
            "kernels": describe(known(model.dtype)).splitlines() if layout == "measured" else []}


def verify_cost_used(model: PreTrainedModel) -> dict | None:
    """The one-row verify cost curve the node budget read in this run (this machine's cached one; None where no
    method measured one), as relative costs by node count with the time it was measured, for config.json."""
    cached = cached_verify_cost(model)
    if cached is None:
        return None
    cost, measured_at = cached
    return {"nodes": list(cost.nodes), "relative": [round(cost.relative(n), 3) for n in cost.nodes],
            "one_step_ms": round(cost.seconds[0] * 1000, 1),
            "measured": None if measured_at is None else
            datetime.datetime.fromtimestamp(measured_at).isoformat(timespec="seconds")}


def collect(runners: dict[str, Runner], tokenizer: PreTrainedTokenizerBase, questions: Sequence[Question], *,
            output: Path | None, max_new_tokens: int, sampling: SamplingParams, stop_token_ids: list[int],
            turns: int, warmup: int, max_minutes: float | None = None) -> tuple[list[Record], bool]:
    """Every (question, method, turn) answered, each appended to output/results.jsonl as it finishes (`finish`
    rewrites it with the exactness marks); with `max_minutes`, no question is begun once that many minutes have
    passed (the warm-up counted), so the run ends within one question of its budget. Returns the records and
    whether Ctrl-C stopped the run early."""
    results = (output / "results.jsonl").open("w", encoding="utf-8") if output is not None else None
    records: list[Record] = []
    bar = tqdm(total=len(questions) * len(runners), desc="bench", unit="run", file=sys.stderr)
    deadline = None if max_minutes is None else time.monotonic() + 60 * max_minutes
    try:
        for rec in run_bench(runners, tokenizer, questions, max_new_tokens=max_new_tokens, sampling=sampling,
                             stop_token_ids=stop_token_ids, turns=turns, warmup=warmup,
                             more=lambda: deadline is None or time.monotonic() < deadline):
            records.append(rec)
            if rec.turn == turns:
                bar.update(1)
            bar.set_postfix_str(rec.method, refresh=False)
            if results is not None:
                results.write(json.dumps(bench_report.record_row(rec)) + "\n")
                results.flush()
    except KeyboardInterrupt:
        return records, True
    finally:
        bar.close()
        if results is not None:
            results.close()
    return records, False


def finish(records: list[Record], runners: dict[str, Runner], model: PreTrainedModel,
           tokenizer: PreTrainedTokenizerBase, *, greedy: bool, config: dict,
           load_fp32: Callable[[], PreTrainedModel], diagnose: bool = False, output: Path | None = None,
           plots: bool = True, report_to: str = "none", wandb_project: str | None = None) -> BenchOutcome:
    """The report of `records`, written where asked.

    1. Greedy runs: mark each output's match with ar's; where one differs, the fp32 logit margin at the first
       difference (from `model` if it is fp32, else from the fp32 target `load_fp32` returns).
    2. Build the tables and, with `diagnose`, where the runners' drafts were rejected.
    3. With `output`: results.jsonl, summary.json/.md, config.json, the plots and the diagnosis files.
    4. With report_to="wandb": the same as a W&B run (plots drawn in a scratch folder when there is no `output`).
    """
    if greedy:
        mark_exactness(records)
        if any(r.matches_ar is False for r in records):
            attach_margins(records, model if model.dtype == torch.float32 else load_fp32())
    report = bench_report.build_report(records, greedy=greedy, config=config)
    diagnosis = _diagnosis(runners, tokenizer, model) if diagnose else None
    wandb_run = None
    with tempfile.TemporaryDirectory() as scratch:
        written: list[Path] = []
        if output is not None:
            written = bench_report.write_report(report, records, output, plots=plots)
        elif report_to == "wandb" and plots:
            written = bench_report.write_plots(report, records, Path(scratch))
        if diagnosis is not None and (output is not None or report_to == "wandb"):
            written += _write_diagnosis(*diagnosis, output or Path(scratch), summary=output is not None, plots=plots)
        if report_to == "wandb":
            wandb_run = bench_report.log_wandb(report, records, written, run_dir=output, project=wandb_project,
                                               name=output.name if output is not None else None,
                                               tables=diagnosis[2] if diagnosis is not None else None)
    return BenchOutcome(report, diagnosis[1] if diagnosis is not None else None, wandb_run)


def _diagnosis(runners: dict[str, Runner], tokenizer: PreTrainedTokenizerBase, model: PreTrainedModel):
    """(summaries by method, their markdown, their W&B tables) from the runners' rejection logs."""
    from specheads.inference.bench.diagnosis import diagnosis_markdown, diagnosis_tables, summarise
    from specheads.target import stop_token_ids
    from specheads.token_classes import token_classes

    classes = token_classes(tokenizer, model.config.get_text_config().vocab_size, stop_token_ids(tokenizer, model))
    summaries = {name: summarise(r.log, classes) for name, r in runners.items() if getattr(r, "log", None) is not None}

    def decode(token: int) -> str:
        return tokenizer.decode([token])

    return summaries, diagnosis_markdown(summaries, decode), diagnosis_tables(summaries, decode)


def _write_diagnosis(summaries, text: str, tables, folder: Path, *, summary: bool, plots: bool) -> list[Path]:
    """diagnosis.json and the tables appended to summary.md (with `summary`), and diagnosis.png; returns the plots."""
    from specheads.inference.bench.diagnosis import plot_diagnosis

    if summary:
        (folder / "diagnosis.json").write_text(
            json.dumps({name: d.to_json() for name, d in summaries.items()}, indent=2) + "\n", encoding="utf-8")
        with (folder / "summary.md").open("a", encoding="utf-8") as f:
            f.write("\n" + text)
    if not plots:
        return []
    plot_diagnosis(summaries, folder / "diagnosis.png")
    return [folder / "diagnosis.png"]
