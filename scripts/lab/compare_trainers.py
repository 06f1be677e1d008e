"""Our EAGLE-3 or P-EAGLE recipe against speculators' own trainer of the same kind, side by side, on the default target.

Both trainers get the same conversations, the same hidden states, the same draft vocabulary, the same number of
steps and about the same tokens per step. Each keeps its own model details, loss, optimizer and schedule, as a
user of each would run it. The phases:

1. rows and hidden states: the run's conversations (`configs/<kind>-smollm2-cpu.yaml` and its data settings),
   tokenized and split here, go into speculators' offline layout (its preprocessed dataset, the training rows
   first, then the held-out ones), with the hidden states the target gives (`write_speculators_states`, what vLLM
   would have saved) -> OUT/speculators-data;
2. the same files imported as our data and feature caches (`specheads.train.speculators_states`) -> OUT/imported;
3. ours: `python -m specheads.train` on the imported caches -> OUT/ours/final (each `--ours-variant` with its
   settings changed -> OUT/ours-NAME/final);
4. our draft vocabulary as speculators' d2t/t2d -> OUT/vocab;
5. the peer: `scripts/lab/speculators_train_cpu.py` (speculators' trainer, settings made from the outside so it
   runs on a CPU; named in that script) on the same files, its train/validation boundary at our split's, its
   batches packed to the tokens of our batch of conversations, the drafter's shape ours (layers, aux layers, for
   EAGLE-3 its test-time-training steps, for P-EAGLE its depths, drop-token ratios and mask token), in the precision
   ours trains in here (bf16 autocast on a GPU or a CPU with native bf16, else fp32) -> OUT/peer/<epoch>;
6. one interleaved `specheads bench` run of `ar` and both drafters, each drafting alone (`+lookup=0`) and verifying
   its whole tree (`+node_budget=fixed`: the default budget cuts a tree to what pays on the machine, so τ would
   measure the machine as much as the drafter) -> OUT/bench;
7. `scripts/lab/per_question.py` on that bench: each drafter's τ summed, and question by question against the peer's
   (the mean of its seeds').

With `--seeds 0,1,2` phases 3 and 5 run once per seed, every seed on the same rows (`data.split_seed`); the config's
own seed keeps the plain folder names (OUT/ours, OUT/peer), the others add `-sN` (OUT/ours-s1, OUT/peer-s1, ...).

Each phase is skipped when its output is there, so an interrupted run resumes. OUT/summary.json holds the
settings, each trainer's wall time and tokens per step; OUT/bench/summary.md the table.

    .venv/bin/python scripts/lab/compare_trainers.py --questions mt_bench.jsonl   # 200 steps on 600 conversations
    .venv/bin/python scripts/lab/compare_trainers.py --questions mt_bench.jsonl --steps 400 --conversations 1000 \
        --out runs/trainers-long
    .venv/bin/python scripts/lab/compare_trainers.py --questions mt_bench.jsonl \
        --peer-arg=--lr --peer-arg=0.002                 # the peer at our learning rate
    .venv/bin/python scripts/lab/compare_trainers.py --questions mt_bench.jsonl \
        --ours-variant equal-steps:heads.ttt_decay=1.0   # also ours with one setting changed, benched beside both
    .venv/bin/python scripts/lab/compare_trainers.py --questions mt_bench.jsonl --seeds 0,1,2
                                                        # three of each: the seed spread beside the gap
    .venv/bin/python scripts/lab/compare_trainers.py --kind peagle --questions mt_bench.jsonl --steps 300
                                                        # P-EAGLE: the main job's kind, against speculators' peagle
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("eagle3", "peagle")  # the kinds both trainers train on the same offline hidden states
LAB = ROOT / "scripts" / "lab"  # the peer's trainer and the per-question table are experiments beside this one
PYTHON = sys.executable


def log(message: str) -> None:
    print(f"==> {message}", flush=True)


def run(command: list[str], log_file: Path) -> float:
    """Run a phase's command with its output in `log_file`; its wall time in seconds."""
    log(" ".join(command) + f"   (log: {log_file})")
    start = time.perf_counter()
    with log_file.open("w") as out:
        done = subprocess.run(command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
    if done.returncode:
        sys.exit(f"the command failed (exit {done.returncode}); its output is in {log_file}")
    return time.perf_counter() - start


def write_rows(cfg, out: Path) -> dict:
    """Phase 1: the run's rows and split, in speculators' layout (training rows first) with their hidden states."""
    from specheads.target import load_target
    from specheads.train.data import load_conversations, split_by_conversation, tokenize_dataset
    from specheads.train.speculators_states import write_speculators_states

    target, tokenizer = load_target(cfg.target)
    conversations, _ = load_conversations(cfg.data.source, max_conversations=cfg.data.max_conversations,
                                          skip_conversations=cfg.data.skip_conversations)
    tokenized = tokenize_dataset(conversations, tokenizer, cfg.data.max_length)
    # Split as the import will: pre-tokenized rows are grouped by their prompt tokens, so split those.
    rows = tokenized.select_columns(["input_ids", "loss_mask"])
    train, held_out = split_by_conversation(tokenize_dataset(rows, tokenizer, cfg.data.max_length),
                                            cfg.data.eval_fraction, cfg.split_seed)
    ids = list(train["input_ids"]) + list(held_out["input_ids"])
    mask = list(train["loss_mask"]) + list(held_out["loss_mask"])
    # The split depends on the rows' contents, not their order: the reordered rows must split the same way.
    import datasets

    reordered = datasets.Dataset.from_dict({"input_ids": ids, "loss_mask": mask})
    again, _ = split_by_conversation(tokenize_dataset(reordered, tokenizer, cfg.data.max_length),
                                     cfg.data.eval_fraction, cfg.split_seed)
    if list(again["input_ids"]) != list(train["input_ids"]):
        sys.exit("the reordered rows split differently; the two trainers would not see the same rows")
    write_speculators_states(target, tokenizer, ids, mask, out, target_layer_ids=cfg.heads.aux_layers)
    lengths = [len(r) for r in train["input_ids"]]
    return {"rows": len(ids), "train_rows": len(train), "held_out_rows": len(held_out),
            "train_tokens": sum(lengths), "max_row_tokens": max(lengths)}


def peer_packing(data: Path, train_rows: int, tokens_per_step: float, steps: int, seed: int) -> tuple[int, int, int]:
    """The peer's batch size in tokens whose packed batches hold `tokens_per_step` tokens on average, as ours do (its
    sampler packs whole rows, so a batch of up to L tokens holds fewer), with the epochs it needs for `steps` steps
    and its batches per epoch, all from its own packing sampler."""
    import datasets
    from speculators.train.distributed_batch_sampler import MultipackDistributedBatchSamplerV2

    lengths = datasets.load_from_disk(str(data)).with_format(None)["seq_len"][:train_rows]

    def batches(limit: int) -> int:
        return len(MultipackDistributedBatchSamplerV2(batch_max_length=limit, lengths=lengths, num_replicas=1,
                                                      rank=0, seed=seed))

    limit = max(max(lengths), round(tokens_per_step))
    while sum(lengths) / batches(limit) < tokens_per_step:
        limit += 16
    return limit, math.ceil(steps / batches(limit)), batches(limit)


def draft_vocab_files(config: dict, out: Path) -> tuple[Path, Path]:
    """Phase 4: our drafter's draft vocabulary (its config) as speculators' d2t/t2d .npy files."""
    import numpy as np

    from specheads.heads.draft_vocab import speculators_mappings

    d2t, t2d = speculators_mappings(tuple(config["draft_vocab"]), config["vocab_size"])
    out.mkdir(parents=True, exist_ok=True)
    np.save(out / "d2t.npy", d2t.numpy())
    np.save(out / "t2d.npy", t2d.numpy())
    return out / "d2t.npy", out / "t2d.npy"


def peer_shape(kind: str, cfg, ours_config: dict) -> list[str]:
    """The peer's arguments that give its drafter our drafter's shape, beyond layers, aux layers and vocabulary."""
    if kind == "eagle3":
        return ["--ttt-steps", str(cfg.heads.ttt_steps)]
    # P-EAGLE: the block it drafts per forward, its drop-token sample and the mask token ours resolved (a pad of the
    # target's own; speculators would otherwise pick its own by its tokenizer rules)
    return ["--num-depths", str(cfg.heads.num_depths), "--down-sample-ratio", str(cfg.heads.down_sample_ratio),
            "--down-sample-ratio-min", str(cfg.heads.down_sample_ratio_min),
            "--mask-token-id", str(ours_config["mask_token_id"])]


def peer_checkpoint(save_path: Path) -> Path | None:
    """The peer's last checkpoint folder (its epochs are numbered folders)."""
    epochs = sorted((p for p in save_path.glob("[0-9]*") if (p / "config.json").is_file()), key=lambda p: int(p.name))
    return epochs[-1] if epochs else None


def seeded(name: str, seed: int, config_seed: int) -> str:
    """A drafter's folder name: the config's own seed keeps the plain name, so earlier runs' folders are found."""
    return name if seed == config_seed else f"{name}-s{seed}"


def seed_list(text: str) -> list[int]:
    """`0,1,2` -> [0, 1, 2]."""
    try:
        seeds = [int(item) for item in text.split(",")]
    except ValueError:
        seeds = []
    if not seeds or len(set(seeds)) != len(seeds):
        raise argparse.ArgumentTypeError(f"{text!r}: write distinct integer seeds separated by commas, e.g. 0,1,2")
    return seeds


def variant(text: str) -> tuple[str, list[str]]:
    """`NAME:KEY=VALUE[,KEY=VALUE...]` -> (NAME, overrides)."""
    name, _, overrides = text.partition(":")
    pairs = [item for item in overrides.split(",") if item]
    if not name or not name.replace("-", "").isalnum() or not pairs or not all("=" in item for item in pairs):
        raise argparse.ArgumentTypeError(f"{text!r}: write a variant as NAME:KEY=VALUE[,KEY=VALUE...], "
                                         "e.g. equal-steps:heads.ttt_decay=1.0")
    return name, pairs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kind", choices=KINDS, default="eagle3",
                        help="the drafter both train: configs/<kind>-smollm2-cpu.yaml and speculators' <kind> "
                             "(default eagle3)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps of each trainer (default 200)")
    parser.add_argument("--conversations", type=int, default=600, help="ShareGPT conversations read (default 600)")
    parser.add_argument("--out", type=Path, help="output folder (default runs/trainers-<date>)")
    parser.add_argument("--questions", required=True,
                        help="the bench's questions: a JSONL file (MT-bench's question.jsonl, Spec-Bench) or a named "
                             "set (humaneval, sharegpt-heldout)")
    parser.add_argument("--per-category", type=int, default=3, help="questions of each category (default 3)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="float32", help="the bench's dtype (default float32: exact)")
    parser.add_argument("--peer-arg", action="append", default=[],
                        help="an extra argument for speculators' trainer (repeat it), e.g. --peer-arg=--optimizer "
                             "--peer-arg=adamw")
    parser.add_argument("--ours-variant", action="append", default=[], type=variant, metavar="NAME:KEY=VALUE[,...]",
                        help="also train ours with these config overrides into OUT/ours-NAME and bench it beside the "
                             "others (repeat it), e.g. equal-steps:heads.ttt_decay=1.0")
    parser.add_argument("--seeds", type=seed_list, default=[0], metavar="S[,S...]",
                        help="train ours, each variant and the peer once per seed, all on the same rows, and bench "
                             "them all (default 0: one run each); drafters are a percent or two apart from seed to "
                             "seed, as far apart as the two trainers, so compare several")
    args = parser.parse_args(argv)
    out = (args.out or ROOT / "runs" / f"trainers-{datetime.now():%Y%m%d-%H%M%S}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    config = ROOT / "configs" / f"{args.kind}-smollm2-cpu.yaml"
    summary_path = out / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.is_file() else {}
    summary["settings"] = {"steps": args.steps, "conversations": args.conversations, "config": str(config),
                           "peer_args": args.peer_arg}

    def save() -> None:
        summary_path.write_text(json.dumps(summary, indent=2) + "\n")

    from specheads.target import resolve_target
    from specheads.train.config import load_train_config

    overrides = [f"data.max_conversations={args.conversations}", f"max_steps={args.steps}",
                 f"eval_every={args.steps}", f"save_every={args.steps}"]
    cfg = load_train_config(str(config), overrides)
    data = out / "speculators-data"
    if not (data / "hidden_states").is_dir() or "rows" not in summary:
        log(f"rows and hidden states of {args.conversations} conversations -> {data}")
        summary["rows"] = write_rows(cfg, data)
        save()
    rows = summary["rows"]

    imported = out / "imported"
    if not (imported / "data.jsonl").is_file():
        run([PYTHON, "-m", "specheads.train.speculators_states", str(data), str(config), *overrides,
             "--output", str(imported), "--target-layer-ids", *map(str, cfg.heads.aux_layers)],
            out / "import.log")
    imported_rows = len(json.loads((imported / "features" / "train" / "index.json").read_text())["examples"])
    if imported_rows != rows["train_rows"]:
        sys.exit(f"the import split {imported_rows} training rows where speculators' data has {rows['train_rows']}; "
                 "the two trainers would not see the same rows")

    summary["variants"] = {name: changes for name, changes in args.ours_variant}
    summary["seeds"] = args.seeds
    drafters: dict[str, Path] = {}
    for seed in args.seeds:  # the same rows for every seed: the split stays the config's
        again = [] if seed == cfg.seed else [f"seed={seed}", f"data.split_seed={cfg.split_seed}"]
        for name, changes in [("", []), *args.ours_variant]:
            folder = out / seeded(f"ours-{name}" if name else "ours", seed, cfg.seed)
            if not (folder / "final" / "config.json").is_file():
                summary[f"{folder.name}_wall_s"] = run(
                    [PYTHON, "-m", "specheads.train", str(config), *overrides, *changes, *again,
                     f"output_dir={folder}", f"data.source={imported / 'data.jsonl'}", "features=offline",
                     f"feature_cache_dir={imported / 'features'}"],
                    out / f"{folder.name}.log")
                save()
            drafters[folder.name] = folder / "final"

    from specheads.formats.load import read_heads

    ours_config = read_heads(drafters[seeded("ours", args.seeds[0], cfg.seed)]).config
    d2t, t2d = draft_vocab_files(ours_config, out / "vocab")
    shape = peer_shape(args.kind, cfg, ours_config)
    # The peer packs rows into batches of up to total_seq_len tokens; ours takes batch_size rows. Equal tokens per
    # step on average.
    ours_tokens = cfg.optim.batch_size * rows["train_tokens"] / rows["train_rows"]
    summary["tokens_per_step"] = {"ours": ours_tokens}
    ratio = (rows["train_rows"] + 0.5) / rows["rows"]  # speculators splits at int(rows * ratio): our boundary
    # the peer's autocast dtype: bf16 where ours autocasts bf16, else fp32 as ours computes (a CPU without native bf16
    # emulates bf16 at many times the cost)
    from specheads.train.recipe import mixed_precision

    summary["peer_precision"] = peer_precision = "bfloat16" if mixed_precision(cfg) == "bf16" else "float32"
    peers = []
    for seed in args.seeds:  # its sampler packs by seed, so each seed's batches and epochs are its own
        total_seq_len, epochs, batches = peer_packing(data, rows["train_rows"], ours_tokens, args.steps, seed)
        peer = out / seeded("peer", seed, cfg.seed)
        summary["tokens_per_step"][peer.name] = rows["train_tokens"] / batches
        summary["tokens_per_step"][f"{peer.name}_total_seq_len"] = total_seq_len
        if peer_checkpoint(peer) is None:
            summary[f"{peer.name}_wall_s"] = run(
                [PYTHON, str(LAB / "speculators_train_cpu.py"), "--speculator-type", args.kind,
                 "--verifier-name-or-path", resolve_target(cfg.target), "--data-path", str(data),
                 "--save-path", str(peer), "--log-dir", str(out / f"{peer.name}-logs"),
                 "--num-layers", str(cfg.heads.num_layers), "--draft-arch", "llama",
                 "--target-layer-ids", *map(str, cfg.heads.aux_layers), "--d2t-path", str(d2t), "--t2d-path", str(t2d),
                 "--draft-vocab-size", str(cfg.draft_vocab_size), *shape,
                 "--draft-attn-impl", "sdpa", "--total-seq-len", str(total_seq_len),
                 "--train-data-ratio", f"{ratio:.8f}", "--hidden-states-dtype", peer_precision, "--num-workers", "0",
                 "--on-missing", "raise", "--max-steps", str(args.steps), "--epochs", str(epochs),
                 "--seed", str(seed), "--loss-implementation", "eager",  # its fused losses need Triton (a GPU)
                 *args.peer_arg],
                out / f"{peer.name}.log")
            save()
        drafters[peer.name] = peer_checkpoint(peer)
        peers.append(str(drafters[peer.name]))

    summary["methods"] = {name: f"{args.kind}:{path}+lookup=0+node_budget=fixed" for name, path in drafters.items()}
    if not (out / "bench" / "summary.json").is_file():
        methods = ["ar", *summary["methods"].values()]
        run([str(Path(PYTHON).parent / "specheads"), "bench", "--target", cfg.target, "--dtype", args.dtype,
             "--methods", ",".join(methods), "--questions", args.questions, "--per-category", str(args.per_category),
             "--max-new-tokens", str(args.max_new_tokens), "--no-plots", "--output", str(out / "bench")],
            out / "bench.log")
    save()
    log(f"done: {out / 'bench' / 'summary.md'}, {summary_path}")
    print((out / "bench" / "summary.md").read_text())
    against = [arg for path in peers for arg in ("--against", f"{path}+")]  # each peer's whole path: one method
    subprocess.run([PYTHON, str(LAB / "per_question.py"), str(out / "bench"), *against], check=True)


if __name__ == "__main__":
    main()
