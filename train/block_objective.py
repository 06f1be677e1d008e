"""What the block drafters' objectives share (`dflash`, `dspark`, `xpress`, `dflash2`;
`specheads.heads.block_drafter`): blocks anchored at random answer positions, every slot of a block trained in one
forward, and the evaluation of every anchor.

A block anchored at position a holds [x_a, mask, ..., mask] at positions a .. a+B-1 and sees the target's context
rows of positions < a and its own block, exactly as at inference, where the anchor is the last committed token.
The d-th drafted slot (slot `first_slot` + d) drafts x_{a+d+1}: it learns the target's distribution at position a+d
over the draft vocabulary. Each row trains `max_anchors` random anchors whose first drafted token is an answer token;
a slot counts where the token it drafts does. Evaluation runs every such anchor: per-slot top-1/top-k and the chain
τ (1 + leading right slots), the keys `chain_eval_row` reports.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from accelerate.utils import extract_model_from_parallel

from specheads.heads.block_drafter import BlockDrafterHead
from specheads.target_logits import target_draft_logits
from specheads.train.chain_loss import EVAL_TOPK
from specheads.train.class_top1 import TOKEN_HITS, join_hits, token_hits
from specheads.train.divergence import head_loss
from specheads.train.features import batch_features, last_layer
from specheads.train.position_weights import PositionWeighting

_EVAL_CHUNK = 64  # anchors per evaluation forward: bounds the [Q, C + Q] attention scores


@dataclass(frozen=True)
class BlockTraining(PositionWeighting):
    """The `heads:` keys of the block drafters' objectives: how many blocks a step trains, and the slot weights."""

    max_anchors: int = 64  # blocks trained per sequence and step

    def _check(self) -> None:
        if self.max_anchors < 1:
            raise ValueError(f"heads.max_anchors must be >= 1, got {self.max_anchors}")


def require_full_vocabulary(cfg, recipe: str, why: str) -> None:
    """Refuse a draft vocabulary for a recipe whose drafter scores the target's whole vocabulary (`why`), before any
    data is read (an objective's `check`)."""
    if cfg.draft_vocab_size is not None:
        raise ValueError(f"recipe {recipe} {why}, but draft_vocab_size is {cfg.draft_vocab_size}; set "
                         "draft_vocab_size: null")


def answer_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:  # [B, T] bool: tokens whose prediction counts
    return (batch["loss_mask"] * batch["attention_mask"]).bool()


def anchor_candidates(counts: torch.Tensor, block: int, first_slot: int = 1) -> torch.Tensor:  # [B, T] bool
    """Positions a whose drafted tokens (x_{a+1} .. x_{a+block-first_slot}) fit the sequence and whose first drafted
    token is an answer token."""
    drafted = block - first_slot
    ok = torch.zeros_like(counts)
    ok[:, : counts.shape[1] - drafted] = counts[:, 1 : counts.shape[1] - drafted + 1]
    return ok


def sample_anchors(candidates: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` random candidates per row, sorted: anchors [B, n] and which are real [B, n]."""
    n = max(1, min(count, int(candidates.sum(1).max())))
    keys = torch.rand(candidates.shape, device=candidates.device).masked_fill(~candidates, -1.0)
    top = keys.topk(n, dim=1)
    anchors, real = top.indices, top.values >= 0
    order = anchors.masked_fill(~real, candidates.shape[1]).argsort(dim=1)
    return anchors.gather(1, order), real.gather(1, order)


def block_inputs(model: BlockDrafterHead, input_ids: torch.Tensor, anchors: torch.Tensor,
                 context_visible: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Blocks at `anchors` [B, n]: tokens [B, n*B], positions [B, n*B] and the additive mask [B, 1, n*B, T + n*B]
    (context rows before the anchor, where `context_visible` [B, T]; the whole own block)."""
    block = model.config.block_size
    b, n = anchors.shape
    t = input_ids.shape[1]
    slots = torch.arange(block, device=anchors.device)
    positions = (anchors[:, :, None] + slots).reshape(b, n * block)
    tokens = torch.full_like(positions, model.config.mask_token_id)
    tokens[:, ::block] = input_ids.gather(1, anchors)
    query_anchor = anchors.repeat_interleave(block, dim=1)  # [B, Q]
    sees_context = (torch.arange(t, device=anchors.device)[None, None] < query_anchor[:, :, None]) \
        & context_visible[:, None, :]
    blocks = torch.arange(n, device=anchors.device).repeat_interleave(block)
    sees_block = (blocks[:, None] == blocks[None, :]).expand(b, -1, -1)
    visible = torch.cat([sees_context, sees_block], dim=2)
    dtype = model.compute_dtype
    mask = torch.zeros(visible.shape, dtype=dtype, device=anchors.device).masked_fill_(~visible, torch.finfo(dtype).min)
    return tokens, positions, mask[:, None]


def block_outputs(head: torch.nn.Module, model: BlockDrafterHead, batch: dict[str, torch.Tensor],
                  features: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:  # [B, n, block, H]: every slot's
    """The outputs of blocks at `anchors` [B, n] (`head` the module to call, possibly DDP-wrapped; `model` it
    unwrapped), every slot's, the anchor's included."""
    positions = torch.arange(features.shape[1], device=features.device).expand(features.shape[0], -1)
    context = model.context_kv(features, positions)
    tokens, block_positions, mask = block_inputs(model, batch["input_ids"], anchors, batch["attention_mask"].bool())
    out = head(tokens, block_positions, context, mask)
    return out.view(*anchors.shape, model.config.block_size, -1)


def block_tokens(input_ids: torch.Tensor, anchors: torch.Tensor, block: int) -> torch.Tensor:  # [B, n, block]
    """The text's tokens at the blocks' positions a .. a+block-1 (clamped to the sequence: slots past its end draft
    nothing that counts)."""
    at = (anchors[:, :, None] + torch.arange(block, device=anchors.device)).clamp(max=input_ids.shape[1] - 1)
    return input_ids.gather(1, at.flatten(1)).view(at.shape)


def tokens_before(input_ids: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:  # [B, n]
    """The text's token before each anchor [B, n] (x_{a-1}; the anchor itself at the text's start)."""
    return input_ids.gather(1, (anchors - 1).clamp(min=0)).where(anchors > 0, input_ids.gather(1, anchors))


@dataclass
class BlockStep:
    """One training step's blocks: the drafter's outputs at every slot and the target's distributions at the entries
    that count (entries: (row, anchor, drafted slot) where `valid`, in that order)."""

    model: BlockDrafterHead  # the drafter, unwrapped
    anchors: torch.Tensor  # [B, n]
    outputs: torch.Tensor  # [B, n, block, H] every slot's output
    valid: torch.Tensor  # [B, n, S] bool: the d-th drafted slot counts (S = drafted slots)
    target_logits: torch.Tensor  # [M, Vd] the target's distribution at each entry's position a+d


def block_step(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor], max_anchors: int,
               feature_noise: float) -> BlockStep:
    model = extract_model_from_parallel(head)  # DDP hides the drafter's own methods
    config = model.config
    features = batch_features(target, batch, config.aux_layers)  # [B, T, D]
    if feature_noise > 0:
        features = features + (torch.rand_like(features) - 0.5) * 2 * feature_noise
    counts = answer_tokens(batch)
    anchors, real = sample_anchors(anchor_candidates(counts, config.block_size, config.first_slot), max_anchors)
    outputs = block_outputs(head, model, batch, features, anchors)  # [B, n, block, H]
    at = anchors[:, :, None] + torch.arange(1, config.drafted + 1, device=anchors.device)  # [B, n, S]: drafted token
    at = at.clamp(max=counts.shape[1] - 1)  # a padded anchor may sit anywhere; its slots never count
    valid = real[:, :, None] & counts.gather(1, at.flatten(1)).view(at.shape)
    rows = torch.arange(anchors.shape[0], device=anchors.device)[:, None, None].expand_as(at)
    last = last_layer(features, config.hidden_size)
    with torch.no_grad():
        target_logits = target_draft_logits(target, last[rows[valid], at[valid] - 1], model.draft_ids)  # [M, Vd]
    return BlockStep(model, anchors, outputs, valid, target_logits)


def drafted_outputs(step: BlockStep) -> torch.Tensor:  # [M, H]: the entries' outputs
    return step.outputs[:, :, step.model.config.first_slot:][step.valid]


def block_loss(step: BlockStep, logits: torch.Tensor, loss: str,
               weighting: PositionWeighting) -> tuple[torch.Tensor, dict[str, float]]:
    """The entries' weighted loss (`heads.loss` against the target, slot weights as `weighting` says) from the
    drafter's logits at them [M, Vd]; with per-slot top-1 (`top1` the first drafted slot's, `top1_posJ` the J-th's,
    J counting from 1 as DFlash numbers its slots)."""
    ce, agree = head_loss(loss, step.target_logits, logits)  # [M], [M]
    valid = step.valid
    entry_slot = torch.arange(1, valid.shape[2] + 1, device=valid.device).expand_as(valid)[valid]  # [M]
    w = weighting.weights(valid.flatten(0, 1), step.target_logits, logits, agree)  # blocks: (row, anchor) pairs
    total = (w * ce).sum() / w.sum().clamp(min=1e-9)
    stats: dict[str, float] = {"loss_ce": float(ce.detach().mean()) if ce.numel() else 0.0}
    if weighting.accept_until_fail:  # the share of entries inside each block's support
        stats["auf_kept"] = float((w > 0).float().mean()) if w.numel() else 0.0
    with torch.no_grad():
        hit = agree.float()
        for j in range(1, valid.shape[2] + 1):
            here = entry_slot == j
            if bool(here.any()):
                stats["top1" if j == 1 else f"top1_pos{j}"] = float(hit[here].mean())
    stats.setdefault("top1", 0.0)
    return total, stats


# (drafter, every slot's outputs [n, block, H], the text at the block's positions [n, block]) -> the drafted
# slots' logits [n, S, Vd]
SlotLogits = Callable[[BlockDrafterHead, torch.Tensor, torch.Tensor], torch.Tensor]


@torch.no_grad()
def block_eval(head: BlockDrafterHead, target: torch.nn.Module, batch: dict[str, torch.Tensor],
               slot_logits: SlotLogits, before: bool = False) -> dict[str, torch.Tensor]:
    """Sums over every anchor whose first drafted token counts: per-slot top-1 / top-k agreement with the target's
    full-vocabulary argmax, and the chain acceptance length (leading right slots, counted slots only). The keys of
    `chain_eval`, so `chain_eval_row` reports them. With `before` the text `slot_logits` gets starts one token
    earlier (`tokens_before`)."""
    config = head.config
    block, steps = config.block_size, config.drafted
    features = batch_features(target, batch, config.aux_layers)  # [B, T, D]
    counts = answer_tokens(batch)
    candidates = anchor_candidates(counts, block, config.first_slot)
    target_next = target.get_output_embeddings()(last_layer(features, config.hidden_size)).argmax(-1)  # [B, T]
    top1, topk_hits, totals = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    accepted, starts = torch.zeros(1), torch.zeros(1)
    scored = []
    for row in range(features.shape[0]):
        positions = candidates[row].nonzero().flatten()
        one = {k: v[row : row + 1] for k, v in batch.items() if torch.is_tensor(v)}
        for chunk in positions.split(_EVAL_CHUNK):
            anchors = chunk[None]
            out = block_outputs(head, head, one, features[row : row + 1], anchors)[0]  # [n, block, H]
            text = block_tokens(one["input_ids"], anchors, block)[0]  # [n, block]
            if before:  # the token before each anchor in front: [n, 1 + block]
                text = torch.cat([tokens_before(one["input_ids"], anchors)[0, :, None], text], dim=1)
            ranked = head.token_ids(slot_logits(head, out, text).topk(EVAL_TOPK, dim=-1).indices)  # [n, S, k]
            at = chunk[:, None] + torch.arange(1, steps + 1)  # [n, S]
            wanted = target_next[row, at - 1]
            valid = counts[row, at]
            hit = (ranked[..., 0] == wanted) & valid
            top1 += hit.sum(0)
            topk_hits += ((ranked == wanted[..., None]).any(-1) & valid).sum(0)
            totals += valid.sum(0)
            accepted += torch.cumprod(hit.long(), dim=1).sum()
            starts += chunk.numel()
            scored.append(token_hits(wanted, hit, torch.arange(steps), steps, keep=valid))
    return {"correct_top1": top1, "correct_topk": topk_hits, "positions": totals, "accepted": accepted,
            "starts": starts, TOKEN_HITS: join_hits(scored, steps)}
