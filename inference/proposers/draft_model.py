"""`draft`: a smaller causal LM with the target's vocabulary drafts a chain or a top-k tree.

The draft model keeps its own KV cache. Each step it first catches up on the
committed tokens it has not seen (always including the new root), then drafts
depth by depth: `width` tokens at the root (top-k when greedy, sampled without
replacement otherwise), then one token per branch per level, all branches in one
forward with a tree mask. After verification its cache is committed to the
accepted path, like the target's, so nothing is recomputed.

The self-drafter `early-exit:N` (the target's first N layers with its final norm and LM head, sharing the
target's weights) and the vocabulary checks are models' matters, in `specheads.draft_models`.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specheads.draft_models import (
    EARLY_EXIT,
    check_parallel_vocabulary,
    check_vocab_size,
    early_exit_model,
    parallel_spec,
    vocab_size,
)
from specheads.inference.engine.cache import TreeKVCache, cache_kwargs
from specheads.inference.engine.proposer import ProposalContext
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods import DraftLoader
from specheads.inference.methods.draft import DraftConfig, DraftOptions
from specheads.inference.proposers.parallel_draft import ParallelDraftProposer
from specheads.int8 import quantize_linears


class DraftModelProposer:
    """Drafts with any HF causal LM that shares the target's vocabulary."""

    needs_target_hidden = False

    def __init__(self, model: PreTrainedModel, config: DraftConfig = DraftConfig(),
                 target_vocab_size: int | None = None) -> None:
        if target_vocab_size is not None:
            check_vocab_size(model, target_vocab_size)
        self.model = model.eval()
        self.config = config
        self.device = next(model.parameters()).device
        self._cache: TreeKVCache | None = None
        self._n_cached = 0  # committed tokens already in the draft cache
        self._fed: list[int] = []  # tree nodes whose KV entries follow the root in the draft cache, in order

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        capacity = ctx.tokens.shape[0] + ctx.max_depth + self.config.width * self.config.depth + 16
        self._cache = TreeKVCache(self.model.config, capacity=capacity)
        self._n_cached = 0
        self._fed = []

    def _forward(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        assert self._cache is not None, "start() must be called before propose()"
        out = self.model(**cache_kwargs(self.model, self._cache), input_ids=tokens[None].to(self.device),
                         position_ids=positions[None].to(self.device), attention_mask=mask,
                         logits_to_keep=tokens.shape[0])
        return out.logits[0]

    @torch.inference_mode()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        """1. Catch up on unseen committed tokens. 2. Pick `width` root children. 3. Extend each branch greedily
        (or by sampling) one level per forward, up to `depth`."""
        assert self._cache is not None, "start() must be called before propose()"
        total = ctx.tokens.shape[0]
        depth = min(self.config.depth, ctx.max_depth)
        pending = ctx.tokens[self._n_cached :]
        logits = self._forward(pending, torch.arange(self._n_cached, total), None)[-1:]  # [1, V]
        self._n_cached = total
        self._fed = []
        root = int(ctx.tokens[-1])
        if depth < 1:
            return DraftTree.root_only(root)

        sampling, gen = ctx.sampling, ctx.generator
        width = min(self.config.width, logits.shape[-1])
        tokens, parents = [root], [-1]
        rows: list[torch.Tensor] = []  # draft distributions, one per node that got children
        if sampling.greedy:
            first = logits[0].topk(width).indices
        else:
            q = sampling.probs(logits[0])
            first = torch.multinomial(q, width, replacement=False, generator=gen)
            rows.append(q)
        tokens += first.tolist()
        parents += [0] * width
        leaves = list(range(1, width + 1))
        for level in range(2, depth + 1):
            # Feed the current leaves: each sees the prefix, the root and its own branch.
            partial = DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents))
            cols = self._fed + leaves
            mask = None
            if width > 1:
                dtype = self.model.dtype
                mask = torch.zeros(1, 1, len(leaves), total + len(cols), dtype=dtype, device=self.device)
                seen = partial.ancestors[leaves][:, cols].to(self.device)
                mask[0, 0, :, total:].masked_fill_(~seen, torch.finfo(dtype).min)
            positions = torch.full((len(leaves),), total - 1 + level - 1)
            logits = self._forward(torch.tensor([tokens[i] for i in leaves]), positions, mask)  # [W, V]
            self._fed = cols
            if sampling.greedy:
                nxt = logits.argmax(dim=-1)
            else:
                q = sampling.probs(logits)
                nxt = torch.multinomial(q, 1, generator=gen).squeeze(1)
                rows.extend(q.unbind(0))
            new_leaves = []
            for leaf, tok in zip(leaves, nxt.tolist()):
                new_leaves.append(len(tokens))
                tokens.append(tok)
                parents.append(leaf)
            leaves = new_leaves

        draft_probs = None
        if not sampling.greedy:
            # Rows follow node order: root, then each level's branch parents; leaves drew nothing.
            draft_probs = torch.zeros(len(tokens), rows[0].shape[-1], device=rows[0].device)
            owners = [0] + [i for i in range(1, len(tokens)) if i not in leaves]
            draft_probs[owners] = torch.stack(rows)
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), draft_probs=draft_probs)

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        """Keep the draft cache entries of the accepted nodes it has already computed."""
        assert self._cache is not None
        slot = {node: i for i, node in enumerate(self._fed)}
        keep: list[int] = []
        for node in result.path[1:].tolist():
            if node not in slot:
                break
            keep.append(slot[node])
        root_end = self._n_cached  # the root's entry is the last committed one
        self._cache.commit(root_end, torch.tensor(keep, dtype=torch.long, device=self.device))
        self._n_cached = root_end + len(keep)
        self._fed = []


def build(target: PreTrainedModel, options: DraftOptions,
          load_draft: DraftLoader | None) -> DraftModelProposer | ParallelDraftProposer:
    if options.draft.startswith(EARLY_EXIT):
        model = early_exit_model(target, int(options.draft[len(EARLY_EXIT):]))
    else:
        if load_draft is None:
            raise ValueError("method 'draft' needs a draft model loader to load " + options.draft)
        model = load_draft(options.draft)
    spec = parallel_spec(model.config)
    # Vocabulary checks come before int8: an Int8Linear LM head has no weight to count rows of.
    if spec is not None:
        check_parallel_vocabulary(model, spec, vocab_size(target))
    else:
        check_vocab_size(model, vocab_size(target))
    if options.draft_dtype == "int8":
        model = int8_draft(model)
    if spec is not None:
        return ParallelDraftProposer(model, spec, depth=options.depth, width=options.width or 1)
    return DraftModelProposer(model, DraftConfig(depth=options.depth or DraftConfig.depth,
                                                 width=options.width or DraftConfig.width))


def int8_draft(model: PreTrainedModel) -> PreTrainedModel:
    """`model` with int8 linear layers (its LM head included) and everything else in fp32, the dtype int8 products
    return. Modules are replaced in `model` only: an early-exit draft's layers stay shared-weight fp32/bf16 in the
    target."""
    if model.dtype != torch.float32:
        model = model.float()  # new fp32 tensors for the draft; the target's own parameters keep their dtype
    return quantize_linears(model)
