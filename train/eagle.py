"""The EAGLE-1 objective: how one batch becomes a loss, and how a checkpoint is evaluated."""

from __future__ import annotations

import torch

from specheads.heads.eagle import EagleConfig, EagleHead, eagle_loss
from specheads.train.config import TrainConfig
from specheads.train.features import batch_features


def build_eagle(cfg: TrainConfig, target: torch.nn.Module) -> EagleHead:
    tcfg = target.config.get_text_config()
    head_cfg = EagleConfig(hidden_size=tcfg.hidden_size, vocab_size=target.get_output_embeddings().weight.shape[0],
                           num_layers=cfg.heads.eagle_layers, init_from_target_layer=cfg.heads.init_from_target_layer)
    return EagleHead(head_cfg, target)


def _inputs(batch: dict[str, torch.Tensor], features: torch.Tensor):
    """Pairs (F_t, x_{t+1}) at positions t = 0..T-2, and where the prediction of F_{t+1} counts."""
    ids = batch["input_ids"]
    tokens = ids[:, 1:]  # [B, T-1]
    feats = features[:, :-1]  # [B, T-1, H]
    positions = torch.arange(tokens.shape[1], device=ids.device).expand_as(tokens)
    counts = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).bool()  # [B, T-1]
    return tokens, feats, positions, counts


def eagle_step_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                    cfg: TrainConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """1. Target features (no grad). 2. Noisy features in, predicted next features out.
    3. SmoothL1 + soft CE on the positions that count, gathered so the LM head only sees those."""
    features = batch_features(target, batch)
    tokens, feats, positions, counts = _inputs(batch, features)
    if cfg.heads.feature_noise > 0:
        feats = feats + (torch.rand_like(feats) - 0.5) * 2 * cfg.heads.feature_noise
    pred = head(tokens, feats, positions)  # [B, T-1, H]
    next_feats = features[:, 1:][counts]  # [M, H]
    unwrapped = head.module if hasattr(head, "module") else head
    with torch.no_grad():
        target_logits = unwrapped.logits(next_feats)  # [M, V]
    return eagle_loss(unwrapped, pred[counts], next_feats, target_logits, torch.ones_like(next_feats[:, 0]),
                      cls_weight=cfg.heads.cls_weight)


@torch.no_grad()
def eagle_eval(head: EagleHead, target: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int = 4,
               topk: int = 5) -> dict[str, torch.Tensor]:
    """Sums over the batch's counted positions: per-step top-1 / top-k agreement with the target's argmax
    (step k feeds the head's own step k-1 predictions as features) and the chain acceptance length.

    Returns tensors so callers can reduce across processes: correct_top1 [steps], correct_topk [steps],
    positions [steps], accepted (sum of leading correct steps per start position), starts.
    """
    features = batch_features(target, batch)
    tokens, feats, positions, counts = _inputs(batch, features)
    target_next = head.logits(features[:, 1:]).argmax(-1)  # [B, T-1]: target's choice after position t+1
    top1 = torch.zeros(steps)
    topk_hits = torch.zeros(steps)
    totals = torch.zeros(steps)
    run = torch.ones_like(counts)  # still accepted at every step so far, per start position
    accepted = torch.zeros_like(counts, dtype=torch.long)
    cur_feats = feats
    width = tokens.shape[1]
    for k in range(steps):
        n = width - k
        if n <= 0:
            break
        pred = head(tokens[:, k:], cur_feats[:, :n], positions[:, k:])  # step k+1 predictions
        logits = head.logits(pred)
        want = target_next[:, k:]
        valid = counts[:, k:] & counts[:, : n]
        hit = logits.argmax(-1) == want
        hitk = (logits.topk(topk, dim=-1).indices == want[..., None]).any(-1)
        top1[k] = (hit & valid).sum()
        topk_hits[k] = (hitk & valid).sum()
        totals[k] = valid.sum()
        run = run[:, :n] & hit & valid
        accepted[:, :n] += run.long()
        cur_feats = pred[:, :-1] if n > 1 else pred
    starts = counts.sum()
    return {"correct_top1": top1, "correct_topk": topk_hits, "positions": totals,
            "accepted": accepted[counts].sum().float().reshape(1), "starts": starts.float().reshape(1)}


def eagle_eval_row(sums: dict[str, torch.Tensor]) -> tuple[dict[str, float], None]:
    pos = sums["positions"].clamp(min=1)
    row = {f"eval/top1_step{i + 1}": float(x) for i, x in enumerate(sums["correct_top1"] / pos)}
    row |= {f"eval/top5_step{i + 1}": float(x) for i, x in enumerate(sums["correct_topk"] / pos)}
    row["eval/simulated_tau_chain"] = 1.0 + float(sums["accepted"][0] / sums["starts"][0].clamp(min=1))
    return row, None
