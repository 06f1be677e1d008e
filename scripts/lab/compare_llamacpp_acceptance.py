"""llama.cpp's acceptance of our drafter beside our engine's, with the same drafter and a chain of the same length.

For each draft length N: llama.cpp (`llama-server -md DRAFT.gguf --spec-type draft-eagle3 --spec-draft-n-max N`) and
our engine (`eagle3` heads alone: a chain of N, nothing grafted on) decode the same questions greedily on the same
weights; llama.cpp plain decodes them too. P-EAGLE heads run on both sides as the EAGLE-3 draft they contain
(`as_eagle3`). Printed per N: τ (mean over questions of each one's τ, as the bench), the
totals of accepted tokens and target forwards, and exactness (llama.cpp with its draft against llama.cpp plain, ours
against `ar`, llama.cpp plain against `ar`).

    .venv/bin/python scripts/lab/compare_llamacpp_acceptance.py --heads runs/main-X/peagle/final --draft-max 1,3
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import asdict, fields, replace
from pathlib import Path

import torch

from specheads.config import build
from specheads.formats.export import export
from specheads.formats.load import read_heads
from specheads.heads.checkpoint import Checkpoint, drafter_from_checkpoint, save_drafter
from specheads.heads.eagle3 import Eagle3Config
from specheads.inference import Engine
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers import AutoregressiveProposer
from specheads.llamacpp.server import LlamaServer
from specheads.llamacpp.target_gguf import target_gguf
from specheads.questions import load_questions
from specheads.target import load_target, render_chat, stop_token_ids


def as_eagle3(ckpt: Checkpoint) -> Checkpoint:
    """The EAGLE-3 heads a checkpoint holds: eagle3 heads as they are; P-EAGLE heads without what only their parallel
    positions read (`mask_hidden`, the mask token, the block), as their gguf export writes them for llama.cpp."""
    if ckpt.kind == "eagle3":
        return ckpt
    if ckpt.kind != "peagle":
        raise SystemExit(f"{ckpt.kind} heads hold no EAGLE-3 draft; pass eagle3 or peagle heads")
    config = {f.name: ckpt.config[f.name] for f in fields(Eagle3Config) if f.name in ckpt.config}
    state = {k: v for k, v in ckpt.state.items() if k != "mask_hidden"}
    return replace(ckpt, kind="eagle3", config=asdict(build(Eagle3Config, config)), state=state)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--heads", required=True, help="eagle3 or peagle heads (a run's final/ or a heads folder)")
    p.add_argument("--target", default="default")
    p.add_argument("--questions", default="humaneval")
    p.add_argument("--limit", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--draft-max", default="1,3", help="draft lengths to compare, comma-separated")
    p.add_argument("--precision", default="f32", choices=["f32", "bf16"], help="both sides' weights")
    p.add_argument("--output", type=Path, help="also write the per-question rows here (JSON)")
    args = p.parse_args()

    dtype = "float32" if args.precision == "f32" else "bfloat16"
    target, tokenizer = load_target(args.target, dtype=dtype)
    stops = stop_token_ids(tokenizer, target)
    prompts = [render_chat(tokenizer, q.turns[:1]) for q in load_questions(args.questions, args.limit)]
    model = target_gguf(args.target, args.precision)
    threads = torch.get_num_threads()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = as_eagle3(read_heads(args.heads))
        save_drafter(Path(tmp) / "eagle3", drafter_from_checkpoint(ckpt, target), ckpt.target)
        draft = export(args.heads, "gguf", Path(tmp) / "gguf", target=args.target, precision=args.precision)
        draft_file = draft.folder / draft.files[0]
        ar = Engine(target, AutoregressiveProposer())
        with LlamaServer(model, threads=threads, cache_type=args.precision) as plain:
            reference = {i: (ar.generate(pr, max_new_tokens=args.max_new_tokens, stop_token_ids=stops).output_ids,
                             plain.complete(pr, max_new_tokens=args.max_new_tokens).tokens)
                         for i, pr in enumerate(prompts)}
        for n in (int(x) for x in args.draft_max.split(",")):
            method = METHODS.get("eagle3")
            alone = method.heads_alone(str(Path(tmp) / "eagle3"))  # nothing grafted on, every tree verified
            options = method.make_options({**vars(alone), "depth": n, "topk": 1, "total_tokens": n + 1})
            ours = Engine(target, make_proposer("eagle3", target, options, None))
            with LlamaServer(model, draft=draft_file, spec_type="draft-eagle3", draft_max=n, threads=threads,
                             cache_type=args.precision) as lc:
                for i, prompt in enumerate(prompts):
                    mine = ours.generate(prompt, max_new_tokens=args.max_new_tokens, stop_token_ids=stops)
                    theirs = lc.complete(prompt, max_new_tokens=args.max_new_tokens)
                    ar_ids, plain_ids = reference[i]
                    rows.append({"draft_max": n, "question": i,
                                 "ours": {"tokens": len(mine.output_ids), "steps": mine.stats.steps,
                                          "drafted": mine.stats.drafted,
                                          "accepted": mine.stats.accepted, "tau": mine.stats.tau,
                                          "exact_vs_ar": mine.output_ids == ar_ids},
                                 "llamacpp": {"tokens": len(theirs.tokens), "steps": theirs.steps,
                                              "accepted": theirs.accepted, "drafted": theirs.drafted,
                                              "tau": len(theirs.tokens) / theirs.steps if theirs.steps else 0.0,
                                              "exact_vs_plain": theirs.tokens == plain_ids},
                                 "llamacpp_plain_vs_ar": plain_ids == ar_ids})
    print("| N | τ ours | τ llama.cpp | accepted/drafted/forwards ours | accepted/drafted/forwards llama.cpp | "
          "exact: ours vs ar | exact: llama.cpp drafted vs plain | llama.cpp plain == ar |")
    print("|---|---|---|---|---|---|---|---|")
    for n in dict.fromkeys(r["draft_max"] for r in rows):
        rs = [r for r in rows if r["draft_max"] == n]

        def total(side: str, key: str, rs: list[dict] = rs) -> int:
            return sum(r[side][key] for r in rs)

        print(f"| {n} | {statistics.mean(r['ours']['tau'] for r in rs):.3f} | "
              f"{statistics.mean(r['llamacpp']['tau'] for r in rs):.3f} | "
              f"{total('ours', 'accepted')}/{total('ours', 'drafted')}/{total('ours', 'steps')} | "
              f"{total('llamacpp', 'accepted')}/{total('llamacpp', 'drafted')}/{total('llamacpp', 'steps')} | "
              f"{sum(r['ours']['exact_vs_ar'] for r in rs)}/{len(rs)} | "
              f"{sum(r['llamacpp']['exact_vs_plain'] for r in rs)}/{len(rs)} | "
              f"{sum(r['llamacpp_plain_vs_ar'] for r in rs)}/{len(rs)} |")
    if args.output is not None:
        args.output.write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
