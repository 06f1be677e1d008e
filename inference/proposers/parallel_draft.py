"""A parallel drafter (PARD-style): one draft forward proposes K tokens.

The draft model was trained (`drafter.parallel_k: K` in the distill recipe) to read K-1 placeholder
tokens after the real context and predict the token after the context at the last real position and
the tokens 2..K ahead at the placeholders. Its saved config says so (`specheads_parallel:
{k, mask_token_id}`); the placeholder is an extra embedding row past the target's vocabulary, so the
drafter's LM head has one row more than the target's and that logit is never proposed.

Each step feeds the committed tokens the draft cache has not seen plus K-1 placeholders in one forward,
reads K distributions, and drops the placeholders' cache entries again. Greedy drafting takes a chain of
argmaxes, with `width` alternatives at every depth hung off the chain; sampling draws them without
replacement and hands the verifier the distribution each came from, so verification stays exact.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specheads.draft_models import ParallelSpec
from specheads.inference.engine.cache import TreeKVCache, cache_kwargs
from specheads.inference.engine.proposer import ProposalContext
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult


class ParallelDraftProposer:
    """Drafts up to `spec.k` tokens, a chain or a chain with `width` alternatives per depth, in one forward."""

    needs_target_hidden = False

    def __init__(self, model: PreTrainedModel, spec: ParallelSpec, depth: int | None = None, width: int = 1) -> None:
        depth = spec.k if depth is None else depth
        if not 1 <= depth <= spec.k:
            raise ValueError(f"--depth {depth}: this parallel drafter drafts 1 to {spec.k} tokens per forward "
                             f"(it was trained with parallel_k={spec.k})")
        if width < 1:
            raise ValueError(f"--width must be >= 1, got {width}")
        self.model = model.eval()
        self.spec = spec
        self.depth = depth
        self.width = width
        self.device = next(model.parameters()).device
        self._cache: TreeKVCache | None = None
        self._n_cached = 0  # committed tokens in the draft cache (placeholders never stay there)

    def start(self, ctx: ProposalContext, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        self._cache = TreeKVCache(self.model.config, capacity=ctx.tokens.shape[0] + ctx.max_depth + self.spec.k + 16)
        self._n_cached = 0

    def _distributions(self, ctx: ProposalContext, depth: int) -> torch.Tensor:  # [depth, V] logits
        """One forward over the unseen committed tokens and depth-1 placeholders; the cache keeps only the former."""
        assert self._cache is not None, "start() must be called before propose()"
        total = ctx.tokens.shape[0]
        masks = torch.full((depth - 1,), self.spec.mask_token_id, dtype=ctx.tokens.dtype)
        tokens = torch.cat([ctx.tokens[self._n_cached:], masks])
        positions = torch.arange(self._n_cached, total + depth - 1)
        out = self.model(**cache_kwargs(self.model, self._cache), input_ids=tokens[None].to(self.device),
                         position_ids=positions[None].to(self.device), logits_to_keep=depth)
        self._cache.truncate(total)
        self._n_cached = total
        return out.logits[0, :, : self.spec.mask_token_id]  # the placeholder itself is never a draft

    @torch.inference_mode()
    def propose(self, ctx: ProposalContext) -> DraftTree:
        depth = min(self.depth, ctx.max_depth)
        root = int(ctx.tokens[-1])
        if depth < 1:
            return DraftTree.root_only(root)
        logits = self._distributions(ctx, depth)
        width = min(self.width, logits.shape[-1])
        sampling = ctx.sampling
        tokens, parents, chain = [root], [-1], 0
        probs: dict[int, torch.Tensor] = {}  # node -> the distribution its children were drawn from
        for level in range(depth):
            if sampling.greedy:
                picked = logits[level].topk(width).indices
            else:
                q = sampling.probs(logits[level])
                picked = torch.multinomial(q, width, replacement=False, generator=ctx.generator)
                probs[chain] = q
            first = len(tokens)
            tokens += picked.tolist()
            parents += [chain] * width
            chain = first  # the chain continues from the most likely (or first drawn) token
        draft_probs = None
        if not sampling.greedy:
            draft_probs = torch.zeros(len(tokens), logits.shape[-1], device=logits.device)
            for node, q in probs.items():
                draft_probs[node] = q
        return DraftTree(tokens=torch.tensor(tokens), parents=torch.tensor(parents), draft_probs=draft_probs)

    def on_verified(self, result: VerifyResult, target_hidden: tuple[torch.Tensor, ...] | None) -> None:
        pass  # the accepted tokens are fed with the next step's placeholders
