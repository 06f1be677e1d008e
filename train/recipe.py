"""The training recipe: set up -> train -> save, written against Accelerate only.

    accelerate launch -m specheads.train configs/eagle-smollm2-cpu.yaml [key=value ...]

Works the same on one CPU process, `torchrun`/`accelerate launch` with several
processes (DDP, or DeepSpeed ZeRO-2 through the accelerate config: docs/scale-out.md),
and one or many GPUs. The run directory holds the resolved config, `metrics.jsonl`,
`checkpoints/step_N/` (Accelerate state + trainer state) and `final/` (the heads).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml
from accelerate import Accelerator
from accelerate.utils import DataLoaderConfiguration, broadcast, set_seed
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from specheads.formats.load import read_heads
from specheads.gemm_layout import cpu_has_native_bf16
from specheads.inference.bench.runner import MethodSummary, drafts_trees, measure_drafter
from specheads.target import load_target, stop_token_ids
from specheads.token_classes import token_classes
from specheads.train.budget import TrainingClock, budget_schedule
from specheads.train.class_top1 import TOKEN_HITS, class_row, class_sums
from specheads.train.config import TrainConfig, train_config_dict
from specheads.train.data import (
    collate,
    load_conversations,
    pad_token_id,
    split_by_conversation,
    tokenize_dataset,
)
from specheads.train.feature_cache import FeatureCache, collate_with_features, join_feature_cache, write_feature_cache
from specheads.train.launch_check import check_launch
from specheads.train.objective import OBJECTIVES, Objective
from specheads.train.onpolicy import OnPolicy
from specheads.train.optimizer import build_optimizer
from specheads.train.regenerated_data import with_regenerated
from specheads.train.sharding import keep_models_whole, whole_parameters
from specheads.train.target_sharding import check_shardable, shard_target

log = logging.getLogger(__name__)

STATE_FILE = "trainer_state.json"
DRAFT_VOCAB_FILE = "draft_vocab.json"  # the run's draft vocabulary, written at its start


def mixed_precision(cfg: TrainConfig) -> str:
    """The autocast precision a run of `cfg` trains in on this machine (Accelerate's name: "bf16", "fp16", "no")."""
    if cfg.mixed_precision != "auto":
        return cfg.mixed_precision
    if torch.cuda.is_available():
        return "bf16" if torch.cuda.is_bf16_supported() else "no"
    return "bf16" if cpu_has_native_bf16() else "no"


def _offline_collates(cfg: TrainConfig, objective: Objective, accelerator: Accelerator, target, train_ds, eval_ds,
                      pad: int):
    """Build the feature caches (every process its share of the conversations, in parallel) and open them;
    collates that read from them."""
    root = Path(cfg.feature_cache_dir or Path(cfg.output_dir) / "features")
    layers = objective.feature_layers(cfg.heads, target.config.get_text_config().num_hidden_layers)
    part = (accelerator.process_index, accelerator.num_processes)
    for name, ds in (("train", train_ds), ("eval", eval_ds)):
        with accelerator.autocast():
            write_feature_cache(target, ds["input_ids"], root / name, target_name=cfg.target,
                                dtype=cfg.feature_dtype, aux_layers=layers, part=part, lockstep=cfg.shard_target)
        accelerator.wait_for_everyone()  # every part written before the index joins them
        if accelerator.is_main_process:
            join_feature_cache(root / name, accelerator.num_processes)
        accelerator.wait_for_everyone()
    train_cache, eval_cache = FeatureCache(root / "train"), FeatureCache(root / "eval")
    return ((lambda ex: collate_with_features(ex, pad, train_cache)),
            (lambda ex: collate_with_features(ex, pad, eval_cache)))


def latest_checkpoint(out: Path) -> Path | None:
    ckpts = sorted((out / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    complete = [p for p in ckpts if (p / STATE_FILE).is_file()]  # the state file is written last
    return complete[-1] if complete else None


def _check_resume_config(out: Path, cfg: TrainConfig) -> None:
    saved_path = out / "config.yaml"
    if not saved_path.is_file():
        return
    saved = yaml.safe_load(saved_path.read_text())
    now = train_config_dict(cfg)
    for section in ("recipe", "target", OBJECTIVES.get(cfg.recipe).section, "draft_vocab_size"):
        if saved.get(section) != now.get(section):
            raise ValueError(f"resume=true but '{section}' differs from the run in {out} "
                             f"({saved.get(section)!r} -> {now.get(section)!r}); resume with the original model "
                             "config or start a new output_dir")
    was = (saved.get("optim") or {}).get("optimizer", "adamw")  # runs from before the setting used AdamW
    if was != cfg.optim.optimizer:
        raise ValueError(f"resume=true but optim.optimizer differs from the run in {out} ({was!r} -> "
                         f"{cfg.optim.optimizer!r}), whose checkpoints hold {was}'s state; resume with "
                         f"optim.optimizer={was} or start a new output_dir")


def _keep_metrics_through(path: Path, step: int) -> None:
    """Drop the rows a stopped run logged past the checkpoint it resumes from: those steps run again, and each step
    keeps one row (a line cut by the stop goes too)."""
    if not path.is_file():
        return
    kept = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if row.get("step", 0) <= step:
            kept.append(line + "\n")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(kept), encoding="utf-8")
    os.replace(tmp, path)


def draft_vocabulary(train_ds, size: int | None, vocab: int) -> list[int] | None:
    """The `size` most frequent assistant tokens in the training data (ties by id), for a cheaper draft LM head."""
    if size is None or size >= vocab:
        return None
    counts: Counter[int] = Counter()
    for ids, mask in zip(train_ds["input_ids"], train_ds["loss_mask"]):
        counts.update(t for t, m in zip(ids, mask) if m)
    ranked = sorted(counts, key=lambda t: (-counts[t], t))[:size]
    if len(ranked) < size:  # pad with the lowest ids not seen, so the size is what was asked for
        seen = set(ranked)
        ranked += [t for t in range(vocab) if t not in seen][: size - len(ranked)]
    return sorted(ranked)


def run_draft_vocabulary(cfg: TrainConfig, out: Path, train_ds, vocab_size: int, resuming: bool) -> list[int] | None:
    """The run's draft vocabulary, fixed at its start and never silently recomputed.

    A resumed run reads the one its start wrote to DRAFT_VOCAB_FILE; a fine-tune (`init_heads`) keeps its
    starting heads' (their LM head rows, for EAGLE-3, are tied to it); otherwise it is the `draft_vocab_size`
    most frequent assistant tokens of the training data."""
    saved = out / DRAFT_VOCAB_FILE
    if resuming and saved.is_file():
        return json.loads(saved.read_text())["draft_vocab"]
    if cfg.init_heads:
        ids = read_heads(cfg.init_heads).config.get("draft_vocab")
        if ids is not None or cfg.draft_vocab_size is None:
            log.info("draft vocabulary: %s ids from init_heads=%s", "all" if ids is None else len(ids), cfg.init_heads)
            return ids
    return draft_vocabulary(train_ds, cfg.draft_vocab_size, vocab_size)


def init_from_heads(head: torch.nn.Module, path: str, kind: str, target: torch.nn.Module, target_name: str) -> None:
    """Load saved heads' weights into a freshly built head of the same shape (built with their draft vocabulary,
    see `run_draft_vocabulary`)."""
    ckpt = read_heads(path)
    if ckpt.kind != kind:
        raise ValueError(f"init_heads={path} holds {ckpt.kind} heads; this recipe can only start from {kind} heads")
    ckpt.target.check_compatible(target, target_name, checkpoint=path)
    state = ckpt.state
    trainable = {n for n, p in head.named_parameters() if p.requires_grad}
    try:
        missing, unexpected = head.load_state_dict(state, strict=False)
    except RuntimeError as err:  # a shape mismatch
        raise ValueError(f"init_heads={path} does not fit the heads this config builds "
                         f"({str(err).splitlines()[-1].strip()}); use the heads settings it was trained with") from err
    if unexpected or trainable & set(missing):
        raise ValueError(f"init_heads={path} does not fit the heads this config builds (missing "
                         f"{sorted(trainable & set(missing))[:3]}, unexpected {sorted(unexpected)[:3]}); "
                         "use the heads settings it was trained with")
    log.info("initialised the %s heads from %s", kind, path)


def train(cfg: TrainConfig) -> Path:
    """Train heads per `cfg`; returns the folder of the final heads."""
    run = TrainingRun(cfg)
    run.fit()
    return run.finish()


@dataclass
class Progress:
    """Where a run stands: what a checkpoint saves and a resume restores."""

    step: int = 0  # optimizer steps done
    epoch: int = 0
    batches_done: int = 0  # batches of this epoch consumed (grad_accum batches make one step)


class TrainingRun:
    """One run of a recipe, in phases (as torchtune's recipes are): building it sets everything up (`_start`: the
    accelerator and the run folder; `_load_data`; `_build_drafter`: heads, optimizer, schedule; `_resume`), then
    `fit` runs the optimizer steps, logging, evaluating and saving checkpoints as configured, and `finish` saves the
    final heads and measures their τ. Every process builds one and runs the same phases."""

    def __init__(self, cfg: TrainConfig) -> None:
        self.cfg = cfg
        self.objective = OBJECTIVES.get(cfg.recipe)
        self.out = Path(cfg.output_dir)
        self.progress = Progress()
        self._start()
        self._load_data()
        self._build_drafter()
        self._resume()
        self._last_eval_extra: list = []  # [extra] once an evaluation ran in this process

    # --- set-up ------------------------------------------------------------------------------------------------

    def _start(self) -> None:
        """The accelerator, the run folder with its config, the target (sharded where asked)."""
        cfg = self.cfg
        self.accelerator = accelerator = Accelerator(
            gradient_accumulation_steps=cfg.optim.grad_accum,
            mixed_precision=mixed_precision(cfg),
            log_with="wandb" if cfg.report_to == "wandb" else None,
            project_dir=cfg.output_dir,
            dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True),
            # The LR schedule counts optimizer steps whatever the process count (accelerate would otherwise step it
            # once per process and step), so it runs as configured and a checkpoint resumes under another process
            # count.
            step_scheduler_with_optimizer=False,
        )
        check_launch(accelerator, cfg, self.objective)
        keep_models_whole(accelerator)
        set_seed(cfg.seed)
        self.resume_from = latest_checkpoint(self.out) if cfg.resume else None
        if cfg.resume:
            _check_resume_config(self.out, cfg)
        if accelerator.is_main_process:
            self.out.mkdir(parents=True, exist_ok=True)
            (self.out / "config.yaml").write_text(yaml.safe_dump(train_config_dict(cfg), sort_keys=False),
                                                  encoding="utf-8")
        accelerator.wait_for_everyone()

        if cfg.shard_target:  # before the target loads: a one-process launch is refused at once
            check_shardable(accelerator.num_processes)
        self.target, self.tokenizer = load_target(
            cfg.target, device=str(accelerator.device) if accelerator.device.type != "cpu" else "cpu")
        self.shards = shard_target(self.target, accelerator) if cfg.shard_target else None
        if self.shards is not None:
            log.info("target sharded over %d processes: this one holds %d of its %d decoder weights (and %d whole)",
                     accelerator.num_processes, self.shards.held, self.shards.total, self.shards.whole)
        self.vocab_size = self.target.get_output_embeddings().weight.shape[0]

    def _load_data(self) -> None:
        """Conversations, tokenized and split by conversation; the loaders (with cached features when offline)."""
        cfg, accelerator = self.cfg, self.accelerator
        with accelerator.main_process_first():
            conversations, report = load_conversations(cfg.data.source, max_conversations=cfg.data.max_conversations,
                                                      skip_conversations=cfg.data.skip_conversations)
            self.regenerated = None
            if cfg.regenerate.enabled:  # the main process answers (or finds the cache); the others read its cache
                self.regenerated = with_regenerated(
                    conversations, cfg.regenerate, target=cfg.target, source=cfg.data.source,
                    slice_={"skip": cfg.data.skip_conversations, "max": cfg.data.max_conversations},
                    model=self.target, tokenizer=self.tokenizer, max_length=cfg.data.max_length)
                conversations = self.regenerated.conversations
            tokenized = tokenize_dataset(conversations, self.tokenizer, cfg.data.max_length)
        train_ds, eval_ds = split_by_conversation(tokenized, cfg.data.eval_fraction, cfg.split_seed)
        eval_ds = eval_ds.select(range(min(len(eval_ds), cfg.data.max_eval_conversations)))
        log.info("data: %s; %d train / %d eval conversations", report, len(train_ds), len(eval_ds))
        pad = pad_token_id(self.tokenizer)
        train_collate, eval_collate = (lambda ex: collate(ex, pad)), (lambda ex: collate(ex, pad))
        if cfg.features == "offline":
            train_collate, eval_collate = _offline_collates(cfg, self.objective, accelerator, self.target, train_ds,
                                                            eval_ds, pad)
        self.pad = pad
        self.onpolicy = None
        if cfg.onpolicy.enabled:
            self.onpolicy = OnPolicy(cfg.onpolicy, train_ds["input_ids"], train_ds["loss_mask"],
                                     max_length=cfg.data.max_length, seed=cfg.seed,
                                     process=accelerator.process_index, processes=accelerator.num_processes)
        columns = ["input_ids", "loss_mask", "row"]
        self.train_ds = train_ds.add_column("row", list(range(len(train_ds))))
        self.eval_ds = eval_ds.add_column("row", list(range(len(eval_ds))))
        self.loader = DataLoader(self.train_ds.select_columns(columns), batch_size=cfg.optim.batch_size, shuffle=True,
                                 collate_fn=train_collate, generator=torch.Generator().manual_seed(cfg.seed))
        self.eval_loader = DataLoader(self.eval_ds.select_columns(columns), batch_size=cfg.optim.batch_size,
                                      collate_fn=eval_collate)

    def _build_drafter(self) -> None:
        """The draft vocabulary, the heads (initialised from saved ones where asked), optimizer and schedule, all
        prepared by the accelerator."""
        cfg, accelerator, out = self.cfg, self.accelerator, self.out
        draft_vocab = run_draft_vocabulary(cfg, out, self.train_ds, self.vocab_size,
                                           resuming=self.resume_from is not None)
        if accelerator.is_main_process:
            (out / DRAFT_VOCAB_FILE).write_text(json.dumps({"draft_vocab": draft_vocab}) + "\n")
        self.feature_layers = self.objective.feature_layers(cfg.heads,
                                                            self.target.config.get_text_config().num_hidden_layers)
        head = self.objective.build(cfg.heads, self.target, draft_vocab)
        if cfg.init_heads and self.resume_from is None:
            init_from_heads(head, cfg.init_heads, self.objective.kind, self.target, cfg.target)
        optimizer = build_optimizer(head, self.objective.param_groups(head, cfg.optim.lr, cfg.heads), cfg.optim,
                                    vocab_sizes=(self.vocab_size, *([len(draft_vocab)] if draft_vocab else [])))
        self.clock = TrainingClock(cfg.max_minutes, sync=_main_process_reading(accelerator))
        scheduler = budget_schedule(optimizer, warmup_steps=cfg.optim.warmup_steps, max_steps=cfg.max_steps,
                                    shape=cfg.optim.schedule, clock=self.clock)
        self.head, self.optimizer, self.loader, self.eval_loader, self.scheduler = accelerator.prepare(
            head, optimizer, self.loader, self.eval_loader, scheduler)
        # for top-1 by token class in evaluations
        self.classes = token_classes(self.tokenizer, self.vocab_size, stop_token_ids(self.tokenizer, self.target))

    def _resume(self) -> None:
        """Restore the last checkpoint's state (resuming), start the trackers and open the metrics file."""
        cfg, accelerator, out = self.cfg, self.accelerator, self.out
        if self.resume_from is not None:
            accelerator.load_state(str(self.resume_from))
            state = json.loads((self.resume_from / STATE_FILE).read_text())
            self.progress = Progress(state["step"], state["epoch"], state["batches_done"])
            # the minutes its checkpoint had used (none recorded: a checkpoint from before the clock kept them)
            self.clock.resume(**state.get("clock", {}))
            if self.onpolicy is not None:
                self.onpolicy.load(self.resume_from)
            log.info("resumed from %s at step %d", self.resume_from, self.progress.step)
        if cfg.report_to == "wandb":
            accelerator.init_trackers("specheads", config=train_config_dict(cfg),
                                      init_kwargs={"wandb": {"name": out.name, "dir": str(out)}})
        if accelerator.is_main_process and self.resume_from is not None:
            _keep_metrics_through(out / "metrics.jsonl", self.progress.step)
        self.metrics_file = (out / "metrics.jsonl").open("a", encoding="utf-8") if accelerator.is_main_process else None
        if self.regenerated is not None and self.progress.step == 0:  # what the answers cost, where they are
            done = self.regenerated.report
            self.emit({"step": 0, "regenerate/answered": done.answered, "regenerate/cached": done.resumed,
                       "regenerate/kept": done.kept, "regenerate/seconds": done.seconds,
                       "regenerate/tokens_per_s": done.tokens / done.seconds if done.seconds else 0.0,
                       "regenerate/conversations": len(self.regenerated.conversations),
                       "regenerate/folder": str(self.regenerated.folder)})
        if self.shards is not None and self.progress.step == 0:  # what each process holds, for the record
            held = accelerator.gather(torch.tensor([self.shards.held], device=accelerator.device)).tolist()
            self.emit({"step": 0, "target_decoder_weights": self.shards.total, "target_decoder_weights_held": held,
                       "target_weights_whole_per_process": self.shards.whole})

    # --- what the phases share ---------------------------------------------------------------------------------

    def emit(self, row: dict) -> None:
        """One row of metrics: to metrics.jsonl (main process) and the trackers."""
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(row) + "\n")
            self.metrics_file.flush()
        self.accelerator.log({k: v for k, v in row.items() if isinstance(v, (int, float))}, step=row["step"])

    def evaluate(self) -> dict:
        """The objective's evaluation over the eval split, summed over every process, with top-1 by token class."""
        accelerator, head = self.accelerator, self.head
        head.eval()
        sums: dict[str, torch.Tensor] = {}
        model = accelerator.unwrap_model(head)
        for batch in self.eval_loader:
            with accelerator.autocast():
                batch_sums = self.objective.eval_sums(model, self.target, batch)
            if TOKEN_HITS in batch_sums:  # counted by class here, where the tokenizer is
                batch_sums = dict(batch_sums)
                batch_sums |= class_sums(batch_sums.pop(TOKEN_HITS), self.classes)
            for k, v in batch_sums.items():
                sums[k] = sums.get(k, 0) + v.to(accelerator.device)
        head.train()
        sums = {k: accelerator.reduce(v, reduction="sum").cpu() for k, v in sums.items()}
        row, extra = self.objective.eval_row(sums)
        self._last_eval_extra[:] = [extra]
        return row | class_row(sums)

    def roll_out(self) -> dict[str, float]:
        """The on-policy phase's rollout (`onpolicy.py`): the drafter as it stands, saved where this process decodes
        from it (as a user's decoding loads it), decodes the next training prompts; their rows join the replay."""
        accelerator = self.accelerator
        folder = self.out / "onpolicy" / f"heads-{accelerator.process_index}"
        model = accelerator.unwrap_model(self.head)
        with whole_parameters(accelerator, self.head):  # under ZeRO-3 each process holds a part: gathered to save
            self.objective.save(model, folder, target=self.target, tokenizer=self.tokenizer,
                                target_name=self.cfg.target, config=self.objective.final_config(model, None),
                                metadata={})
        figures = self.onpolicy.roll_out(self.target, self.cfg.target, self.objective.kind, folder,
                                         stop_token_ids(self.tokenizer, self.target))
        # every process's rollout figures, averaged (each decoded its own prompts)
        mean = accelerator.reduce(torch.tensor(list(figures.values()), device=accelerator.device), reduction="mean")
        return dict(zip(figures, mean.tolist()))

    def save_checkpoint(self) -> None:
        progress = self.progress
        ckpt = self.out / "checkpoints" / f"step_{progress.step}"
        self.accelerator.save_state(str(ckpt))
        if self.onpolicy is not None:  # every process its own rows
            self.onpolicy.save(ckpt)
        self.accelerator.wait_for_everyone()
        if self.accelerator.is_main_process:  # written last: a checkpoint without it is incomplete and ignored
            (ckpt / STATE_FILE).write_text(json.dumps({"step": progress.step, "epoch": progress.epoch,
                                                       "batches_done": progress.batches_done,
                                                       "clock": self.clock.state()}))
        self.accelerator.wait_for_everyone()

    # --- training ----------------------------------------------------------------------------------------------

    def fit(self) -> None:
        """Optimizer steps up to `max_steps` (or `max_minutes`), logging every `log_every`, evaluating every
        `eval_every` and saving every `save_every` steps, and all three at the last step."""
        cfg, accelerator, progress, clock = self.cfg, self.accelerator, self.progress, self.clock
        head, optimizer, scheduler = self.head, self.optimizer, self.scheduler
        head.train()
        bar = tqdm(total=cfg.max_steps, initial=progress.step, desc="train",
                   disable=not accelerator.is_local_main_process)
        tokens_seen, window_start = 0, time.perf_counter()
        model = accelerator.unwrap_model(head)  # what a run_progress hook sets its share on
        clock.start()
        last = progress.step >= cfg.max_steps or clock.spent  # a run resumed at its end trains no more
        while not last:
            self.loader.set_epoch(progress.epoch)
            batches = (accelerator.skip_first_batches(self.loader, progress.batches_done) if progress.batches_done
                       else self.loader)
            for batch in batches:
                with accelerator.accumulate(head), accelerator.autocast():  # the target's features too
                    replayed = None
                    if self.onpolicy is not None:  # rollout rows join the batch
                        batch, replayed = self.onpolicy.replay(batch, progress.step + 1, self.pad, self.target,
                                                               self.feature_layers)
                    if self.objective.run_progress is not None:
                        self.objective.run_progress(model, clock.run_progress(progress.step, cfg.max_steps))
                    loss, stats = self.objective.step_loss(head, self.target, batch, cfg.heads)
                    if replayed is not None:  # on every process alike (their statistics are reduced together)
                        stats["replay_rows"] = float(replayed)
                    accelerator.backward(loss)
                    if accelerator.sync_gradients:
                        accelerator.clip_grad_norm_(head.parameters(), cfg.optim.max_grad_norm)
                    optimizer.step()
                    if accelerator.sync_gradients:
                        clock.tick()  # before the schedule reads it
                        scheduler.step()
                    optimizer.zero_grad()
                progress.batches_done += 1
                tokens_seen += int(batch["attention_mask"].sum())
                if not accelerator.sync_gradients:
                    continue
                progress.step += 1
                step = progress.step
                bar.update(1)
                last = step >= cfg.max_steps or clock.spent
                if step % cfg.log_every == 0 or last:
                    # The step's loss and statistics over every process's share of the batch (each process's mean,
                    # averaged), not the first process's alone; every process reaches this line at the same step.
                    local = torch.tensor([float(loss.detach()), *stats.values()], device=accelerator.device)
                    mean = accelerator.reduce(local, reduction="mean").tolist()
                    row = {"step": step, **dict(zip(["loss", *stats], mean)), "lr": scheduler.get_last_lr()[0]}
                    elapsed = time.perf_counter() - window_start
                    self.emit({**row, "tokens_per_s": tokens_seen * accelerator.num_processes / max(elapsed, 1e-9),
                               "epoch": progress.epoch})
                    minutes = {} if cfg.max_minutes is None else {"min": f"{clock.used:.1f}/{cfg.max_minutes:g}"}
                    bar.set_postfix(loss=f"{row['loss']:.3f}", top1=f"{row['top1']:.2f}", **minutes)
                    tokens_seen, window_start = 0, time.perf_counter()
                if self.onpolicy is not None and self.onpolicy.due(step) and not last:
                    self.emit({"step": step, **self.roll_out()})
                if step % cfg.eval_every == 0 or last:
                    self.emit({"step": step, **self.evaluate()})
                if step % cfg.save_every == 0 or last:
                    self.save_checkpoint()
                if last:
                    if step < cfg.max_steps:
                        log.info("stopped at step %d of %d: max_minutes=%s reached", step, cfg.max_steps,
                                 cfg.max_minutes)
                    break
            else:
                progress.epoch += 1
                progress.batches_done = 0
        bar.close()

    def finish(self) -> Path:
        """Save the final heads (evaluated), measure their τ from the saved folder as a user loads it, close."""
        cfg, accelerator, out, objective = self.cfg, self.accelerator, self.out, self.objective
        step = self.progress.step
        final = out / "final"
        if not self._last_eval_extra:  # resumed at max_steps: the heads still need their measured accuracies
            self.emit({"step": step, **self.evaluate()})
        with whole_parameters(accelerator, self.head):  # under ZeRO-3 each process holds a part: gathered to save
            if accelerator.is_main_process:
                model = accelerator.unwrap_model(self.head)
                objective.save(model, final, target=self.target, tokenizer=self.tokenizer, target_name=cfg.target,
                               config=objective.final_config(model, self._last_eval_extra[0]),
                               metadata={"eval": _last_eval(out)})
                log.info("saved the %s recipe's drafter to %s", objective.name, final)
        if accelerator.is_main_process and cfg.measure_prompts:  # from final/, as a user loads it
            self.emit({"step": step, **measured_tau(cfg, objective, self.target, self.tokenizer, self.eval_ds,
                                                    final)})
        accelerator.wait_for_everyone()
        accelerator.end_training()
        if self.metrics_file is not None:
            self.metrics_file.close()
        return final


def _main_process_reading(accelerator: Accelerator):
    """The main process's clock reading on every process (a broadcast), so all take the same LR and stop together."""
    if accelerator.num_processes == 1:
        return lambda minutes: minutes

    def sync(minutes: float) -> float:
        reading = torch.tensor([minutes], dtype=torch.float64, device=accelerator.device)
        return float(broadcast(reading, from_process=0).item())

    return sync


def held_out_prompts(eval_ds, n: int) -> list[list[int]]:
    """The first `n` eval conversations up to their first assistant token: rendered prompts the heads never saw."""
    prompts = []
    for ids, mask in zip(eval_ds["input_ids"], eval_ds["loss_mask"]):
        first = next((i for i, m in enumerate(mask) if m), 0)
        if first > 0:
            prompts.append(list(ids[:first]))
        if len(prompts) == n:
            break
    return prompts


def measured_tau(cfg: TrainConfig, objective: Objective, target, tokenizer, eval_ds,
                 heads_dir: Path) -> dict[str, float]:
    """τ of the saved drafter decoding held-out prompts, through the same loader and runner as `specheads bench`."""
    def load_draft(path: str):  # a standalone draft model (distill), in the target's dtype and place
        return load_target(path, device=str(target.device), dtype=target.dtype)[0]

    prompts = held_out_prompts(eval_ds, cfg.measure_prompts)
    if not prompts:
        return {}

    def measured(tree: str | None):
        return measure_drafter(target, objective.kind, str(heads_dir), prompts,
                               max_new_tokens=cfg.measure_max_new_tokens,
                               stop_token_ids=stop_token_ids(tokenizer, target), load_draft=load_draft, tree=tree)

    summary = measured(None)
    row = {"eval/measured_tau": summary.tau, "eval/measured_acceptance_rate": summary.acceptance_rate or 0.0,
           "eval/measured_prompts": len(prompts)}
    if cfg.measure_chain and drafts_trees(objective.kind):
        # a tree hides a weak first guess behind its siblings; a chain engine's speed is this guess
        chain = measured(f"chain{cfg.measure_chain}")
        row |= {"eval/measured_chain_tau": chain.tau, "eval/measured_chain_first_accept": _first(chain)}
    return row


def _first(summary: MethodSummary) -> float:
    """The share of steps whose first draft token was accepted."""
    return summary.accept_per_position[0] if summary.accept_per_position else 0.0


def _last_eval(out: Path) -> dict:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    return evals[-1] if evals else {}

