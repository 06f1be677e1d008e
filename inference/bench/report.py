"""Bench reporting: results rows, summary tables (overall and per category), PNG plots and W&B.

Everything here works on finished `Record`s, so an interrupted bench reports what it has.
matplotlib and wandb are optional and imported lazily; `require_plotting` / `require_wandb`
let a caller fail before any model is loaded.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specheads.inference.bench.llamacpp_spec import plain_of
from specheads.inference.bench.runner import MethodSummary, Record, summarize

PLOTS = ("speedup_by_category.png", "tau_histogram.png", "accept_per_position.png")


@dataclass
class BenchReport:
    overall: list[MethodSummary]  # one row per method, category "all"
    by_category: list[MethodSummary]  # one row per (category, method)
    mismatches: list[dict]  # greedy outputs that differ from ar's: method, question_id, turn, first_mismatch,
    # margin_fp32
    config: dict = field(default_factory=dict)  # what was run (target, methods, sampling, versions, ...)
    # greedy runs: for each llama.cpp method drafting with our heads, "k/n" outputs equal to plain llama.cpp's at the
    # same precision (llama.cpp's own exactness, beside the comparison with our ar)
    llamacpp_exact: dict[str, str] = field(default_factory=dict)


def build_report(records: list[Record], *, greedy: bool, config: dict | None = None) -> BenchReport:
    overall = summarize(records, greedy=greedy)
    by_category = summarize(records, greedy=greedy, by_category=True)
    mismatches = [{"method": r.method, "question_id": r.question_id, "turn": r.turn, "first_mismatch": r.first_mismatch,
                   "margin_fp32": r.margin_fp32} for r in records if r.matches_ar is False]
    exact = llamacpp_exactness(records) if greedy else {}
    return BenchReport(overall, by_category, mismatches, dict(config or {}), exact)


def llamacpp_exactness(records: list[Record]) -> dict[str, str]:
    """{method drafting on llama.cpp (its own drafting with our heads, or our engine on its kernels): "k/n" of its
    outputs equal to plain llama.cpp's, same prompt}."""
    outputs = {(r.method, r.question_id, r.turn): r for r in records}
    counts: dict[str, list[bool]] = {}
    for r in records:
        plain = outputs.get((plain_of(r.method), r.question_id, r.turn))
        if plain is not None and plain.prompt_ids == r.prompt_ids:
            counts.setdefault(r.method, []).append(plain.output_ids == r.output_ids)
    return {m: f"{sum(same)}/{len(same)}" for m, same in counts.items()}


def record_row(rec: Record) -> dict:
    """One results.jsonl row; τ and acceptance are null (not 0) for methods that cannot measure them."""
    stats = rec.stats.to_dict()
    if not rec.measures_tau:
        stats.update(steps=None, drafted=None, accepted=None, tau=None, acceptance_rate=None, accept_per_position=None,
                     draft_s=None)
    if not stats["ttft_s"]:
        stats["ttft_s"] = None
    return {"question_id": rec.question_id, "category": rec.category, "turn": rec.turn, "method": rec.method,
            "prompt_tokens": len(rec.prompt_ids), "output_ids": rec.output_ids, "stats": stats,
            "matches_ar": rec.matches_ar, "first_mismatch": rec.first_mismatch, "margin_fp32": rec.margin_fp32}


def _fmt(x: float | None, spec: str = ".2f") -> str:
    return "-" if x is None else format(x, spec)


def markdown_table(summaries: list[MethodSummary], *, with_category: bool = False) -> str:
    # speedups are medians of per-generation ratios (the legend under the tables says so too), not total over total
    head = ["method", "tok/s", "speedup vs ar (median)", "speedup vs hf (median)", "τ", "acceptance rate",
            "accept ≥1/≥2/≥3", "draft ms/step", "TTFT s", "greedy == ar"]
    beside_llamacpp = any(s.speedup_vs_llamacpp is not None for s in summaries)  # a column only where it ran
    if beside_llamacpp:
        head.insert(4, "speedup vs llamacpp (median)")
    if with_category:
        head = ["category", *head]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for s in summaries:
        curve = "-" if not s.accept_per_position else "/".join(f"{x:.2f}" for x in s.accept_per_position[:3])
        cells = [s.method, f"{s.tokens_per_s:.2f}", _fmt(s.speedup_vs_ar), _fmt(s.speedup_vs_hf), _fmt(s.tau),
                 _fmt(s.acceptance_rate), curve, _fmt(s.draft_ms_per_step, ".1f"), _fmt(s.ttft_s, ".3f"),
                 s.exact_matches or "-"]
        if beside_llamacpp:
            cells.insert(4, _fmt(s.speedup_vs_llamacpp))
        if with_category:
            cells = [s.category, *cells]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def machine_text(machine: dict) -> str:
    """`run.machine`'s record in words: the device, its kernel-choosing flags and threads, the kernel plans, and the
    verify cost curve the node budget read (once the run has one)."""
    lines = [f"{machine['device']} ({machine['threads']} threads; flags: {machine['cpu_flags']}); weights "
             f"{machine['weight_layout']}" + (", products by measured kernel:" if machine["kernels"] else "")]
    lines += [f"- {line}" for line in machine["kernels"]]
    if cost := machine.get("verify_cost"):
        steps = ", ".join(f"{n} nodes {r:.2f}x" for n, r in zip(cost["nodes"], cost["relative"]) if n > 1)
        lines.append(f"\nVerify cost the node budget read (one-token step {cost['one_step_ms']} ms, measured "
                     f"{cost['measured'] or 'before dates were kept'}): {steps}")
    return "\n".join(lines)


def answered_text(config: dict) -> str | None:
    """How many of the run's questions every method answered, and the time budget that stopped it, if any (None
    before the run has counted them)."""
    if "questions_answered" not in config:
        return None
    text = f"Questions answered by every method: {config['questions_answered']} of {config['num_questions']}"
    if config.get("max_minutes"):
        text += f" (none begun after {config['max_minutes']:g} minutes)"
    return text


def summary_markdown(report: BenchReport) -> str:
    cfg = report.config
    parts = ["# specheads bench", ""]
    if cfg:
        def show(v: object) -> str:
            return ", ".join(map(str, v)) if isinstance(v, list) else str(v)

        parts += ["; ".join(f"{k}: {show(v)}" for k, v in cfg.items()
                            if k not in ("versions", "machine", "llamacpp_settings")), ""]
        if "machine" in cfg:
            parts += ["## Machine", "", machine_text(cfg["machine"]), ""]
    if answered := answered_text(cfg):
        parts += [answered, ""]
    parts += ["## Overall", "", markdown_table(report.overall), "",
              "## Per category", "", markdown_table(report.by_category, with_category=True), ""]
    if report.llamacpp_exact:
        parts += ["## Drafting on llama.cpp against llama.cpp alone", ""]
        parts += [f"- {m}: {k} outputs equal to {plain_of(m)}'s" for m, k in report.llamacpp_exact.items()]
        parts.append("")
    if cfg.get("llamacpp_settings"):
        parts += ["## llama.cpp's drafting settings, measured on this machine", ""]
        parts += [f"- {m}: {text}" for m, text in cfg["llamacpp_settings"].items()]
        parts.append("")
    if report.mismatches:
        parts += ["## Greedy mismatches against ar", "", mismatch_summary(report.mismatches), ""]
        parts += [f"- {m['method']}, question {m['question_id']} turn {m['turn']}: first differs at output token "
                  f"{m['first_mismatch']}" + _margin_text(m) for m in report.mismatches]
        parts.append("")
    parts += ["τ: tokens committed per target forward (accepted + 1), mean over generations; speedups: median of "
              "per-generation tok/s ratios; accept ≥i: share of steps accepting at least i draft tokens; "
              "\"-\": not measured (HF baselines hide their steps).", ""]
    return "\n".join(parts)


def _margin_text(m: dict) -> str:
    return "" if m.get("margin_fp32") is None else f", fp32 logit margin {m['margin_fp32']:.4f}"


def mismatch_summary(mismatches: list[dict]) -> str:
    """One line: how many outputs left ar's, and the largest fp32 margin at which one did
    (the exactness rule's test)."""
    margins = [m["margin_fp32"] for m in mismatches if m.get("margin_fp32") is not None]
    line = f"{len(mismatches)} greedy outputs differ from ar's"
    if margins:
        line += (f"; the largest fp32 logit margin between the two tokens where one first differs: {max(margins):.4f} "
                 f"(over {len(margins)} with a measured margin)")
    return line


def require_plotting() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ValueError("the bench plots need matplotlib; install it with `pip install matplotlib` "
                         "(or `pip install -e \".[bench]\"`)") from None


def require_wandb() -> None:
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ValueError("--report-to wandb needs wandb; install it with `pip install wandb`") from None


def _figure(width: float = 8.0):
    # A bare Figure on the Agg canvas: no pyplot, so no global backend state and no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, 4.5), dpi=100)
    FigureCanvasAgg(fig)
    return fig, fig.add_subplot(1, 1, 1)


def write_plots(report: BenchReport, records: list[Record], out_dir: Path) -> list[Path]:
    """speedup_by_category.png, tau_histogram.png, accept_per_position.png in `out_dir`."""
    require_plotting()
    from matplotlib.ticker import MaxNLocator

    out_dir = Path(out_dir)
    paths = [out_dir / name for name in PLOTS]
    methods = [s.method for s in report.overall]

    # 1. Speedup by category: vs ar where ar ran, else vs hf, else raw tok/s.
    base = "ar" if "ar" in methods else "hf" if "hf" in methods else None
    key = (lambda s: s.speedup_vs_ar) if base == "ar" else (lambda s: s.speedup_vs_hf) if base else (
        lambda s: s.tokens_per_s)
    cats = ["all", *dict.fromkeys(s.category for s in report.by_category)]
    rows = {(s.category, s.method): s for s in [*report.overall, *report.by_category]}
    fig, ax = _figure(width=10.0)
    width = 0.8 / max(len(methods), 1)
    for j, m in enumerate(methods):
        xs = [i + j * width for i in range(len(cats))]
        ax.bar(xs, [(key(rows[c, m]) or 0.0) if (c, m) in rows else 0.0 for c in cats], width, label=m)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(cats))], [c or "(none)" for c in cats],
                  rotation=30, ha="right")
    if base:
        ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
    ax.set_ylabel(f"speedup vs {base}" if base else "tokens/s")
    ax.set_title("Speedup by category (median of per-generation ratios)")
    if methods:
        ax.legend(fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))  # outside: bars stay visible
    fig.tight_layout()
    fig.savefig(paths[0])

    # 2. τ per generation, one histogram per engine method.
    fig, ax = _figure()
    taus = {m: [r.stats.tau for r in records if r.method == m and r.measures_tau] for m in methods}
    taus = {m: t for m, t in taus.items() if t}
    if taus:
        hi = max(max(t) for t in taus.values())
        bins = [1.0 + i * (hi - 1.0 + 1e-9) / 20 for i in range(21)] if hi > 1.0 else [0.5, 1.5]
        for m, t in taus.items():
            ax.hist(t, bins=bins, histtype="step", linewidth=1.5, label=f"{m} (mean {sum(t) / len(t):.2f})")
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no τ: only HF baselines ran", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel("τ (tokens per target forward)")
    ax.set_ylabel("generations")
    ax.set_title("τ per generation")
    fig.tight_layout()
    fig.savefig(paths[1])

    # 3. Per-position acceptance: share of steps accepting at least i draft tokens.
    fig, ax = _figure()
    curves = [(s.method, s.accept_per_position) for s in report.overall if s.accept_per_position]
    for m, curve in curves:
        ax.plot(range(1, len(curve) + 1), curve, marker="o", label=m)
    if curves:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no draft tokens were accepted", ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("position i")
    ax.set_ylabel("share of steps accepting ≥ i tokens")
    ax.set_ylim(0, 1)
    ax.set_title("Per-position acceptance")
    fig.tight_layout()
    fig.savefig(paths[2])
    return paths


def write_report(report: BenchReport, records: list[Record], out_dir: Path, plots: bool = True) -> list[Path]:
    """results.jsonl (with exactness marks), summary.json, summary.md, config.json and (with `plots`) the plots."""
    out_dir = Path(out_dir)
    with (out_dir / "results.jsonl").open("w", encoding="utf-8") as f:
        f.writelines(json.dumps(record_row(r)) + "\n" for r in records)
    # A list whose overall rows ("all") come first, then the per-category rows.
    rows = [asdict(s) for s in [*report.overall, *report.by_category]]
    (out_dir / "summary.json").write_text(json.dumps(rows, indent=2) + "\n", encoding="utf-8")
    (out_dir / "summary.md").write_text(summary_markdown(report), encoding="utf-8")
    (out_dir / "config.json").write_text(json.dumps({**report.config, "mismatches": report.mismatches,
                                                     "llamacpp_exact": report.llamacpp_exact}, indent=2,
                                                    default=str) + "\n", encoding="utf-8")
    written = [out_dir / n for n in ("results.jsonl", "summary.json", "summary.md", "config.json")]
    return written + (write_plots(report, records, out_dir) if plots else [])


def _key(method: str) -> str:
    return method.replace("/", "_")  # W&B groups keys on "/", and method names hold paths


def log_wandb(report: BenchReport, records: list[Record], plots: list[Path], *, run_dir: Path | None = None,
              project: str | None = None, name: str | None = None,
              tables: dict[str, tuple[list[str], list[list]]] | None = None) -> str:
    """Log the summary tables, per-generation rows, charts, plot images and any further `tables` (name: (columns,
    rows), e.g. the acceptance diagnosis) as one W&B run; return its folder.

    Scalars go to the run summary as `<metric>/<method>`, so the runs table compares bench runs side by side.
    `WANDB_MODE=offline` writes the run under `WANDB_DIR`, else `run_dir`, else ./wandb, with no network.
    """
    require_wandb()
    import wandb

    run = wandb.init(project=project or os.environ.get("WANDB_PROJECT") or "specheads", job_type="bench", name=name,
                     config=json.loads(json.dumps(report.config, default=str)),
                     dir=os.environ.get("WANDB_DIR") or (str(run_dir) if run_dir is not None else None))
    try:
        cols = ["category", "method", "generations", "tokens_per_s", "speedup_vs_ar", "speedup_vs_hf",
                "speedup_vs_llamacpp", "tau", "acceptance_rate", "draft_ms_per_step", "ttft_s", "exact_matches"]
        summary = wandb.Table(columns=cols, data=[[getattr(s, c) for c in cols]
                                                  for s in [*report.overall, *report.by_category]])
        rows = [record_row(r) for r in records]
        results = wandb.Table(columns=["question_id", "category", "turn", "method", "new_tokens", "tokens_per_s", "tau",
                                       "ttft_s", "matches_ar", "first_mismatch", "margin_fp32"],
                              data=[[str(r["question_id"]), r["category"], r["turn"], r["method"],
                                     r["stats"]["new_tokens"], r["stats"]["tokens_per_s"], r["stats"]["tau"],
                                     r["stats"]["ttft_s"], r["matches_ar"], r["first_mismatch"], r["margin_fp32"]]
                                    for r in rows])
        log: dict = {"bench/summary": summary, "bench/results": results}
        for metric in ("speedup_vs_ar", "speedup_vs_hf", "speedup_vs_llamacpp", "tau", "tokens_per_s"):
            data = [[s.method, getattr(s, metric)] for s in report.overall if getattr(s, metric) is not None]
            if data:
                log[f"bench/chart_{metric}"] = wandb.plot.bar(wandb.Table(columns=["method", metric], data=data),
                                                              "method", metric, title=f"{metric} by method")
        curves = [s for s in report.overall if s.accept_per_position]
        if curves:
            depth = max(len(s.accept_per_position) for s in curves)
            log["bench/chart_accept_per_position"] = wandb.plot.line_series(
                xs=list(range(1, depth + 1)), keys=[s.method for s in curves], title="per-position acceptance",
                xname="position",
                ys=[s.accept_per_position + [0.0] * (depth - len(s.accept_per_position)) for s in curves])
        for path in plots:
            if path.suffix == ".png":
                log[f"bench/plot_{path.stem}"] = wandb.Image(str(path))
        for table, (columns, data) in (tables or {}).items():
            log[f"bench/{table}"] = wandb.Table(columns=columns, data=data)
        run.log(log)
        for s in report.overall:
            for metric in ("tokens_per_s", "speedup_vs_ar", "speedup_vs_hf", "speedup_vs_llamacpp", "tau",
                           "acceptance_rate",
                           "draft_ms_per_step", "ttft_s"):
                if getattr(s, metric) is not None:
                    run.summary[f"{metric}/{_key(s.method)}"] = getattr(s, metric)
        run.summary["mismatches"] = len(report.mismatches)
        return str(Path(run.dir).parent)
    finally:
        run.finish()
