"""What the drafters trained on (feature, next token) pairs share: their inputs, the chain loss, and its evaluation.

A head that drafts a chain step by step (EAGLE-1, EAGLE-3) reads pairs (features_t, x_{t+1}) and predicts the
target's next feature and token. With `ttt_steps = K > 1` the head is trained as it is used ("training-time test",
EAGLE-3): step k feeds the head its own step k-1 outputs as features, and attends exactly to what the drafter
attends to at inference (see `ttt_mask`), so later draft steps learn to live with the errors of earlier ones
instead of only ever seeing the target's perfect features. Block drafters (P-EAGLE, DFlash) reuse the inputs,
the target's draft-vocabulary distribution and the evaluation report (`chain_eval_row`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from accelerate.utils import extract_model_from_parallel
from transformers import DynamicCache

from specheads.target_logits import target_draft_logits
from specheads.train.class_top1 import TOKEN_HITS, join_hits, token_hits
from specheads.train.divergence import head_loss
from specheads.train.features import batch_features, last_layer

EVAL_STEPS = 4  # draft steps evaluated (chain depth of the simulated acceptance length)
EVAL_TOPK = 5


def chain_inputs(batch: dict[str, torch.Tensor], features: torch.Tensor):
    """Pairs (features_t, x_{t+1}) at positions t = 0..T-2, and where the prediction of F_{t+1} counts."""
    ids = batch["input_ids"]
    tokens = ids[:, 1:]  # [B, W] with W = T-1
    feats = features[:, :-1]  # [B, W, D]
    positions = torch.arange(tokens.shape[1], device=ids.device).expand_as(tokens)
    counts = (batch["loss_mask"][:, 1:] * batch["attention_mask"][:, 1:]).bool()  # [B, W]
    return tokens, feats, positions, counts


def ttt_mask(width: int, step: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:  # [1, 1, W, (step+1)W]
    """Keys seen by step-`step` queries, laid out as [step-0 keys | step-1 keys | ... | own keys].

    A step-k query at index i drafts the k-th token of a chain that started at s = i - k. At
    inference that draft step sees the cached prefix (keys computed from the target's real
    features, indices <= s) and the chain's own earlier draft steps, one per step j at index s + j.
    """
    q = torch.arange(width, device=device)[:, None]
    k = torch.arange(width, device=device)[None, :]
    allowed = torch.cat([k <= q - step, *[k == q - step + j for j in range(1, step + 1)]], dim=1)
    mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[None, None]


def unroll(head: torch.nn.Module, tokens: torch.Tensor, feats: torch.Tensor, positions: torch.Tensor,
           steps: int) -> list[torch.Tensor]:
    """Outputs of draft steps 1..steps, each [B, W, H]; entry k at index i predicts F_{i+1} from a chain started at i-k.

    1. Step 0 reads the target's features under a causal mask and caches its keys.
    2. Step k reads step k-1's outputs shifted by one position (the feature the chain itself
       predicted) with the same teacher-forced tokens, attending as `ttt_mask` says.
    """
    if steps == 1:
        return [head(tokens, feats, positions)]
    cache = DynamicCache()
    outs: list[torch.Tensor] = []
    cur = feats
    for k in range(steps):
        mask = ttt_mask(tokens.shape[1], k, cur.dtype, cur.device)
        outs.append(head(tokens, cur, positions, attention_mask=mask, cache=cache))
        cur = torch.cat([outs[-1][:, :1], outs[-1][:, :-1]], dim=1)  # index 0 has no predecessor; never counted
    return outs


def step_valid(counts: torch.Tensor, k: int) -> torch.Tensor:  # [B, W]: prediction counts and its chain start too
    valid = counts.clone()
    valid[:, :k] = False
    valid[:, k:] &= counts[:, : counts.shape[1] - k]
    return valid


def chain_loss(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor], *, ttt_steps: int,
               ttt_decay: float, feature_noise: float, cls_weight: float = 1.0,
               reg_weight: float = 0.0, loss: str = "cross_entropy") -> tuple[torch.Tensor, dict[str, float]]:
    """The loss of a head that drafts a chain step by step (EAGLE-1 and EAGLE-3 alike).

    1. Target features (no grad). 2. Noisy features in, the head's outputs out, for each TTT step.
    3. Per step: cls_weight x `loss` (soft CE by default, `divergence.head_loss`) of the head's draft logits
       (`draft_logits`) against the target's distribution over the draft vocabulary, plus reg_weight x SmoothL1
       between the output and the target's next feature (EAGLE-1, whose outputs live in the target's feature
       space), on the positions that count; step k weighs ttt_decay**k."""
    model = extract_model_from_parallel(head)  # DDP hides the head's own methods
    features = batch_features(target, batch, model.config.aux_layers)  # [B, T, D]
    tokens, feats, positions, counts = chain_inputs(batch, features)
    last = last_layer(features, model.config.hidden_size)  # [B, T, H]: F, what the target's LM head reads
    if feature_noise > 0:
        feats = feats + (torch.rand_like(feats) - 0.5) * 2 * feature_noise
    outs = unroll(head, tokens, feats, positions, ttt_steps)
    wanted = last[:, 1:][counts]  # [M0, H]: every step predicts the same next features, on fewer positions
    with torch.no_grad():  # so the target's distribution is computed once for all steps
        target_logits = target_draft_logits(target, wanted, model.draft_ids)  # [M0, Vd]
    total, stats, norm = 0.0, {}, 0.0
    for k, pred in enumerate(outs):
        valid = step_valid(counts, k)
        keep = valid[counts]  # [M0]: which of the counted positions step k predicts
        step_target = target_logits[keep]  # [M, Vd]
        got = pred[valid]  # [M, H]
        logits = model.draft_logits(got)  # [M, Vd]
        ce, agree = head_loss(loss, step_target, logits)
        ce = ce.mean()
        step = cls_weight * ce
        suffix = "" if k == 0 else f"_step{k + 1}"
        if reg_weight > 0:
            reg = F.smooth_l1_loss(got, wanted[keep].to(got.dtype))
            step = step + reg_weight * reg
            stats[f"loss_reg{suffix}"] = float(reg.detach())
        w = ttt_decay ** k
        total = total + w * step
        norm += w
        top1 = agree.float().mean()
        stats |= {f"loss_ce{suffix}": float(ce.detach()), f"top1{suffix}": float(top1)}
    return total / norm, stats


@torch.no_grad()
def chain_eval(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor], steps: int = EVAL_STEPS,
               topk: int = EVAL_TOPK) -> dict[str, torch.Tensor]:
    """Sums over the batch's counted positions: per-step top-1 / top-k agreement of the draft (over its
    vocabulary) with the target's full-vocabulary argmax, drafting as at inference (`unroll`), and the
    chain acceptance length.

    Returns tensors so callers can reduce across processes: correct_top1 [steps], correct_topk [steps],
    positions [steps], accepted (sum of leading correct steps per start position), starts.
    """
    features = batch_features(target, batch, head.config.aux_layers)  # [B, T, D]
    tokens, feats, positions, _ = chain_inputs(batch, features)
    outs = unroll(head, tokens, feats, positions, min(steps, tokens.shape[1]))
    return chain_sums(head, target, batch, features, outs, steps, topk)


def chain_sums(head: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor], features: torch.Tensor,
               outs: list[torch.Tensor], steps: int = EVAL_STEPS, topk: int = EVAL_TOPK) -> dict[str, torch.Tensor]:
    """`chain_eval`'s sums for a chain's step outputs `outs` (each [B, W, H], step k at index i drafting from the
    chain started at i - k), on the target's `features` of the batch."""
    tokens, _, _, counts = chain_inputs(batch, features)
    # every batch returns `depth` steps, so sums add up; a batch narrower than that scores only the steps it fits
    depth = steps
    last = last_layer(features, head.config.hidden_size)  # [B, T, H]
    target_next = target.get_output_embeddings()(last[:, 1:]).argmax(-1)  # [B, W]: target's choice after position i+1
    top1, topk_hits, totals = torch.zeros(depth), torch.zeros(depth), torch.zeros(depth)
    width = tokens.shape[1]
    hits = torch.zeros(depth, *counts.shape, dtype=torch.bool)  # [depth, B, W] step k hit, by chain start
    scored = []
    for k, pred in enumerate(outs):
        ranked = head.token_ids(head.draft_logits(pred).topk(topk, dim=-1).indices)  # [B, W, topk] token ids
        hit = ranked[..., 0] == target_next
        hitk = (ranked == target_next[..., None]).any(-1)
        valid = step_valid(counts, k)
        top1[k], topk_hits[k], totals[k] = (hit & valid).sum(), (hitk & valid).sum(), valid.sum()
        hits[k, :, : width - k] = (hit & valid)[:, k:]  # re-indexed by chain start i - k
        scored.append(token_hits(target_next, hit, k, depth, keep=valid))
    run = torch.cumprod(hits.long(), dim=0)  # still accepted at every step so far
    accepted = run.sum(0)[counts].sum()
    return {"correct_top1": top1, "correct_topk": topk_hits, "positions": totals,
            "accepted": accepted.float().reshape(1), "starts": counts.sum().float().reshape(1),
            TOKEN_HITS: join_hits(scored, depth)}


def chain_eval_row(sums: dict[str, torch.Tensor]) -> tuple[dict[str, float], None]:
    pos = sums["positions"].clamp(min=1)
    row = {f"eval/top1_step{i + 1}": float(x) for i, x in enumerate(sums["correct_top1"] / pos)}
    row |= {f"eval/top{EVAL_TOPK}_step{i + 1}": float(x) for i, x in enumerate(sums["correct_topk"] / pos)}
    row["eval/simulated_tau_chain"] = 1.0 + float(sums["accepted"][0] / sums["starts"][0].clamp(min=1))
    return row, None
