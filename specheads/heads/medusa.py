"""Medusa heads: K small residual heads that read the target's last hidden state and guess further ahead.

At the hidden state h of token x_t the target's LM head predicts x_{t+1}; Medusa head k
(k = 0..K-1) predicts x_{t+k+2}. Each head is `num_layers` residual blocks followed by
an LM head: either the target's own (shared, frozen, not saved) or a trainable copy.

With a `draft_vocab` (see `draft_vocab.py`) every LM head scores only those tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specheads.heads.draft_vocab import check_draft_vocab
from specheads.int8 import input_dtype
from specheads.kinds import DrafterKind, register_kind
from specheads.static_trees import validate_tree
from specheads.target_logits import LogitMap, logit_map

KIND_NAME = "medusa"
_SHARED_PREFIX = "target_lm_head."  # the target's own LM head: frozen, never saved


@dataclass(frozen=True)
class MedusaConfig:
    """What a set of Medusa heads is; saved as its checkpoint's `config`."""

    hidden_size: int  # the target's hidden size H
    vocab_size: int  # rows of the target's LM head
    num_heads: int = 4  # K: head k guesses the token k + 2 positions after the hidden state's token
    num_layers: int = 1  # residual blocks per head
    own_lm_head: bool = False  # a trainable LM head per head (initialised from the target's) instead of sharing it
    draft_vocab: tuple[int, ...] | None = None  # token ids the heads score, sorted; None: the whole vocabulary
    tree: tuple[tuple[int, ...], ...] | None = None  # static tree to draft (paths of top-k indices),
    # measured in training

    def __post_init__(self) -> None:
        for name in ("hidden_size", "vocab_size", "num_heads", "num_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"medusa {name} must be an integer >= 1, got {value!r}")
        if not isinstance(self.own_lm_head, bool):
            raise ValueError(f"medusa own_lm_head must be true or false, got {self.own_lm_head!r}")
        object.__setattr__(self, "draft_vocab", check_draft_vocab(self.draft_vocab, self.vocab_size, KIND_NAME))
        if self.tree is not None:
            object.__setattr__(self, "tree", tuple(tuple(p) for p in validate_tree(self.tree)))

    @property
    def scored_vocab_size(self) -> int:
        return self.vocab_size if self.draft_vocab is None else len(self.draft_vocab)

    @classmethod
    def for_target(cls, model: nn.Module, **kwargs) -> MedusaConfig:
        """A config sized for `model` (hidden size from its config, vocab from its output embeddings)."""
        return cls(hidden_size=int(model.config.get_text_config().hidden_size),
                   vocab_size=int(model.get_output_embeddings().weight.shape[0]), **kwargs)


class ResBlock(nn.Module):
    """x + silu(linear(x)); zero weight and bias make a fresh block the identity (silu(0) = 0),
    so an untrained head starts as the target's own next-token predictor."""

    def __init__(self, hidden_size: int, *, device: torch.device | None = None,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size, device=device, dtype=dtype)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: [..., H]
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads for one target; `forward(hidden [B, T, H]) -> logits [K, B, T, Vd]` over the
    draft vocabulary (Vd = V without one); `token_ids` maps logit indices back to token ids."""

    def __init__(self, config: MedusaConfig, target_lm_head: nn.Module, logits: LogitMap = LogitMap()) -> None:
        """`target_lm_head` is the target's output embedding (H -> V) and `logits` what the target does to its
        output (`specheads.target_logits`; `for_target` reads it). Shared heads use the LM head as is, frozen (the
        target is frozen by design), and apply the whole map; own heads copy its weights times the map's scale."""
        super().__init__()
        weight = target_lm_head.weight
        if tuple(weight.shape) != (config.vocab_size, config.hidden_size):
            raise ValueError(f"the target LM head is {tuple(weight.shape)} (vocab, hidden) but the medusa config says "
                             f"({config.vocab_size}, {config.hidden_size}); "
                             "build the config with MedusaConfig.for_target")
        self.config = config
        # Shared heads score as the target does; own heads start there, but their soft cap would not survive export.
        self.logit_map = logits if not config.own_lm_head else LogitMap()
        # New weights follow the target's device and dtype, so the heads run on its hidden states as they come.
        factory = dict(device=weight.device, dtype=weight.dtype)
        bias = getattr(target_lm_head, "bias", None)
        ids = None if config.draft_vocab is None else torch.tensor(config.draft_vocab, device=weight.device)
        self.register_buffer("draft_ids", ids, persistent=False)  # [Vd] or None; the config is its record
        self.blocks = nn.ModuleList(
            nn.Sequential(*(ResBlock(config.hidden_size, **factory) for _ in range(config.num_layers)))
            for _ in range(config.num_heads)
        )
        scored = config.scored_vocab_size
        if config.own_lm_head:
            self.lm_heads = nn.ModuleList()
            for _ in range(config.num_heads):
                head = nn.Linear(config.hidden_size, scored, bias=bias is not None, **factory)
                with torch.no_grad():
                    head.weight.copy_((weight if ids is None else weight[ids]) * logits.scale)
                    if bias is not None:
                        head.bias.copy_((bias if ids is None else bias[ids]) * logits.scale)
                self.lm_heads.append(head)
            self.target_lm_head = None
        elif ids is None:
            self.lm_heads = None
            self.target_lm_head = target_lm_head.requires_grad_(False)
        else:
            # The target's rows for the draft vocabulary, copied once (frozen, never saved): a gather per step would
            # cost as much as the product itself.
            target_lm_head.requires_grad_(False)
            self.lm_heads = None
            self.target_lm_head = nn.Linear(config.hidden_size, scored, bias=bias is not None,
                                            **factory).requires_grad_(False)
            with torch.no_grad():
                self.target_lm_head.weight.copy_(weight[ids])
                if bias is not None:
                    self.target_lm_head.bias.copy_(bias[ids])

    @property
    def num_heads(self) -> int:
        return self.config.num_heads

    def forward(
        self,
        hidden: torch.Tensor,  # [B, T, H] the target's last hidden states (after its final norm)
        num_heads: int | None = None,  # run only the first n heads (a shallow tree needs no more)
    ) -> torch.Tensor:  # [K, B, T, V] (K = num_heads when given)
        n = self.config.num_heads if num_heads is None else num_heads
        assert 1 <= n <= self.config.num_heads, (n, self.config.num_heads)
        x = hidden.to(input_dtype(self.blocks[0][0].linear))
        out = []
        for k in range(n):
            h = self.blocks[k](x)
            lm_head = self.lm_heads[k] if self.lm_heads is not None else self.target_lm_head
            out.append(self.logit_map(lm_head(h.to(input_dtype(lm_head)))))
        return torch.stack(out)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:  # indices into forward's last dim -> token ids
        return index if self.draft_ids is None else self.draft_ids[index]

    @classmethod
    def for_target(cls, config: MedusaConfig, target: nn.Module) -> MedusaHeads:
        return cls(config, target.get_output_embeddings(), logit_map(target.config))


register_kind(DrafterKind(
    name=KIND_NAME, config=MedusaConfig, build=MedusaHeads.for_target, module=MedusaHeads,
    shared_prefixes=(_SHARED_PREFIX,),
    summary="Medusa heads: K residual heads on the target's last hidden state, drafting a static top-k tree",
))


def medusa_loss(
    logits: torch.Tensor,  # [K, B, T, V] heads' logits at every position
    input_ids: torch.Tensor,  # [B, T] the tokens the hidden states were computed on
    loss_mask: torch.Tensor,  # [B, T] 1 where a token is a training target (e.g. assistant tokens)
    decay: float = 0.8,
    draft_ids: torch.Tensor | None = None,  # [Vd] token id of each logit column; None: the whole vocabulary
) -> tuple[torch.Tensor, list[float]]:
    """Medusa-1 loss: sum_k decay**k * CE(head k at t, token t + k + 2), and per-head top-1 accuracy.

    1. For head k, pair positions t = 0..T-k-3 with targets input_ids[:, t + k + 2]; positions whose
       target would fall beyond T have nothing to predict and are dropped.
    2. Keep pairs whose target token has loss_mask 1; CE is the mean over them (0 when none).
    3. Weight head k by decay**k (later heads are less accurate and matter less to acceptance).
    With `draft_ids`, targets outside the draft vocabulary cannot be scored: they leave the CE but
    count as misses in the accuracy. Accuracy is NaN for a head with no kept pair, so it is not
    mistaken for a measured zero.
    """
    num_heads, batch, length, vocab = logits.shape
    assert input_ids.shape == (batch, length) and loss_mask.shape == (batch, length), (input_ids.shape, loss_mask.shape)
    total = logits.new_zeros((), dtype=torch.float32)
    accuracies: list[float] = []
    column = None  # [V'] logit column of each token id, -1 outside the draft vocabulary
    if draft_ids is not None:
        ids = draft_ids.to(input_ids.device)
        column = torch.full((max(int(ids.max()), int(input_ids.max())) + 1,), -1, dtype=torch.long, device=ids.device)
        column[ids] = torch.arange(len(ids), device=ids.device)
    for k in range(num_heads):
        shift = k + 2
        if length <= shift:
            total = total + 0.0 * logits[k].sum()  # keeps every head in the graph (DDP wants all parameters used)
            accuracies.append(float("nan"))
            continue
        keep = loss_mask[:, shift:].bool()  # [B, T-shift]
        pred = logits[k, :, : length - shift][keep].float()  # [M, V]; select first so only kept rows go fp32
        gold = input_ids[:, shift:][keep]  # [M]
        if gold.numel() == 0:
            total = total + 0.0 * logits[k].sum()
            accuracies.append(float("nan"))
            continue
        if column is not None:
            gold = column[gold]  # -1: not in the draft vocabulary, never predicted
        scored = gold >= 0
        ce = F.cross_entropy(pred[scored], gold[scored]) if scored.any() else 0.0 * pred.sum()
        total = total + decay**k * ce
        accuracies.append((pred.argmax(dim=-1) == gold).float().mean().item())
    return total, accuracies
