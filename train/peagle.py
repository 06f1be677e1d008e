"""The P-EAGLE objective: every position of a block in one forward, the deeper ones sampled sparsely (COD).

A block of K = `num_depths` tokens drafted from anchor pair a (feature h_a, token x_{a+1}) puts the anchor at
depth 0 and mask entries at depths 1..K-1 (positions a+1 .. a+K-1); the entry at depth d predicts the target's
distribution at pair index a+d (the token x_{a+d+2}). Training lays every entry it samples out as one sequence:

- depth 0: every pair of the sequence (the EAGLE-3 first step, causal);
- depth d >= 1: a random subset of depth d-1's anchors (so each sampled chain is complete), a share
  max(r^d, floor) of the sequence, with r = `down_sample_ratio` and floor = `down_sample_ratio_min`
  (conditional drop-token; the deeper positions cost a fraction of a pass each);

and an entry (a, d) attends to depth-0 entries of anchors <= a and to its own chain's entries of depth <= d,
which is exactly what it sees at inference (the committed pairs, the anchor, the masks before it). The loss is
the soft cross-entropy against the target over the draft vocabulary, averaged over every sampled entry that
counts. Evaluation runs every anchor at every depth (no sampling): per-depth top-1/top-k and the chain τ a
block drafted as a chain would reach.

Chain engines (llama.cpp) run P-EAGLE heads as the EAGLE-3 draft they contain: one token per forward, each deeper
step reading the head's own output where the block reads `mask_hidden`. With `ar_steps = K > 1` the objective also
trains that mode, as EAGLE-3's training-time test does (`chain_loss.unroll`): steps 1..K-1 unrolled after the
block's forward, their queries seeing the block's depth-0 keys (the committed pairs) and their own chain's earlier
steps. Step 0 is the block's depth 0, so the term costs K-1 passes over the sequence. Evaluation then also reports
the chain τ and per-step top-1 of that mode (`eval/simulated_tau_ar_chain`, `eval/top1_ar_step{k}`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from accelerate.utils import extract_model_from_parallel
from transformers import DynamicCache

from specheads.heads.fused_chain import ChainLayout
from specheads.heads.fused_head import declared_by
from specheads.heads.peagle import KIND_NAME, PEagleBlock, PEagleConfig, PEagleHead
from specheads.target_logits import target_draft_logits
from specheads.train.chain_loss import (
    EVAL_STEPS,
    EVAL_TOPK,
    chain_eval_row,
    chain_inputs,
    chain_sums,
    step_valid,
    ttt_mask,
)
from specheads.train.class_top1 import TOKEN_HITS, token_hits
from specheads.train.divergence import head_loss
from specheads.train.features import batch_features, last_layer
from specheads.train.fused_heads import FusedHeadsConfig
from specheads.train.objective import Objective, register_objective
from specheads.train.position_weights import PositionWeighting

AR = "ar_"  # prefix of the chain mode's evaluation sums


@dataclass(frozen=True)
class PEagleHeadsConfig(FusedHeadsConfig, ChainLayout, PEagleBlock, PositionWeighting):
    """The `heads:` section of a peagle recipe: the head's shape (its layout flags `ChainLayout`, its block
    `PEagleBlock`: num_depths, mask_token_id) and the objective's settings."""

    down_sample_ratio: float = 0.7  # depth d trains on a share r^d of the anchors (conditional drop-token) ...
    down_sample_ratio_min: float = 0.2  # ... and never on fewer than this share
    # depth d is slot d + 1 of its anchor's block; uniform: every trained entry alike (the drop-token sample already
    # thins the deeper ones)
    position_weighting: str = "uniform"
    # > 1: also train the chain mode chain engines run (EAGLE-3's unroll, steps 1..ar_steps-1 reading the head's own
    # outputs), each step's loss weighted ar_weight against the block's 1
    ar_steps: int = 1
    ar_weight: float = 1.0

    def _check(self) -> None:
        if self.ar_steps < 1 or self.ar_weight < 0:
            raise ValueError(f"heads.ar_steps must be >= 1 (1: the block alone; 3: also two unrolled chain steps) and "
                             f"heads.ar_weight >= 0, got {self.ar_steps} and {self.ar_weight}")
        if not 0.0 < self.down_sample_ratio <= 1.0 or not 0.0 <= self.down_sample_ratio_min <= 1.0:
            raise ValueError("heads.down_sample_ratio must be in (0, 1] and heads.down_sample_ratio_min in [0, 1], got "
                             f"{self.down_sample_ratio} and {self.down_sample_ratio_min}")


def build_peagle(settings: PEagleHeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> PEagleHead:
    config = PEagleConfig(**settings.head_fields(target, draft_vocab), **declared_by(ChainLayout, settings),
                          **declared_by(PEagleBlock, settings))
    return PEagleHead(config, target)  # a mask token of None is chosen for the target here


def cod_anchors(width: int, num_depths: int, ratio: float, floor: float,
                generator: torch.Generator | None = None) -> list[torch.Tensor]:
    """Per depth d, the sorted anchors [n_d] whose depth-d entries are trained: every index at depth 0, then a random
    subset of depth d-1's anchors (those with a + d < width) of size ceil((width - d) * max(ratio^d, floor))."""
    anchors = [torch.arange(width)]
    for d in range(1, num_depths):
        pool = anchors[-1][anchors[-1] < width - d]
        size = min(pool.numel(), math.ceil((width - d) * max(ratio ** d, floor)))
        if size <= 0:
            break
        pick = torch.randperm(pool.numel(), generator=generator)[:size] if size < pool.numel() else slice(None)
        anchors.append(pool[pick].sort().values)
    return anchors


def block_mask(anchor: torch.Tensor, depth: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:  # [1, 1, L, L]
    """Entry (a, d) sees depth-0 entries of anchors <= a and its own chain's entries of depth <= d."""
    a_q, a_k = anchor[:, None], anchor[None, :]
    d_q, d_k = depth[:, None], depth[None, :]
    visible = ((d_k == 0) & (a_k <= a_q)) | ((a_k == a_q) & (d_k <= d_q))
    mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def block_forward(head: torch.nn.Module, model: PEagleHead, tokens: torch.Tensor, feats: torch.Tensor,
                  anchors: list[torch.Tensor], cache: DynamicCache | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The head over every sampled entry: outputs [B, L, H], and each entry's anchor [L] and depth [L]. The entries
    are laid out depth by depth, so the first W are depth 0 at anchors 0..W-1 (what `ar_unroll` reads)."""
    anchor = torch.cat(anchors).to(tokens.device)  # [L]
    depth = torch.cat([torch.full((a.numel(),), d, dtype=torch.long) for d, a in enumerate(anchors)]).to(tokens.device)
    deep = depth > 0
    b = tokens.shape[0]
    tok_in = tokens[:, anchor].masked_fill(deep[None], model.config.mask_token_id)  # [B, L]
    feat_in = feats[:, anchor]  # [B, L, D]
    feat_in = torch.where(deep[None, :, None], model.mask_features().to(feat_in.dtype), feat_in)
    positions = (anchor + depth)[None].expand(b, -1)
    mask = block_mask(anchor.cpu(), depth.cpu(), feat_in.dtype).to(tokens.device)
    return head(tok_in, feat_in, positions, attention_mask=mask, cache=cache), anchor, depth


def ar_unroll(head: torch.nn.Module, tokens: torch.Tensor, first: torch.Tensor, block_width: int,
              cache: DynamicCache, steps: int) -> list[torch.Tensor]:
    """Chain steps 1..steps-1 after a block forward that filled `cache` with its `block_width` entries: step k's
    query at index i drafts the k-th token of the chain started at i - k, reading step k-1's output at i - 1 (step
    0: the block's depth-0 output `first` [B, W, H]). Its keys: the block's depth-0 entries as `ttt_mask` lets step
    0's keys be seen (the block's first W entries), none of its mask entries, and the chain's own earlier steps.
    Returns each step's outputs [B, W, H]."""
    width = tokens.shape[1]
    positions = torch.arange(width, device=tokens.device).expand_as(tokens)
    outs, prev = [], first
    for k in range(1, steps):
        ttt = ttt_mask(width, k, prev.dtype, prev.device)  # [1, 1, W, (k+1)W]: [step-0 | step 1 .. k-1 | own]
        hidden = torch.full((1, 1, width, block_width - width), torch.finfo(prev.dtype).min, dtype=prev.dtype,
                            device=prev.device)
        mask = torch.cat([ttt[..., :width], hidden, ttt[..., width:]], dim=-1)
        feats = torch.cat([prev[:, :1], prev[:, :-1]], dim=1)  # index 0 has no predecessor; never counted
        prev = head(tokens, feats, positions, attention_mask=mask, cache=cache)
        outs.append(prev)
    return outs


def _counted(counts: torch.Tensor, anchor: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:  # [B, L]
    """An entry counts where its anchor's prediction and its own target position both count."""
    return counts[:, anchor] & counts[:, anchor + depth]


def _weighted(ce: torch.Tensor, settings: PEagleHeadsConfig, valid: torch.Tensor, rows: torch.Tensor,
              anchor: torch.Tensor, depth: torch.Tensor, width: int, depths: int, target_logits: torch.Tensor,
              logits: torch.Tensor, agree: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The entries' loss weighted per block: an anchor's entries are its block's slots, depth d its slot d + 1.
    `valid` [B, L] lists the entries row by row, depth by depth; the blocks [B * W, depths] anchor by anchor.
    Returns the loss and each entry's weight [M]."""
    entry_anchor, entry_depth = anchor[None].expand_as(valid)[valid], depth[None].expand_as(valid)[valid]
    key = (rows * width + entry_anchor) * depths + entry_depth  # [M]: each entry's place among the blocks' slots
    blocks = torch.zeros(valid.shape[0] * width * depths, dtype=torch.bool, device=valid.device)
    blocks[key] = True
    by_block = key.argsort()  # entries in the blocks' order
    w = torch.empty_like(ce)
    w[by_block] = settings.weights(blocks.view(-1, depths), target_logits[by_block], logits.detach()[by_block],
                                   None if agree is None else agree[by_block])
    return (w * ce).sum() / w.sum().clamp(min=1e-9), w


def peagle_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                     settings: PEagleHeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    model = extract_model_from_parallel(head)  # DDP hides the head's own methods
    features = batch_features(target, batch, model.config.aux_layers)  # [B, T, D]
    tokens, feats, _, counts = chain_inputs(batch, features)
    last = last_layer(features, model.config.hidden_size)[:, 1:]  # [B, W, H]: F_{i+1}, what entry (a, d=i-a) predicts
    if settings.feature_noise > 0:
        feats = feats + (torch.rand_like(feats) - 0.5) * 2 * settings.feature_noise
    anchors = cod_anchors(tokens.shape[1], model.config.num_depths, settings.down_sample_ratio,
                          settings.down_sample_ratio_min)
    cache = DynamicCache() if settings.ar_steps > 1 else None
    out, anchor, depth = block_forward(head, model, tokens, feats, anchors, cache)
    valid = _counted(counts, anchor, depth)  # [B, L]
    rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(valid)[valid]
    at = (anchor + depth)[None].expand_as(valid)[valid]
    with torch.no_grad():
        target_logits = target_draft_logits(target, last[rows, at], model.draft_ids)  # [M, Vd]
    logits = model.draft_logits(out[valid])  # [M, Vd]
    ce, agree = head_loss(settings.loss, target_logits, logits)  # [M], [M]
    stats: dict[str, float] = {"loss_ce": float(ce.detach().mean())}
    if settings.all_alike:
        loss = ce.mean()
    else:
        loss, w = _weighted(ce, settings, valid, rows, anchor, depth, tokens.shape[1], model.config.num_depths,
                            target_logits, logits, agree)
        if settings.accept_until_fail:  # the share of entries inside each block's support
            stats["auf_kept"] = float((w > 0).float().mean())
    if settings.ar_steps > 1:
        width = tokens.shape[1]
        # the target's logits at position i are depth-0 entry i's: their rows in `target_logits`, where counted
        row_of = (valid.flatten().cumsum(0) - 1).view_as(valid)[:, :width]  # [B, W]
        ar = ar_unroll(head, tokens, out[:, :width], anchor.numel(), cache, settings.ar_steps)
        for k, step_out in enumerate(ar, start=1):
            keep = step_valid(counts, k)  # [B, W]: its prediction and its chain's start both count
            step_ce, step_agree = head_loss(settings.loss, target_logits[row_of[keep]],
                                            model.draft_logits(step_out[keep]))
            loss = loss + settings.ar_weight * step_ce.mean()
            stats |= {f"loss_ce_ar{k + 1}": float(step_ce.detach().mean()),
                      f"top1_ar{k + 1}": float(step_agree.float().mean())}
        loss = loss / (1 + settings.ar_weight * (settings.ar_steps - 1))
    with torch.no_grad():
        hit = agree.float()
        entry_depth = depth[None].expand_as(valid)[valid]
        for d in range(len(anchors)):
            at_d = entry_depth == d
            if bool(at_d.any()):
                stats["top1" if d == 0 else f"top1_depth{d}"] = float(hit[at_d].mean())
    stats.setdefault("top1", 0.0)
    return loss, stats


@torch.no_grad()
def block_eval(head: torch.nn.Module, target: torch.nn.Module,
               batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums over the batch's counted anchors, every anchor at every depth: per-depth top-1 / top-k agreement of the
    draft (over its vocabulary) with the target's full-vocabulary argmax, and the chain acceptance length (leading
    depths right). The keys of `chain_eval`, so `chain_eval_row` reports them; beside them (prefixed `ar_`) the same
    sums for the chain mode chain engines run (`ar_unroll`), so `peagle_eval_row` reports both."""
    features = batch_features(target, batch, head.config.aux_layers)  # [B, T, D]
    tokens, feats, _, counts = chain_inputs(batch, features)
    width, steps = tokens.shape[1], head.config.num_depths
    last = last_layer(features, head.config.hidden_size)[:, 1:]  # [B, W, H]
    target_next = target.get_output_embeddings()(last).argmax(-1)  # [B, W]
    anchors = [torch.arange(width - d) for d in range(min(steps, width))]
    cache = DynamicCache()
    out, anchor, depth = block_forward(head, head, tokens, feats, anchors, cache)
    chain = [out[:, :width], *ar_unroll(head, tokens, out[:, :width], anchor.numel(), cache, min(EVAL_STEPS, width))]
    ar_sums = chain_sums(head, target, batch, features, chain)
    ranked = head.token_ids(head.draft_logits(out).topk(EVAL_TOPK, dim=-1).indices)  # [B, L, k]
    wanted = target_next[:, anchor + depth]  # [B, L]
    hit, hitk = ranked[..., 0] == wanted, (ranked == wanted[..., None]).any(-1)
    valid = _counted(counts, anchor, depth)
    top1, topk_hits, totals = torch.zeros(steps), torch.zeros(steps), torch.zeros(steps)
    hits = torch.zeros(steps, *counts.shape, dtype=torch.bool)  # [K, B, W]: depth d right, by anchor
    for d in range(len(anchors)):
        at_d = depth == d
        h, v = hit[:, at_d], valid[:, at_d]
        top1[d], topk_hits[d], totals[d] = (h & v).sum(), (hitk[:, at_d] & v).sum(), v.sum()
        hits[d, :, : width - d] = h & v
    accepted = torch.cumprod(hits.long(), dim=0).sum(0)[counts].sum()
    return {"correct_top1": top1, "correct_topk": topk_hits, "positions": totals,
            "accepted": accepted.float().reshape(1), "starts": counts.sum().float().reshape(1),
            TOKEN_HITS: token_hits(wanted, hit, depth.expand_as(wanted), steps, keep=valid),
            **{f"{AR}{key}": value for key, value in ar_sums.items() if key != TOKEN_HITS}}


def peagle_eval_row(sums: dict[str, torch.Tensor]) -> tuple[dict[str, float], None]:
    """`chain_eval_row` of the block, plus the chain mode's per-step top-1 and τ (`eval/top1_ar_step{k}`,
    `eval/simulated_tau_ar_chain`)."""
    row, _ = chain_eval_row({key: value for key, value in sums.items() if not key.startswith(AR)})
    ar, _ = chain_eval_row({key[len(AR):]: value for key, value in sums.items() if key.startswith(AR)})
    row |= {key.replace("eval/top1_", "eval/top1_ar_").replace("_chain", "_ar_chain"): value
            for key, value in ar.items() if key.startswith("eval/top1_") or key == "eval/simulated_tau_chain"}
    return row, None


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=PEagleHeadsConfig, build=build_peagle, step_loss=peagle_step_loss,
    eval_sums=block_eval, eval_row=peagle_eval_row,
    feature_layers=lambda settings, num_target_layers: settings.resolved_aux_layers(num_target_layers),
))
