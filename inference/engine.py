"""The engine loop: propose -> verify forward -> verify -> commit -> on_verified.

Every method, the plain autoregressive baseline included, runs through the same
`Engine.generate`, with the same cache and sampling code, so speedups compare
like with like.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from specheads.inference.cache import TreeKVCache, cache_kwargs
from specheads.inference.proposers.base import ProposalContext, Proposer
from specheads.inference.sampling import SamplingParams
from specheads.inference.stats import GenerationStats
from specheads.inference.tree import DraftTree
from specheads.inference.verifier import verify

TargetHidden = tuple[torch.Tensor, ...]  # one [1, N, H] tensor per layer (embeddings first), HF's hidden_states


@dataclass
class GenerationResult:
    output_ids: list[int]
    stats: GenerationStats


def tree_attention_mask(tree: DraftTree, prefix_length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive mask [1, 1, N, P+N]: every node sees the whole prefix and its own ancestors."""
    n = tree.size
    mask = torch.zeros(1, 1, n, prefix_length + n, dtype=dtype, device=device)
    blocked = ~tree.ancestors.to(device)
    mask[0, 0, :, prefix_length:].masked_fill_(blocked, torch.finfo(dtype).min)
    return mask


def model_max_context(model: PreTrainedModel) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def tree_forward(
    model: PreTrainedModel,
    cache: TreeKVCache,
    tree: DraftTree,
    *,
    output_hidden_states: bool = False,
):
    """One forward over all tree nodes on top of the cached prefix (positions = prefix + depth)."""
    device = model_device(model)
    prefix = cache.seq_length
    tokens = tree.tokens.to(device)[None]
    positions = (tree.depths.to(device) + prefix)[None]
    # A chain is exactly what the model's own causal mask expresses; only branching trees need ours.
    mask = None if tree.is_chain else tree_attention_mask(tree, prefix, model.dtype, device)
    return model(
        **cache_kwargs(model, cache),
        input_ids=tokens,
        position_ids=positions,
        attention_mask=mask,
        output_hidden_states=output_hidden_states,
    )


_checked_models: weakref.WeakSet = weakref.WeakSet()  # models that passed; weak so ids are never reused


@torch.inference_mode()
def check_tree_attention(model: PreTrainedModel) -> None:
    """Fail clearly if the model ignores 4-D attention masks or explicit position ids.

    Feeds a root with two sibling children and compares the second sibling's logits with
    a plain sequential forward over [prefix, root, sibling]; a model that lets siblings
    see each other (or ignores positions) disagrees.
    """
    if model in _checked_models:
        return
    device = model_device(model)
    vocab = model.config.get_text_config().vocab_size
    a, b, c, d = (int(x) % vocab for x in (11, 12, 13, 14))
    try:
        cache = TreeKVCache(model.config, capacity=8)
        model(input_ids=torch.tensor([[a]], device=device), **cache_kwargs(model, cache))
        tree = DraftTree(tokens=torch.tensor([b, c, d]), parents=torch.tensor([-1, 0, 0]))
        tree_logits = tree_forward(model, cache, tree).logits[0, 2].float()
        ref_logits = model(input_ids=torch.tensor([[a, b, d]], device=device)).logits[0, 2].float()
    except (TypeError, ValueError, RuntimeError) as err:
        raise ValueError(
            f"{type(model).__name__} cannot run tree verification (4-D attention mask with explicit "
            f"position_ids): {err}. Use a model whose attention accepts custom masks (e.g. attn_implementation='sdpa' or 'eager')"
        ) from err
    tol = 1e-3 if model.dtype == torch.float32 else 5e-2
    scale = ref_logits.abs().max().clamp(min=1.0)
    if not torch.allclose(tree_logits, ref_logits, atol=float(tol * scale), rtol=0):
        raise ValueError(
            f"{type(model).__name__} ignores the 4-D tree attention mask or position_ids (its logits for a "
            "tree node differ from a sequential forward), so speculative outputs would be wrong. "
            "Load it with attn_implementation='sdpa' or 'eager', or use method 'ar'"
        )
    _checked_models.add(model)


FallbackHandler = Callable[[str, Exception], None]  # (reason, error): told of each step that fell back


def check_proposal(tree: DraftTree, ctx: ProposalContext, vocab_size: int) -> None:
    """Raise ValueError if a proposer's tree cannot be verified as the next step: its root must be the last committed
    token (a wrong root would be fed to the target as if committed) and every token an id of the target's vocabulary."""
    if int(tree.tokens[0]) != int(ctx.tokens[-1]):
        raise ValueError(f"the tree's root is token {int(tree.tokens[0])}, not the last committed token "
                         f"{int(ctx.tokens[-1])}")
    low, high = int(tree.tokens.min()), int(tree.tokens.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"the tree holds token ids in [{low}, {high}], outside the target's vocabulary of {vocab_size}")


class Engine:
    """Speculative decoding for one HF causal LM target with one proposer (batch size 1).

    With `fallback`, a proposer that raises or returns a tree `check_proposal` refuses makes that step a plain
    (root-only) step, which is exact like any other, and `fallback` is told the reason; without it the error
    propagates (benchmarks and tests want proposer bugs loud)."""

    def __init__(self, model: PreTrainedModel, proposer: Proposer, *, max_context: int | None = None,
                 fallback: FallbackHandler | None = None) -> None:
        self.model = model.eval()
        self.proposer = proposer
        self.device = model_device(model)
        self.max_context = max_context or model_max_context(model)
        self.fallback = fallback
        self.vocab_size = model.config.get_text_config().vocab_size
        check_tree_attention(model)

    def _next_tree(self, ctx: ProposalContext, result, hidden: TargetHidden | None, stats: GenerationStats) -> DraftTree:
        if self.fallback is None:
            self.proposer.on_verified(result, hidden)
            return self.proposer.propose(ctx).truncated(ctx.max_depth)
        try:
            self.proposer.on_verified(result, hidden)
            tree = self.proposer.propose(ctx)
        except Exception as err:  # noqa: BLE001 - whatever the proposer's failure, this step decodes plainly
            return self._plain_step("proposer_error", err, ctx, stats)
        try:
            check_proposal(tree, ctx, self.vocab_size)
        except ValueError as err:
            return self._plain_step("malformed_tree", err, ctx, stats)
        return tree.truncated(ctx.max_depth)

    def _plain_step(self, reason: str, err: Exception, ctx: ProposalContext, stats: GenerationStats) -> DraftTree:
        stats.fallbacks += 1
        self.fallback(reason, err)
        return DraftTree.root_only(ctx.tokens[-1])

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        *,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: Iterable[int] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
        should_stop: Callable[[], str | None] | None = None,
    ) -> GenerationResult:
        """Generate up to max_new_tokens after the prompt; `on_tokens` receives each step's new tokens, and
        `should_stop`, asked after each step, ends the generation with the finish reason it returns (e.g. a
        timeout or a client gone).

        1. Prefill the whole prompt; its last token is the first (root-only) tree, so the prefill
           forward is step 1 and yields the first token.
        2. Each further step: propose a tree rooted at the last committed token, verify it in one
           target forward, commit the accepted path in the cache, hand the result to the proposer.
        3. Stop at a stop token (kept in the output), max_new_tokens, or the model's context length.
        """
        start = time.perf_counter()
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()
        n_prompt = prompt.shape[0]
        if n_prompt == 0:
            raise ValueError("the prompt is empty; pass at least one token")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if self.max_context is not None and n_prompt >= self.max_context:
            raise ValueError(
                f"the prompt has {n_prompt} tokens but the model's context holds {self.max_context}; "
                "shorten the prompt (it is never truncated silently)"
            )
        stops = set(int(t) for t in stop_token_ids)
        limit = n_prompt + max_new_tokens
        if self.max_context is not None:
            limit = min(limit, self.max_context)
        tokens = torch.empty(limit + 1, dtype=torch.long)
        tokens[:n_prompt] = prompt
        n = n_prompt
        stats = GenerationStats()
        generator = sampling.generator(self.device)
        needs_hidden = bool(self.proposer.needs_target_hidden)

        def context() -> ProposalContext:
            room = limit - n  # tokens that may still be committed, the bonus included
            return ProposalContext(tokens=tokens[:n], num_prompt_tokens=n_prompt, max_depth=max(room - 1, 0),
                                   sampling=sampling, generator=generator)

        cache = TreeKVCache(self.model.config, capacity=limit + 16)
        # Step 1 is the prefill itself: one forward over the whole prompt, whose last token is the first
        # (root-only) tree, gives the first token. Proposers start from the prompt's other positions.
        out = self.model(input_ids=prompt[None].to(self.device), **cache_kwargs(self.model, cache),
                         logits_to_keep=1, output_hidden_states=needs_hidden)
        hidden = out.hidden_states if needs_hidden else None
        self.proposer.start(context(), tuple(h[:, :-1] for h in hidden) if hidden and n_prompt > 1 else None)
        hidden = tuple(h[:, -1:] for h in hidden) if hidden else None
        tree = DraftTree.root_only(int(prompt[-1]))
        prefix = n_prompt - 1

        output: list[int] = []
        while True:
            result = verify(tree, out.logits[0, -tree.size :], sampling, generator)
            cache.commit(prefix, result.path)
            new = result.tokens.tolist()
            stats.record_step(tree.num_drafted, result.num_accepted)
            for i, tok in enumerate(new):
                if tok in stops:
                    new = new[: i + 1]
                    stats.finish_reason = "stop"
                    break
            if len(new) >= limit - n:
                new = new[: limit - n]
                stats.finish_reason = stats.finish_reason or (
                    "length" if limit == n_prompt + max_new_tokens else "context")
            tokens[n : n + len(new)] = torch.tensor(new, dtype=torch.long)
            n += len(new)
            output.extend(new)
            if stats.steps == 1:
                stats.ttft_s = time.perf_counter() - start
            if on_tokens is not None:
                on_tokens(new)
            if not stats.finish_reason and should_stop is not None:
                stats.finish_reason = should_stop() or ""
            if stats.finish_reason:
                break
            drafting = time.perf_counter()
            tree = self._next_tree(context(), result, hidden, stats)
            stats.draft_s += time.perf_counter() - drafting
            prefix = cache.seq_length
            out = tree_forward(self.model, cache, tree, output_hidden_states=needs_hidden)
            hidden = out.hidden_states if needs_hidden else None
        stats.new_tokens = len(output)
        stats.wall_s = time.perf_counter() - start
        return GenerationResult(output_ids=output, stats=stats)
