"""The Medusa-1 objective: heads on the frozen target's last hidden state, trained on the target's own choices."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from accelerate.utils import extract_model_from_parallel

from specheads.heads.medusa import KIND_NAME, MedusaConfig, MedusaHeads, medusa_loss
from specheads.static_trees import build_static_tree
from specheads.train.class_top1 import TOKEN_HITS, TokenHits, join_hits, token_hits
from specheads.train.features import batch_features
from specheads.train.objective import Objective, register_objective

EVAL_TOPK = 10  # choices per head whose accuracy is measured (the static tree is built from them)
TREE_NODES = 16  # verify budget of the static tree stored with the heads (CPU-friendly)


@dataclass(frozen=True)
class MedusaHeadsConfig:
    """The `heads:` section of a medusa recipe."""

    RENAMED: ClassVar[dict[str, str]] = {"medusa_heads": "num_heads", "medusa_layers": "num_layers",
                                         "medusa_decay": "decay"}

    num_heads: int = 4  # K: head k guesses the token k + 2 positions ahead
    num_layers: int = 1  # residual blocks per head
    decay: float = 0.8  # head k's loss weight is decay**k
    own_lm_head: bool = False  # train an LM head per head (initialised from the target's) instead of sharing it

    def __post_init__(self) -> None:
        if self.num_heads < 1 or self.num_layers < 1:
            raise ValueError(f"heads.num_heads and heads.num_layers must be >= 1, got {self.num_heads}, "
                             f"{self.num_layers}")
        if not 0.0 < self.decay <= 1.0:
            raise ValueError(f"heads.decay must be in (0, 1], got {self.decay}")


def build_medusa(settings: MedusaHeadsConfig, target: torch.nn.Module,
                 draft_vocab: list[int] | None = None) -> MedusaHeads:
    config = MedusaConfig.for_target(target, num_heads=settings.num_heads, num_layers=settings.num_layers,
                                     own_lm_head=settings.own_lm_head,
                                     draft_vocab=None if draft_vocab is None else tuple(draft_vocab))
    return MedusaHeads.for_target(config, target)


@torch.no_grad()
def features_and_labels(target: torch.nn.Module, batch: dict[str, torch.Tensor]):
    """Features [B, T, H] and labels [B, T] where labels[j] is the target's greedy choice for token j.

    Training on the target's own argmax (self-distillation on the teacher-forced text) teaches the
    heads what greedy verification will accept, not what the data's authors wrote.
    """
    features = batch_features(target, batch)
    choice = target.get_output_embeddings()(features).argmax(-1)  # [B, T]: prediction for token t+1
    labels = torch.cat([batch["input_ids"][:, :1], choice[:, :-1]], dim=1)
    return features, labels


def medusa_step_loss(heads: torch.nn.Module, target: torch.nn.Module, batch: dict[str, torch.Tensor],
                     settings: MedusaHeadsConfig) -> tuple[torch.Tensor, dict[str, float]]:
    features, labels = features_and_labels(target, batch)
    mask = batch["loss_mask"] * batch["attention_mask"]
    draft_ids = extract_model_from_parallel(heads).draft_ids  # DDP hides the heads' own attributes
    loss, accs = medusa_loss(heads(features), labels, mask, decay=settings.decay, draft_ids=draft_ids)
    return loss, {f"top1_head{k}": a for k, a in enumerate(accs)} | {"top1": accs[0]}


@torch.no_grad()
def medusa_eval(heads: MedusaHeads, target: torch.nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums: hits[k, i] = positions where head k's i-th choice is the target's choice; positions[k]."""
    features, labels = features_and_labels(target, batch)
    hits, positions, scored = head_hits(heads, features, labels, batch["loss_mask"] * batch["attention_mask"])
    return {"hits": hits, "positions": positions, TOKEN_HITS: scored}


@torch.no_grad()
def head_hits(heads: MedusaHeads, features: torch.Tensor, labels: torch.Tensor,
              mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, TokenHits]:
    """(hits [K, EVAL_TOPK], positions [K], every scored token) of the heads on `features` [B, T, H] against
    `labels` [B, T], counting the positions whose token has `mask` [B, T] set; head k is draft position k + 1."""
    mask = mask.bool()
    logits = heads(features)  # [K, B, T, V]
    num_heads, _, length, _ = logits.shape
    hits = torch.zeros(num_heads, EVAL_TOPK)
    positions = torch.zeros(num_heads)
    scored = []
    for k in range(num_heads):
        shift = k + 2
        if length <= shift:
            continue
        keep = mask[:, shift:]
        top = heads.token_ids(logits[k, :, : length - shift][keep].topk(EVAL_TOPK, dim=-1).indices)  # [M, topk] ids
        gold = labels[:, shift:][keep]
        hits[k] += (top == gold[:, None]).float().sum(0).cpu()
        positions[k] += gold.numel()
        scored.append(token_hits(gold, top[:, 0] == gold, k, num_heads))
    return hits, positions, join_hits(scored, num_heads)


def medusa_eval_row(sums: dict[str, torch.Tensor]) -> tuple[dict[str, float], list[list[float]]]:
    """Metrics for metrics.jsonl and the accuracy table [K][i] the static tree is built from."""
    acc = (sums["hits"] / sums["positions"].clamp(min=1)[:, None]).tolist()
    row = {f"eval/top1_head{k}": a[0] for k, a in enumerate(acc)}
    row |= {f"eval/top5_head{k}": sum(a[:5]) for k, a in enumerate(acc)}
    # Simulated τ of a top-1 chain if heads erred independently: 1 + Σ_k Π_{j<=k} top1_j.
    run, tau = 1.0, 1.0
    for a in acc:
        run *= a[0]
        tau += run
    row["eval/simulated_tau_chain"] = tau
    return row, acc


def with_measured_tree(heads: MedusaHeads, accuracies: list[list[float]]) -> MedusaConfig:
    """The heads' config with the static tree that maximises expected acceptance under the measured accuracies."""
    return replace(heads.config, tree=build_static_tree(accuracies, TREE_NODES))


register_objective(Objective(
    name=KIND_NAME, kind=KIND_NAME, settings=MedusaHeadsConfig, build=build_medusa, step_loss=medusa_step_loss,
    eval_sums=medusa_eval, eval_row=medusa_eval_row, final_config=with_measured_tree,
))
