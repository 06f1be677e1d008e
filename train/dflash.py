"""The DFlash objective: blocks anchored at random answer positions, every slot of a block trained in one forward.

A block anchored at position a holds [x_a, mask, ..., mask] at positions a .. a+B-1 and sees the target's context
rows of positions < a and its own block (`specheads.heads.dflash`), exactly as at inference, where the anchor is
the last committed token. Slot j (1 <= j < B) learns the target's distribution at position a+j-1 (the token
x_{a+j}) by soft cross-entropy over the draft vocabulary, weighted exp(-(j-1) / position_decay) (DFlash's
decaying per-position weights: early slots decide whether later ones count at all). Each row trains
`max_anchors` random anchors whose first drafted token is an answer token. Evaluation runs every such anchor:
per-slot top-1/top-k and the chain τ (1 + leading right slots).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from accelerate.utils import extract_model_from_parallel

from specheads.heads.dflash import KIND_NAME, DFlashBlock, DFlashConfig, DFlashHead
from specheads.heads.fused_head import declared_by
from specheads.target_logits import target_draft_logits
from specheads.train.chain_loss import EVAL_TOPK, chain_eval_row
from specheads.train.class_top1 import TOKEN_HITS, join_hits, token_hits
from specheads.train.divergence import head_loss
from specheads.train.features import batch_features, last_layer
from specheads.train.fused_heads import FusedHeadsConfig
from specheads.train.objective import Objective, register_objective
from specheads.train.position_weights import PositionWeighting

_EVAL_CHUNK = 64  # anchors per evaluation forward: bounds the [Q, C + Q] attention scores


@dataclass(frozen=True)
class DFlashHeadsConfig(FusedHeadsConfig, DFlashBlock, PositionWeighting):
    """The `heads:` section of a dflash recipe: the drafter's shape (its block `DFlashBlock`: block_size,
    mask_token_id) and the objective's settings."""

    max_anchors: int = 64  # blocks trained per sequence and step

    def __post_init__(self) -> None:
        FusedHeadsConfig.__post_init__(self)
        DFlashBlock.__post_init__(self)
        PositionWeighting.__post_init__(self)
        if self.max_anchors < 1:
            raise ValueError(f"heads.max_anchors must be >= 1, got {self.max_anchors}")


def build_dflash(settings: DFlashHeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> DFlashHead:
    config = DFlashConfig(**settings.head_fields(target, draft_vocab), **declared_by(DFlashBlock, settings))
    return DFlashHead(config, target)  # a mask token of None is chosen for the target here


def answer_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:  # [B, T] bool: tokens whose prediction counts
    return (batch["loss_mask"] * batch["attention_mask"]).bool()


def anchor_candidates(counts: torch.Tensor, block: int) -> torch.Tensor:  # [B, T] bool
    """Positions a whose block fits the sequence and whose first drafted token (x_{a+1}) is an answer token."""
    ok = torch.zeros_like(counts)
    ok[:, : counts.shape[1] - block + 1] = counts[:, 1 : counts.shape[1] - block + 2]
    return ok


def sample_anchors(candidates: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `count` random candidates per row, sorted: anchors [B, n] and which are real [B, n]."""
    n = max(1, min(count, int(candidates.sum(1).max())))
    keys = torch.rand(candidates.shape, device=candidates.device).masked_fill(~candidates, -1.0)
    top = keys.topk(n, dim=1)
    anchors, real = top.indices, top.values >= 0
    order = anchors.masked_fill(~real, candidates.shape[1]).argsort(dim=1)
    return anchors.gather(1, order), real.gather(1, order)


def block_inputs(model: DFlashHead, input_ids: torch.Tensor, anchors: torch.Tensor,
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


def _blocks(head: torch.nn.Module, model: DFlashHead, batch: dict[str, torch.Tensor], features: torch.Tensor,
            anchors: torch.Tensor) -> torch.Tensor:  # [B, n, B-1, H]: the drafted slots' outputs
    positions = torch.arange(features.shape[1], device=features.device).expand(features.shape[0], -1)
    context = model.context_kv(features, positions)
    tokens, block_positions, mask = block_inputs(model, batch["input_ids"], anchors, batch["attention_mask"].bool())
    out = head(tokens, block_positions, context, mask)
    block = model.config.block_size
    return out.view(*anchors.shape, block, -1)[:, :, 1:]


def dflash_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                     settings: DFlashHeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    model = extract_model_from_parallel(head)  # DDP hides the drafter's own methods
    block = model.config.block_size
    features = batch_features(target, batch, model.config.aux_layers)  # [B, T, D]
    if settings.feature_noise > 0:
        features = features + (torch.rand_like(features) - 0.5) * 2 * settings.feature_noise
    counts = answer_tokens(batch)
    anchors, real = sample_anchors(anchor_candidates(counts, block), settings.max_anchors)
    drafted = _blocks(head, model, batch, features, anchors)  # [B, n, B-1, H]
    slot = torch.arange(1, block, device=anchors.device)
    at = anchors[:, :, None] + slot  # [B, n, B-1]: the token each slot drafts
    valid = real[:, :, None] & counts.gather(1, at.flatten(1)).view(at.shape)
    rows = torch.arange(anchors.shape[0], device=anchors.device)[:, None, None].expand_as(at)
    last = last_layer(features, model.config.hidden_size)
    with torch.no_grad():
        target_logits = target_draft_logits(target, last[rows[valid], at[valid] - 1], model.draft_ids)  # [M, Vd]
    logits = model.draft_logits(drafted[valid])  # [M, Vd]
    ce, agree = head_loss(settings.loss, target_logits, logits)  # [M], [M]
    entry_slot = slot.expand_as(at)[valid]  # [M]
    w = settings.weights(valid.flatten(0, 1), target_logits, logits)  # blocks: (row, anchor) pairs
    loss = (w * ce).sum() / w.sum().clamp(min=1e-9)
    stats: dict[str, float] = {"loss_ce": float(ce.detach().mean()) if ce.numel() else 0.0}
    with torch.no_grad():
        hit = agree.float()
        for j in range(1, block):
            here = entry_slot == j
            if bool(here.any()):
                stats["top1" if j == 1 else f"top1_pos{j}"] = float(hit[here].mean())
    stats.setdefault("top1", 0.0)
    return loss, stats


@torch.no_grad()
def dflash_eval(head: torch.nn.Module, target: torch.nn.Module,
                batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums over every anchor whose first drafted token counts: per-slot top-1 / top-k agreement with the target's
    full-vocabulary argmax, and the chain acceptance length (leading right slots, counted slots only). The keys of
    `chain_eval`, so `chain_eval_row` reports them."""
    block = head.config.block_size
    steps = block - 1
    features = batch_features(target, batch, head.config.aux_layers)  # [B, T, D]
    counts = answer_tokens(batch)
    candidates = anchor_candidates(counts, block)
    target_next = target.get_output_embeddings()(last_layer(features, head.config.hidden_size)).argmax(-1)  # [B, T]
    top1, topk_hits, totals = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    accepted, starts = torch.zeros(1), torch.zeros(1)
    scored = []
    for row in range(features.shape[0]):
        positions = candidates[row].nonzero().flatten()
        one = {k: v[row : row + 1] for k, v in batch.items() if torch.is_tensor(v)}
        for chunk in positions.split(_EVAL_CHUNK):
            anchors = chunk[None]
            drafted = _blocks(head, head, one, features[row : row + 1], anchors)[0]  # [n, B-1, H]
            ranked = head.token_ids(head.draft_logits(drafted).topk(EVAL_TOPK, dim=-1).indices)  # [n, B-1, k]
            at = chunk[:, None] + torch.arange(1, block)  # [n, B-1]
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


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=DFlashHeadsConfig, build=build_dflash, step_loss=dflash_step_loss,
    eval_sums=dflash_eval, eval_row=chain_eval_row,
    feature_layers=lambda settings, num_target_layers: settings.resolved_aux_layers(num_target_layers),
))
