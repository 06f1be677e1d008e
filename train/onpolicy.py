"""Training on the drafter's own mistakes: an on-policy phase of the heads recipes (Draft-OPD's replay from rejected
positions, arXiv 2605.29343).

Offline data teaches the drafter the target's next token after text someone else wrote; at decode time it drafts
after the target's own text, and τ is lost where it fails there. With `onpolicy.every: N`, the recipe:

1. every N optimizer steps, saves the drafter as it stands and decodes `onpolicy.prompts` training prompts with it in
   the engine (`rows` at a time, drafting chains; exact: greedy rollouts are the target's own greedy text),
   recording each step's draft outcome (`specheads.inference.engine.rollout`), in the precision `onpolicy.dtype`
   names (`auto`: bf16 on a CPU with native bf16, the precision the main job decodes in there, from a bf16 copy of
   the target loaded once; else the target's own: bf16 already on a GPU, fp32 on other CPUs). A bf16 rollout is the
   bf16 target's greedy text, which may part from fp32's at near-ties: it is training data, and its features are
   still the training target's own;
2. keeps each rollout (prompt and output) as a training row whose loss mask covers, with `train_on: rejected`, each
   failing step's tokens from its root through the first rejected position (the block the drafter drafted there, as
   far as acceptance reached: the root is the anchor P-EAGLE's and EAGLE's entries are counted by, the drafted
   positions the tokens DFlash's slots are counted by), or with `train_on: all` every decoded token; the newest
   `buffer_rows` rows are kept;
3. from then on adds `replay_rows` of them, drawn at random, to every step's batch: one forward over both, the replayed
   rows' features computed by the target in the step (a cached batch's own features are read as before).

Every process decodes its own share of the prompts and keeps its own rows, as it reads its own share of the data;
rollouts happen at the same steps everywhere. The buffer and where the prompts stand are saved with each checkpoint
(`onpolicy-<process>.json`), so a resumed run replays what the stopped one would have.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from specheads.checked import Checked
from specheads.machine import cpu_has_native_bf16
from specheads.train.data import collate
from specheads.train.features import target_features

if TYPE_CHECKING:
    from specheads.inference.bench.runner import Rollout

log = logging.getLogger(__name__)

TRAIN_ON = ("rejected", "all")
DTYPES = ("auto", "target", "bfloat16")


@dataclass(frozen=True)
class OnPolicyConfig(Checked):
    """The `onpolicy:` section: rollouts with the drafter being trained, replayed into every later step."""

    every: int = 0  # optimizer steps between rollouts (0: no on-policy phase)
    prompts: int = 16  # training prompts each process decodes per rollout
    rows: int = 8  # prompts decoded together (the engine's batch)
    max_new_tokens: int = 96  # tokens decoded per prompt
    temperature: float = 0.0  # the rollouts' sampling temperature (0: greedy, the target's own greedy text)
    train_on: str = "rejected"  # "rejected": each failing step's block through its first rejection; "all": every token
    replay_rows: int = 2  # rollout rows added to each step's batch (per process) once there are any
    buffer_rows: int = 64  # newest rollout rows kept for replay (per process)
    dtype: str = "auto"  # rollout precision: auto (bf16 on CPUs with native bf16, else the target's), target, bfloat16

    def _check(self) -> None:
        if self.every < 0:
            raise ValueError(f"onpolicy.every must be >= 0 (0: no on-policy phase), got {self.every}")
        for key in ("prompts", "rows", "max_new_tokens", "replay_rows", "buffer_rows"):
            if getattr(self, key) < 1:
                raise ValueError(f"onpolicy.{key} must be >= 1, got {getattr(self, key)}")
        if self.temperature < 0:
            raise ValueError(f"onpolicy.temperature must be >= 0 (0: greedy), got {self.temperature}")
        if self.train_on not in TRAIN_ON:
            raise ValueError(f"onpolicy.train_on must be one of {', '.join(TRAIN_ON)}, got {self.train_on!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"onpolicy.dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    @property
    def enabled(self) -> bool:
        return self.every > 0

    def rollout_dtype(self, target: torch.nn.Module) -> torch.dtype:
        """The precision rollouts decode `target` in (`dtype`)."""
        if self.dtype == "bfloat16" or (self.dtype == "auto" and target.device.type == "cpu"
                                        and cpu_has_native_bf16()):
            return torch.bfloat16
        return target.dtype


def replay_row(out: Rollout, train_on: str) -> dict[str, list[int]] | None:
    """A rollout as a training row (`input_ids`, `loss_mask`), or None when it holds nothing to train on."""
    n = len(out.prompt)
    ids = out.prompt + out.output
    mask = [0] * len(ids)
    if train_on == "all":
        mask[n:] = [1] * len(out.output)
    else:
        for step in out.steps:
            if step.rejected and step.start + step.accepted < len(out.output):
                root = n + step.start - 1  # the committed token the step drafted from
                mask[root : n + step.start + step.accepted + 1] = [1] * (step.accepted + 2)
    return {"input_ids": ids, "loss_mask": mask} if any(mask) else None


def rollout_prompts(input_ids: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]],
                    max_prompt: int) -> list[list[int]]:
    """The conversations' prompts (everything before the first assistant token) of at most `max_prompt` tokens, so
    prompt and rollout fit the run's `data.max_length`."""
    prompts = []
    for ids, mask in zip(input_ids, loss_mask):
        first = next((j for j, m in enumerate(mask) if m), 0)
        if 0 < first <= max_prompt:
            prompts.append(list(ids[:first]))
    return prompts


class OnPolicy:
    """One process's rollouts and replay buffer (module doc). `due` says when to roll out, `collect` does, `replay`
    extends a batch; `save`/`load` go with the run's checkpoints."""

    def __init__(self, cfg: OnPolicyConfig, input_ids: Sequence[Sequence[int]], loss_mask: Sequence[Sequence[int]],
                 *, max_length: int, seed: int, process: int, processes: int) -> None:
        self.cfg = cfg
        self.seed, self.process = seed, process
        prompts = rollout_prompts(input_ids, loss_mask, max_length - cfg.max_new_tokens)
        if not prompts:
            raise ValueError(f"no training conversation has a prompt of at most data.max_length - "
                             f"onpolicy.max_new_tokens = {max_length - cfg.max_new_tokens} tokens; raise "
                             "data.max_length or lower onpolicy.max_new_tokens")
        order = torch.randperm(len(prompts), generator=torch.Generator().manual_seed(seed)).tolist()
        self.prompts = [prompts[i] for i in order][process::processes] or [prompts[order[0]]]
        self.cursor = 0  # prompts used so far (they cycle)
        self.rollouts = 0
        self.buffer: list[dict[str, list[int]]] = []
        self.decoder: torch.nn.Module | None = None  # the target in the rollouts' precision, where it is a copy

    def due(self, step: int) -> bool:
        return self.cfg.enabled and step % self.cfg.every == 0

    def next_prompts(self) -> list[list[int]]:
        n = len(self.prompts)
        picked = [self.prompts[(self.cursor + i) % n] for i in range(self.cfg.prompts)]
        self.cursor += self.cfg.prompts
        return picked

    def roll_out(self, target: torch.nn.Module, target_name: str, kind: str, heads: Path,
                 stop_token_ids: Sequence[int]) -> dict[str, float]:
        """Decode the next prompts with the drafter of `kind` saved at `heads` and keep what they give (`collect`);
        `target_name` loads the target again where the rollouts decode in another precision."""
        from specheads.inference.bench.runner import rollout_drafter  # the engine, loaded once a rollout is due

        cfg = self.cfg
        decoder = self.decoding_target(target, target_name)  # loaded before the clock starts: tokens/s is the decode's
        start = time.perf_counter()
        outs = rollout_drafter(decoder, kind, str(heads), self.next_prompts(), max_new_tokens=cfg.max_new_tokens,
                               stop_token_ids=stop_token_ids, temperature=cfg.temperature,
                               seed=_key(self.seed, self.process, self.rollouts), rows=cfg.rows)
        return self.collect(outs, time.perf_counter() - start)

    def decoding_target(self, target: torch.nn.Module, target_name: str) -> torch.nn.Module:
        """`target`, or its copy in the rollouts' precision, loaded at the first rollout and kept (the target is
        frozen); in the layout `specheads bench` decodes with (packed bf16 weights where the CPU has them)."""
        dtype = self.cfg.rollout_dtype(target)
        if dtype == target.dtype:
            return target
        if self.decoder is None:
            from specheads.target import load_target

            self.decoder = load_target(target_name, device=str(target.device), dtype=dtype, weight_layout="auto")[0]
            log.info("on-policy rollouts decode a %s copy of the target", dtype)
        return self.decoder

    def collect(self, outs: list[Rollout], seconds: float) -> dict[str, float]:
        """Keep `outs` as replay rows; the rollout's figures for the metrics."""
        rows = [r for r in (replay_row(o, self.cfg.train_on) for o in outs) if r is not None]
        self.buffer = (self.buffer + rows)[-self.cfg.buffer_rows:]
        self.rollouts += 1
        steps = sum(o.stats.steps for o in outs)
        tokens = sum(len(o.output) for o in outs)
        failures = sum(len(o.failures()) for o in outs)
        drafted = sum(len(o.steps) for o in outs)
        return {"rollout/tau": (sum(o.stats.accepted for o in outs) + steps) / max(steps, 1),
                "rollout/tokens": tokens, "rollout/tokens_per_s": tokens / max(seconds, 1e-9),
                "rollout/failed_steps": failures / max(drafted, 1), "rollout/rows_kept": len(rows),
                "replay/buffer_rows": len(self.buffer)}

    def replay(self, batch: dict[str, torch.Tensor], step: int, pad: int, target: torch.nn.Module,
               aux_layers: Sequence[int]) -> tuple[dict[str, torch.Tensor], int]:
        """`batch` with `replay_rows` buffered rows appended (drawn by (seed, process, step): a resumed run draws
        the same), and how many; their features computed now where the batch carries cached ones."""
        if not self.buffer:
            return batch, 0
        generator = torch.Generator().manual_seed(_key(self.seed, self.process, step))
        picks = torch.randint(len(self.buffer), (self.cfg.replay_rows,), generator=generator).tolist()
        extra = collate([self.buffer[i] for i in picks], pad)
        device = batch["input_ids"].device
        extra = {k: v.to(device) for k, v in extra.items()}
        width = max(batch["input_ids"].shape[1], extra["input_ids"].shape[1])
        merged = {key: torch.cat([_pad_to(batch[key], width, pad if key == "input_ids" else 0),
                                  _pad_to(extra[key], width, pad if key == "input_ids" else 0)])
                  for key in ("input_ids", "attention_mask", "loss_mask")}
        if "features" in batch:
            feats = target_features(target, extra["input_ids"], extra["attention_mask"], aux_layers)
            merged["features"] = torch.cat([_pad_to(batch["features"], width, 0.0),
                                            _pad_to(feats.to(batch["features"].dtype), width, 0.0)])
        return merged, len(picks)

    def state(self) -> dict[str, Any]:
        return {"cursor": self.cursor, "rollouts": self.rollouts, "buffer": self.buffer}

    def save(self, folder: Path) -> None:
        (folder / f"onpolicy-{self.process}.json").write_text(json.dumps(self.state()), encoding="utf-8")

    def load(self, folder: Path) -> None:
        path = folder / f"onpolicy-{self.process}.json"
        if not path.is_file():  # a checkpoint from before the phase was on: nothing collected yet
            return
        state = json.loads(path.read_text(encoding="utf-8"))
        self.cursor, self.rollouts, self.buffer = state["cursor"], state["rollouts"], state["buffer"]


def _pad_to(x: torch.Tensor, width: int, value: float) -> torch.Tensor:  # [B, T, ...] -> [B, width, ...]
    if x.shape[1] == width:
        return x
    pad = x.new_full((x.shape[0], width - x.shape[1], *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def _key(seed: int, process: int, count: int) -> int:  # one random stream per (run seed, process, step or rollout)
    return seed * 1_000_003 + process * 10_007 + count
