"""The model card (README.md) of an exported drafter: what it is, how it was trained, how well it drafts, and
the exact commands that run it here, in vLLM and in SGLang."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import yaml

from specheads.formats.base import EXPORTERS, ExportContext
from specheads.heads.checkpoint import Checkpoint

_FIGURES = ("eval/measured_tau", "eval/measured_acceptance_rate", "eval/measured_chain_tau",
            "eval/measured_chain_first_accept", "eval/simulated_tau_chain", "eval/top1_step1", "eval/top1_head1")


def _run_evals(run: Path | None) -> dict[str, Any]:
    """The run's evaluation rows merged, later rows winning: the last evaluation and the measured τ after it."""
    metrics = None if run is None else run / "metrics.jsonl"
    if metrics is None or not metrics.is_file():
        return {}
    merged: dict[str, Any] = {}
    for line in metrics.read_text().splitlines():
        row = json.loads(line) if line.strip() else {}
        merged |= {k: v for k, v in row.items() if k.startswith("eval/")}
    return merged


def _run_facts(run: Path | None) -> dict[str, Any]:
    if run is None or not (run / "config.yaml").is_file():
        return {}
    cfg = yaml.safe_load((run / "config.yaml").read_text()) or {}
    facts = {"recipe": cfg.get("recipe"), "data": (cfg.get("data") or {}).get("source"),
             "conversations": (cfg.get("data") or {}).get("max_conversations"), "steps": cfg.get("max_steps"),
             "seed": cfg.get("seed")}
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
        losses = [r for r in rows if "loss" in r]
        if losses:
            facts["final loss"] = round(losses[-1]["loss"], 4)
    return {k: v for k, v in facts.items() if v is not None}


def model_card(ckpt: Checkpoint, ctx: ExportContext, run: Path | None) -> str:
    kind = ckpt.kind
    evals = {**(ckpt.metadata.get("eval") or {}), **_run_evals(run)}
    lines = [f"# {kind} drafter for {ctx.verifier}", "",
             f"Speculative-decoding heads of kind `{kind}` trained with specheads for the frozen target "
             f"`{ckpt.target.name}` ({ckpt.target.describe()}). Drafts are verified by the target, so output is "
             "the target's own: greedy decoding token for token, sampling in distribution.", ""]
    facts = _run_facts(run)
    if facts:
        lines += ["## Training", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in facts.items()], ""]
    figures = [(k, evals[k]) for k in _FIGURES if k in evals]
    if figures:
        lines += ["## Measured at the end of training", "", "| metric | value |", "|---|---|",
                  *[f"| {k.removeprefix('eval/')} | {v:.3f} |" for k, v in figures], "",
                  "τ counts the tokens each target forward commits (accepted draft tokens plus the bonus token).", ""]
    lines += ["## Run it", "", "specheads (this folder, or the Hub repo it was pushed to):", "", "```bash",
              f"specheads generate --method {kind} --heads THIS_FOLDER_OR_REPO --target {ckpt.target.name} "
              "--prompt \"...\" --max-new-tokens 128", "```", ""]
    formats = [e for _, e in EXPORTERS.items() if e.kind == kind]
    for exporter in formats:
        lines += [f"{exporter.loader}: export with `specheads export RUN --to {exporter.format} --output DIR`, then",
                  "", "```bash", exporter.serve.format(verifier=ctx.verifier), "```", ""]
    return "\n".join(lines)
