"""Loss weights over a drafted block's positions: later positions count only if the earlier ones are accepted.

A block drafter's slot j is worth something only when slots 1..j-1 were accepted, so training may spend its loss
where acceptance can reach. The weightings:

- `uniform`: every trained slot alike (P-EAGLE's default: its drop-token sample already thins the deeper slots).
- `decay`: slot j weighs exp(-(j - 1) / gamma), fixed (DFlash's own).
- `dpace` (D-PACE): slot j weighs the expected number of accepted slots from j on, given the block's current
  confidences c_i: w_j = Σ_{k ≥ j} Π_{i ≤ k} ((1 - a) c_i + a), over the block's counted slots, with the
  confidences held constant (no gradient) and a smoothing every factor towards 1 (a = 1: uniform weights). Our
  confidence of a slot is its acceptance probability Σ_v min(p_v, q_v), the overlap of the target's and the
  drafter's distributions; against a one-hot target that is q(y), speculators' exp(-CE).

Any of them may be cut at each block's first failure (`accept_until_fail`, AUF: Yang and Li 2026, arXiv 2607.01893;
speculators' `--auf`): a slot after the first one whose greedy draft misses the target's greedy token is never
reached at decode time, so its loss is dropped; the failing slot itself keeps its loss (it is the one to mend). The
failure test reads argmaxes (the target's over the draft vocabulary, where the drafter can answer), so it carries
no gradient; slots that do not count are neither failures nor kept, as in speculators. The kept entries are
normalised by the sum of their weights, as every weighting here is (speculators' `--normalize-loss-by-decay`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specheads.checked import Checked

WEIGHTINGS = ("uniform", "decay", "dpace")


@dataclass(frozen=True)
class PositionWeighting(Checked):
    """The `heads:` keys of a block drafter's slot weights (DFlash, P-EAGLE); `weights` applies them."""

    position_weighting: str = "decay"  # slot weights: "uniform", "decay" (exp(-(j-1) / position_decay)) or "dpace"
    position_decay: float = 4.0  # decay: slot j's loss weight is exp(-(j-1) / position_decay)
    dpace_alpha: float = 0.5  # dpace: smoothing of each slot's confidence towards 1 (position_weights.py)
    accept_until_fail: bool = False  # each block's loss only through its first slot whose argmax misses (AUF)

    def _check(self) -> None:
        if self.position_weighting not in WEIGHTINGS:
            raise ValueError(f"heads.position_weighting must be one of {', '.join(WEIGHTINGS)}, "
                             f"got {self.position_weighting!r}")
        if self.position_decay <= 0:
            raise ValueError(f"heads.position_decay must be > 0, got {self.position_decay}")
        if not 0.0 < self.dpace_alpha <= 1.0:
            raise ValueError(f"heads.dpace_alpha must be in (0, 1], got {self.dpace_alpha}")

    @property
    def all_alike(self) -> bool:
        """Every trained entry weighs the same (a plain mean is the weighted loss)."""
        return self.position_weighting == "uniform" and not self.accept_until_fail

    def weights(self, blocks: torch.Tensor,  # [N, S] bool: block n's slot s is a trained entry
                target_logits: torch.Tensor, draft_logits: torch.Tensor,  # [M, V] the entries', in `blocks` order
                agree: torch.Tensor | None = None  # [M] bool: the two argmaxes agree (computed here when None)
                ) -> torch.Tensor:  # [M] each entry's loss weight
        w = self._slot_weights(blocks, target_logits, draft_logits)
        if self.accept_until_fail:
            if agree is None:
                agree = target_logits.argmax(-1) == draft_logits.argmax(-1)
            w = w * until_fail(blocks, agree)[blocks]
        return w

    def _slot_weights(self, blocks: torch.Tensor, target_logits: torch.Tensor,
                      draft_logits: torch.Tensor) -> torch.Tensor:  # [M]
        if self.position_weighting == "uniform":
            return torch.ones(target_logits.shape[0], device=target_logits.device)
        if self.position_weighting == "decay":
            slot = torch.arange(1, blocks.shape[1] + 1, device=blocks.device).expand_as(blocks)[blocks]
            return decay_weights(slot, self.position_decay)
        confidence = torch.zeros(blocks.shape, device=blocks.device)
        confidence[blocks] = acceptance(target_logits, draft_logits)
        return dpace_weights(confidence, blocks, self.dpace_alpha)[blocks]


def until_fail(blocks: torch.Tensor,  # [N, S] bool: the slots that count
               agree: torch.Tensor  # [M] bool, the counted slots' in order: the drafter's argmax is the target's
               ) -> torch.Tensor:  # [N, S] bool: counted slots up to and including each block's first failure
    failed = torch.zeros(blocks.shape, dtype=torch.int32, device=blocks.device)
    failed[blocks] = (~agree).to(torch.int32)
    failures_before = failed.cumsum(-1) - failed
    return blocks & (failures_before == 0)


def decay_weights(slot: torch.Tensor, gamma: float) -> torch.Tensor:  # [...] slot numbers from 1 -> [...]
    return torch.exp(-(slot - 1).float() / gamma)


@torch.no_grad()
def dpace_weights(confidence: torch.Tensor,  # [N, S] each block's slots in order, in [0, 1]
                  mask: torch.Tensor,  # [N, S] the slots that count
                  alpha: float) -> torch.Tensor:  # [N, S], 0 where the mask is
    mask = mask.to(confidence.dtype)
    smooth = torch.where(mask > 0, (1.0 - alpha) * confidence.float() + alpha, torch.ones_like(mask))
    prefix = torch.cumprod(smooth, dim=-1)  # Π_{i ≤ k}
    return (prefix * mask).flip(-1).cumsum(-1).flip(-1) * mask  # Σ_{k ≥ j}, counted slots only


@torch.no_grad()
def acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor) -> torch.Tensor:  # [..., V] x2 -> [...]
    """Σ_v min(p_v, q_v): the chance one token drafted from q is accepted by speculative sampling from p."""
    p = torch.softmax(target_logits.float(), dim=-1)
    return torch.minimum(p, torch.softmax(draft_logits.float(), dim=-1)).sum(-1)
