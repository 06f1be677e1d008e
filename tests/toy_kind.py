"""A toy drafter kind, added with the registries only: docs/adding-a-drafter.md walks through this file.

The toy head guesses the token after next from the target's last hidden state with one linear layer (a
one-head Medusa). A real kind puts each part in its own layer's file and registers it at the end of that
file; here the three parts sit in one file and `register()` adds them (and `unregister()` takes them out
again), so a test can add the kind and leave the registries as it found them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specheads.formats.load import load_heads
from specheads.inference.engine.proposer import ProposalContext
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods import METHODS, Method
from specheads.inference.proposers.lookup import HeadsOptions, with_heads_options
from specheads.kinds import KINDS, DrafterKind
from specheads.train.features import batch_features
from specheads.train.objective import OBJECTIVES, Objective

NAME = "toy"

# --- 1. the core (specheads/heads/toy.py): config, module, kind ----------------------------------------------


@dataclass(frozen=True)
class ToyConfig:
    """What a toy head is; saved as its checkpoint's `config` and read back strictly."""

    hidden_size: int  # the target's hidden size H
    vocab_size: int  # rows of the target's LM head


class ToyHead(nn.Module):
    def __init__(self, config: ToyConfig, target: nn.Module) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        with torch.no_grad():  # start as the target's own next-token guess: train from there
            self.proj.weight.copy_(target.get_output_embeddings().weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [..., H] -> [..., V] logits of the token after next
        return self.proj(hidden)


KIND = DrafterKind(name=NAME, config=ToyConfig, build=ToyHead, module=ToyHead,
                   summary="toy: one linear layer guessing the token after next")

# --- 2. training (train/toy.py): settings and objective ------------------------------------------------------


@dataclass(frozen=True)
class ToyHeadsConfig:
    """The `heads:` section of a toy recipe."""

    label_smoothing: float = 0.0  # of the cross-entropy against the token two positions ahead

    def __post_init__(self) -> None:
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValueError(f"heads.label_smoothing must be in [0, 1), got {self.label_smoothing}")


def build_toy(settings: ToyHeadsConfig, target: nn.Module, draft_vocab: list[int] | None) -> ToyHead:
    vocab, hidden = target.get_output_embeddings().weight.shape
    return ToyHead(ToyConfig(hidden_size=hidden, vocab_size=vocab), target)


def _pairs(head: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor]):
    """Logits at every position t and the tokens at t + 2 they guess, where those are assistant tokens."""
    logits = head(batch_features(target, batch))[:, :-2]  # [B, T-2, V]
    keep = (batch["loss_mask"] * batch["attention_mask"])[:, 2:].bool()  # [B, T-2]
    return logits[keep].float(), batch["input_ids"][:, 2:][keep]


def toy_step_loss(head, target, batch, settings: ToyHeadsConfig):
    logits, gold = _pairs(head, target, batch)
    loss = F.cross_entropy(logits, gold, label_smoothing=settings.label_smoothing)
    return loss, {"top1": float((logits.argmax(-1) == gold).float().mean())}


@torch.no_grad()
def toy_eval_sums(head, target, batch) -> dict[str, torch.Tensor]:
    logits, gold = _pairs(head, target, batch)
    return {"hits": (logits.argmax(-1) == gold).sum().float().reshape(1), "positions": torch.tensor([float(len(gold))])}


def toy_eval_row(sums: dict[str, torch.Tensor]):
    return {"eval/top1": float(sums["hits"][0] / sums["positions"][0].clamp(min=1))}, None


OBJECTIVE = Objective(name=NAME, kind=NAME, settings=ToyHeadsConfig, build=build_toy, step_loss=toy_step_loss,
                      eval_sums=toy_eval_sums, eval_row=toy_eval_row)

# --- 3. decoding (inference/proposers/toy.py): proposer, options, method -------------------------------------


class ToyProposer:
    """Drafts one token: the head's guess for the token after the root, read from the target's hidden state of
    the token before the root (the prompt's second-last token, then each step's last accepted node)."""

    needs_target_hidden = True

    def __init__(self, head: ToyHead) -> None:
        self.head = head.eval()
        self.guess: int | None = None

    @torch.inference_mode()
    def _read(self, hidden: torch.Tensor) -> int:  # [H] -> token id
        return int(self.head(hidden).argmax())

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self.guess = None if target_hidden is None else self._read(target_hidden[-1][0, -1])

    def propose(self, ctx: ProposalContext) -> DraftTree:
        root = int(ctx.tokens[-1])
        if self.guess is None or ctx.max_depth < 1:
            return DraftTree.root_only(root)
        return DraftTree(tokens=torch.tensor([root, self.guess]), parents=torch.tensor([-1, 0]))

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self.guess = self._read(target_hidden[-1][0, int(result.path[-1])])


@dataclass(frozen=True, kw_only=True)
class ToyOptions(HeadsOptions):  # --heads DIR and --lookup N, as every heads method
    pass


def build_toy_proposer(target, options: ToyOptions, load_draft):
    head = load_heads(options.heads, target, kind=NAME)
    return with_heads_options(ToyProposer(head), target, options)


METHOD = Method(name=NAME, summary=KIND.summary, options=ToyOptions, build=build_toy_proposer, arg="heads",
                arg_hint="DIR")

# --- registration: one per layer ----------------------------------------------------------------------------


def register() -> None:
    KINDS.register(NAME, KIND)
    OBJECTIVES.register(NAME, OBJECTIVE)
    METHODS.register(NAME, METHOD)


def unregister() -> None:
    for registry in (KINDS, OBJECTIVES, METHODS):
        registry.unregister(NAME)
