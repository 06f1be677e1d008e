"""The engine loop: propose -> verify forward -> verify -> commit -> on_verified.

Every method, the plain autoregressive baseline included, runs through the same
`Engine.generate`, with the same cache and sampling code, so speedups compare
like with like.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import dataclass, field, replace

import torch
from transformers import PreTrainedModel

from specheads.inference.engine.batch_cache import BatchKVCache, batch_tree_mask, causal_mask
from specheads.inference.engine.cache import TreeKVCache, cache_kwargs
from specheads.inference.engine.constraint import GrammarConstraint
from specheads.inference.engine.layer_attention import LayerAttention, layer_attention
from specheads.inference.engine.lean_forward import LeanForward, target_forward
from specheads.inference.engine.proposer import (
    ProposalContext,
    Proposer,
    drafts_together,
    finish,
    finished,
    fork,
    propose_rows,
)
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.speculation import AlwaysSpeculate, RowState, Speculation
from specheads.inference.engine.stats import GenerationStats
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import verify

TargetHidden = tuple[torch.Tensor, ...]  # one [1, N, H] tensor per layer (embeddings first), HF's hidden_states


@dataclass
class GenerationResult:
    output_ids: list[int]
    stats: GenerationStats


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
    tokens = tree.input_tokens.to(device)[None]
    positions = (tree.input_depths.to(device) + prefix)[None]
    # A chain is exactly what the model's own causal mask expresses; only branching trees need ours (and every
    # forward of a model with sliding-window layers, whose full-length cache layers HF's masks do not window).
    attention = layer_attention(model.config)
    mask = (None if tree.is_plain_chain and not attention.windowed
            else batch_tree_mask([tree], [prefix], model.dtype, device, attention=attention))
    return model(
        **cache_kwargs(model, cache),
        input_ids=tokens,
        position_ids=positions,
        attention_mask=mask,
        output_hidden_states=output_hidden_states,
    )


def batch_forward(model: PreTrainedModel, cache: BatchKVCache, trees: list[DraftTree], first_row: int = 0, *,
                  output_hidden_states: bool = False, lean: LeanForward | None = None,
                  attention: LayerAttention | None = None):
    """One forward over rows first_row .. first_row + len(trees) - 1 of `cache`, row b's input `trees[b]` padded to the
    widest tree (positions = the row's length + depth); nothing is committed. With `lean`, that forward runs it
    (`lean_forward.py`) instead of the model's own. `attention`: the model's layer attention, when the caller has
    it (else read from its config)."""
    device = model_device(model)
    lengths = cache.lengths[first_row : first_row + len(trees)]
    width = max(t.input_size for t in trees)  # a tree's nodes, then its extra rows (`extra_rows.py`)
    tokens = torch.zeros(len(trees), width, dtype=torch.long)
    positions = torch.zeros(len(trees), width, dtype=torch.long)
    for b, (tree, length) in enumerate(zip(trees, lengths)):
        tokens[b, : tree.input_size] = tree.input_tokens.cpu()
        positions[b, : tree.input_size] = tree.input_depths.cpu() + length
        positions[b, tree.input_size :] = length  # padding: its outputs are never read
    window = cache.window(first_row, len(trees))
    if lean is not None:
        lone_chain = len(trees) == 1 and trees[0].is_plain_chain  # plain decoding: no tree to mask
        return lean(tokens.to(device), positions.to(device), window, None if lone_chain else trees,
                    output_hidden_states=output_hidden_states)
    # A lone chain is what the model's own causal mask expresses (the forward of plain one-sequence decoding);
    # anything else needs ours, and so does every forward of a model with sliding-window layers.
    attention = attention or layer_attention(model.config)
    lone_chain = len(trees) == 1 and trees[0].is_plain_chain
    mask = (None if lone_chain and not attention.windowed
            else batch_tree_mask(trees, lengths, model.dtype, device, attention=attention))
    return model(input_ids=tokens.to(device), position_ids=positions.to(device), attention_mask=mask,
                 output_hidden_states=output_hidden_states, **cache_kwargs(model, window))


def prefill_forward(model: PreTrainedModel, cache: BatchKVCache, row: int, prompt: torch.Tensor, *,
                    output_hidden_states: bool = False, lean: LeanForward | None = None,
                    attention: LayerAttention | None = None):
    """One forward over a whole prompt [P] into the (empty) row `row`; logits only for its last position."""
    device = model_device(model)
    window = cache.window(row, 1)
    length = cache.lengths[row]
    if lean is None:
        attention = attention or layer_attention(model.config)
        mask = None
        if attention.windowed:  # the model's own masks would not window the cache's full-length layers
            width = prompt.shape[0]
            mask = causal_mask([length], width, length + width, model.dtype, device, attention)
        return model(input_ids=prompt[None].to(device), attention_mask=mask, **cache_kwargs(model, window),
                     logits_to_keep=1, output_hidden_states=output_hidden_states)
    positions = torch.arange(length, length + prompt.shape[0], device=device)[None]
    return lean(prompt[None].to(device), positions, window, logits_to_keep=1,
                output_hidden_states=output_hidden_states)


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
            f"position_ids): {err}. Use a model whose attention accepts custom masks "
            "(e.g. attn_implementation='sdpa' or 'eager')"
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
    low, high = int(tree.input_tokens.min()), int(tree.input_tokens.max())  # extra rows' tokens are fed too
    if low < 0 or high >= vocab_size:
        raise ValueError(f"the tree holds token ids in [{low}, {high}], outside the target's vocabulary of "
                         f"{vocab_size}")


@dataclass
class Sequence:
    """One sequence being decoded: a row of the engine's batch."""

    proposer: Proposer
    sampling: SamplingParams
    generator: torch.Generator | None  # on the target's device, seeded from the sampling params (None: global RNG)
    stops: set[int]
    tokens: torch.Tensor  # [limit + 1] long on CPU: the prompt, then the committed output
    n_prompt: int
    limit: int  # the most tokens (prompt + output) this sequence may reach
    length_limited: bool  # whether `limit` is the request's max_new_tokens (else the model's context)
    on_tokens: Callable[[list[int]], None] | None
    should_stop: Callable[[], str | None] | None
    started: float  # when it was added (time.perf_counter)
    stats: GenerationStats = field(default_factory=GenerationStats)
    output: list[int] = field(default_factory=list)
    n: int = 0  # tokens committed (prompt included)
    tree: DraftTree | None = None  # the tree its next verify forward checks
    hidden: TargetHidden | None = None  # the target's hidden states over that forward's nodes (for on_verified)
    extra_logits: torch.Tensor | None = None  # [E, V] the target's logits at that forward's extra rows (on_verified)
    row: int = -1  # its row in the cache, once prefilled
    policy: RowState = field(default_factory=RowState)  # what the engine's speculation policy keeps for it
    failed: tuple[str, Exception] | None = None  # its proposer failed after the last step: the next one is plain
    constraint: GrammarConstraint | None = None  # a grammar its output follows (structured outputs), shaping its trees

    @property
    def done(self) -> bool:
        return bool(self.stats.finish_reason)

    def context(self) -> ProposalContext:
        room = self.limit - self.n  # tokens that may still be committed, the bonus included
        return ProposalContext(tokens=self.tokens[: self.n], num_prompt_tokens=self.n_prompt,
                               max_depth=max(room - 1, 0), sampling=self.sampling, generator=self.generator)

    def result(self) -> GenerationResult:
        return GenerationResult(output_ids=list(self.output), stats=self.stats)


class Engine:
    """Speculative decoding for one HF causal LM target: up to `max_rows` sequences per verify forward, each with its
    own draft tree, acceptance and sampling. `generate` decodes one sequence (a batch of one); `add` and `step` run
    several, joining and leaving between steps.

    A batch of one runs exactly the forwards of plain one-sequence decoding (a chain tree under the model's own
    causal mask); several rows run one padded forward per step under a per-row tree mask (`batch_cache.py`). Rows
    after the first decode with forks of `proposer` (`proposers.base.fork`: the drafter's weights shared, its
    per-sequence state its own).

    `speculation` chooses, before each step and per row, how deep it drafts (`adaptive.py`; default: as deep as the
    proposer likes); a row it sends plain verifies its root alone, without asking the proposer.

    With `fallback`, a proposer that raises or returns a tree `check_proposal` refuses makes that step a plain
    (root-only) step, which is exact like any other, and `fallback` is told the reason; without it the error
    propagates (benchmarks and tests want proposer bugs loud).

    `step` chooses the target's forward: "lean" (`lean_forward.py`: fused projections, fewer calls; Llama-family
    targets), "hf" (the model's own forward) or "auto" (lean where the target's family allows it). Every step of a
    run, `ar`'s included, uses the same one. `compile` compiles the lean forward's elementwise work (torch.compile,
    once per process for every layer and width; refused with the HF forward)."""

    def __init__(self, model: PreTrainedModel, proposer: Proposer, *, max_context: int | None = None,
                 fallback: FallbackHandler | None = None, max_rows: int = 1,
                 speculation: Speculation | None = None, step: str = "auto", compile: bool = False) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        self.lean = target_forward(model, step, compile)
        self.attention = layer_attention(model.config)  # read once: every forward's masks follow it
        self.model = model.eval()
        self.proposer = proposer
        self.device = model_device(model)
        self.max_context = max_context or model_max_context(model)
        self.fallback = fallback
        self.max_rows = max_rows
        self.speculation: Speculation = speculation if speculation is not None else AlwaysSpeculate()
        self.drafted_last_step = False  # whether the last verify step checked any drafted token
        self.vocab_size = model.config.get_text_config().vocab_size
        self._cache: BatchKVCache | None = None
        self._waiting: list[Sequence] = []
        self._running: list[Sequence] = []  # in row order
        check_tree_attention(model)

    @torch.inference_mode()
    def generate(
        self,
        prompt_ids: Sequence_[int] | torch.Tensor,
        *,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: Iterable[int] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
        should_stop: Callable[[], str | None] | None = None,
        constraint: GrammarConstraint | None = None,
    ) -> GenerationResult:
        """Generate up to max_new_tokens after the prompt; `on_tokens` receives each step's new tokens, and
        `should_stop`, asked after each step, ends the generation with the finish reason it returns (e.g. a
        timeout or a client gone).

        1. Prefill the whole prompt; its last token is the first (root-only) tree, so the prefill
           forward is step 1 and yields the first token.
        2. Each further step: propose a tree rooted at the last committed token (unless the speculation
           policy makes it plain), verify it in one target forward, commit the accepted path in the cache,
           hand the result to the proposer.
        3. Stop at a stop token (kept in the output), max_new_tokens, or the model's context length.

        With `constraint` (`constraint.py`), every step's tree and logits follow its grammar: the output is that of
        plain decoding of the target masked by the grammar, and its end tokens stop the sequence too.
        """
        if self._running or self._waiting:
            raise RuntimeError("generate decodes alone; this engine has sequences in flight (use add and step)")
        seq = self.add(prompt_ids, max_new_tokens=max_new_tokens, sampling=sampling, stop_token_ids=stop_token_ids,
                       on_tokens=on_tokens, should_stop=should_stop, constraint=constraint)
        while not seq.done:
            self.step()
        return seq.result()

    def add(
        self,
        prompt_ids: Sequence_[int] | torch.Tensor,
        *,
        max_new_tokens: int,
        sampling: SamplingParams = SamplingParams(),
        stop_token_ids: Iterable[int] = (),
        on_tokens: Callable[[list[int]], None] | None = None,
        should_stop: Callable[[], str | None] | None = None,
        constraint: GrammarConstraint | None = None,
    ) -> Sequence:
        """Queue a sequence; it is prefilled at the first `step` with a free row. Arguments as `generate`."""
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
        limit = n_prompt + max_new_tokens
        length_limited = True
        if self.max_context is not None and self.max_context < limit:
            limit, length_limited = self.max_context, False
        tokens = torch.empty(limit + 1, dtype=torch.long)
        tokens[:n_prompt] = prompt
        in_use = [s.proposer for s in self._running + self._waiting]
        proposer = self.proposer if not any(p is self.proposer for p in in_use) else fork(self.proposer)
        stops = {int(t) for t in stop_token_ids} | set(constraint.end_tokens if constraint is not None else ())
        seq = Sequence(proposer=proposer, sampling=sampling, generator=sampling.generator(self.device),
                       stops=stops, constraint=constraint, tokens=tokens, n_prompt=n_prompt, n=n_prompt,
                       limit=limit, length_limited=length_limited, on_tokens=on_tokens, should_stop=should_stop,
                       started=time.perf_counter())
        self._waiting.append(seq)
        return seq

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def kv_cache_usage(self) -> float:
        """Committed KV entries over what the batch can hold, `max_rows` rows of the model's context (of the running
        rows' longest limit when the model states no context): 0 to 1, as vLLM's kv_cache_usage_perc. The buffers
        are allocated as rows grow, so this reads the share of the batch's reach in use, not of memory allocated."""
        if self._cache is None or not self._running:
            return 0.0
        per_row = self.max_context or max(s.limit for s in self._running)
        return sum(self._cache.lengths) / (self.max_rows * per_row)

    @torch.inference_mode()
    def step(self) -> list[Sequence]:
        """One step: prefill the waiting sequences that fit (their first token each), then draft a tree for every
        sequence already running and verify them all in one forward. Returns the sequences that finished in it
        (their rows are free)."""
        finished: list[Sequence] = []
        running = list(self._running)  # prefilled before this step: they verify now
        while self._waiting and len(self._running) < self.max_rows:
            seq = self._waiting.pop(0)
            self._prefill(seq)
            self._running.append(seq)
            if seq.done:
                finished.append(seq)
        if running:
            self._draft(running)
            self._constrain(running)
            self.drafted_last_step = any(s.tree.size > 1 for s in running)
            self._verify_step(running)
            finished += [s for s in running if s.done]
        for seq in finished:
            self._release(seq)
        return finished

    def _cache_for(self, seq: Sequence) -> BatchKVCache:
        if self._cache is None:
            self._cache = BatchKVCache(self.model.config, rows=self.max_rows, capacity=seq.limit + 16)
        return self._cache

    def _prefill(self, seq: Sequence) -> None:
        """Step 1 is the prefill itself: one forward over the whole prompt, whose last token is the first
        (root-only) tree, gives the first token. Proposers start from the prompt's other positions."""
        cache = self._cache_for(seq)
        seq.row = cache.add_row()
        prompt = seq.tokens[: seq.n_prompt]
        needs_hidden = bool(seq.proposer.needs_target_hidden)
        out = prefill_forward(self.model, cache, seq.row, prompt, output_hidden_states=needs_hidden, lean=self.lean,
                              attention=self.attention)
        hidden = out.hidden_states if needs_hidden else None
        try:
            seq.proposer.start(seq.context(), tuple(h[:, :-1] for h in hidden) if hidden and seq.n_prompt > 1 else None)
        except Exception as err:
            if self.fallback is None:
                raise
            seq.stats.fallbacks += 1  # its steps will fall back as they come; this one only reports
            self.fallback("proposer_error", err)
        self.speculation.start(seq.policy)
        seq.hidden = tuple(h[:, -1:] for h in hidden) if hidden else None
        seq.tree = DraftTree.root_only(int(prompt[-1]))
        if seq.constraint is not None:
            seq.tree = seq.constraint.shape(seq.tree, max_depth=0)  # the prefill forward has no room for drafts
        cache.lengths[seq.row] = seq.n_prompt - 1  # the root's entry is committed with the step's path, as any root's
        self._advance(seq, out.logits[0, -1:], batch=1)

    def _verify_step(self, seqs: list[Sequence]) -> None:
        """One target forward over every sequence's tree (rows are consecutive: the running ones, in row order)."""
        cache = self._cache
        first = seqs[0].row
        assert [s.row for s in seqs] == list(range(first, first + len(seqs))), "running rows must be consecutive"
        needs_hidden = any(s.proposer.needs_target_hidden for s in seqs)
        out = batch_forward(self.model, cache, [s.tree for s in seqs], first, output_hidden_states=needs_hidden,
                            lean=self.lean, attention=self.attention)
        for b, seq in enumerate(seqs):
            n = seq.tree.size
            seq.hidden = tuple(h[b : b + 1, :n] for h in out.hidden_states) if needs_hidden else None
            extra = seq.tree.extra  # its rows' logits go to the proposer, never to the verifier
            seq.extra_logits = None if extra is None else out.logits[b, n : n + extra.size]
            self._advance(seq, out.logits[b, :n], batch=len(seqs))

    def _advance(self, seq: Sequence, logits: torch.Tensor, batch: int) -> None:
        """Verify `seq`'s tree against its logits [N, V], commit the accepted path and new tokens, and hand the
        result to the proposer unless the sequence finished."""
        tree, stats = seq.tree, seq.stats
        extra_logits, seq.extra_logits = seq.extra_logits, None  # held for this step only
        if seq.constraint is not None:
            logits = seq.constraint.mask_logits(tree, logits)
        result = verify(tree, logits, seq.sampling, seq.generator)
        self._cache.commit(seq.row, result.path)
        self.speculation.observe(seq.policy, batch, tree, result)
        new = result.tokens.tolist()
        stats.record_step(tree.num_drafted, result.num_accepted)
        for i, tok in enumerate(new):
            if tok in seq.stops:
                new = new[: i + 1]
                stats.finish_reason = "stop"
                break
        if len(new) >= seq.limit - seq.n:
            new = new[: seq.limit - seq.n]
            stats.finish_reason = stats.finish_reason or ("length" if seq.length_limited else "context")
        if seq.constraint is not None and not stats.finish_reason:
            seq.constraint.commit(new)
        seq.tokens[seq.n : seq.n + len(new)] = torch.tensor(new, dtype=torch.long)
        seq.n += len(new)
        seq.output.extend(new)
        if stats.steps == 1:
            stats.ttft_s = time.perf_counter() - seq.started
        if seq.on_tokens is not None:
            seq.on_tokens(new)
        if not stats.finish_reason and seq.should_stop is not None:
            stats.finish_reason = seq.should_stop() or ""
        if stats.finish_reason:
            stats.new_tokens = len(seq.output)
            stats.wall_s = time.perf_counter() - seq.started
            return
        told = time.perf_counter()
        hidden = seq.hidden
        if seq.constraint is not None:  # the proposer reads the result in its own tree's nodes
            result, hidden = seq.constraint.proposer_view(result, hidden)
        if extra_logits is not None:
            result = replace(result, extra_logits=extra_logits)
        try:
            seq.proposer.on_verified(result, hidden)
        except Exception as err:  # noqa: BLE001 - whatever the proposer's failure, its next step decodes plainly
            if self.fallback is None:
                raise
            seq.failed = ("proposer_error", err)
        stats.draft_s += time.perf_counter() - told

    def _draft(self, seqs: list[Sequence]) -> None:
        """Set each sequence's next tree: its proposer's, as deep as the speculation policy allows (a plain step, root
        only, when it allows none or the proposer failed). The rows that draft do so together (`propose_rows`: one
        batched call where their proposer class drafts rows together); the time is shared out evenly among them."""
        drafting: list[tuple[Sequence, ProposalContext]] = []
        for seq in seqs:
            ctx = seq.context()
            if seq.failed is not None:
                (reason, err), seq.failed = seq.failed, None
                seq.tree = self._plain_step(reason, err, ctx, seq.stats)
                continue
            cap = self.speculation.depth(seq.policy, len(seqs))
            if cap == 0 or ctx.max_depth == 0:
                seq.tree = DraftTree.root_only(ctx.tokens[-1])
                continue
            depth = ctx.max_depth if cap is None else min(cap, ctx.max_depth)
            drafting.append((seq, replace(ctx, max_depth=depth, batch=len(seqs))))
        if not drafting:
            return
        start = time.perf_counter()
        rows, ctxs = [s for s, _ in drafting], [c for _, c in drafting]
        proposers = [s.proposer for s in rows]
        if self.fallback is None:
            trees = propose_rows(proposers, ctxs)
        elif drafts_together(proposers):
            try:
                trees = propose_rows(proposers, ctxs)
            except Exception:  # noqa: BLE001 - find the failing rows: each drafts alone, failing alone
                trees = [self._propose_alone(s, c) for s, c in drafting]
        else:
            trees = [self._propose_alone(s, c) for s, c in drafting]
        for seq, ctx, tree in zip(rows, ctxs, trees):
            if self.fallback is not None:
                try:
                    check_proposal(tree, ctx, self.vocab_size)
                except ValueError as err:
                    tree = self._plain_step("malformed_tree", err, ctx, seq.stats)
            seq.tree = tree.truncated(ctx.max_depth)
        share = (time.perf_counter() - start) / len(rows)
        for seq in rows:
            seq.stats.draft_s += share

    def _constrain(self, seqs: list[Sequence]) -> None:
        """Shape the trees of rows with a grammar: forbidden deterministic drafts pruned, forced tokens drafted
        (`constraint.py`); the time counts as drafting."""
        for seq in seqs:
            if seq.constraint is not None:
                start = time.perf_counter()
                seq.tree = seq.constraint.shape(seq.tree, seq.context().max_depth)
                seq.stats.draft_s += time.perf_counter() - start

    def _propose_alone(self, seq: Sequence, ctx: ProposalContext) -> DraftTree:
        try:
            return seq.proposer.propose(ctx)
        except Exception as err:  # noqa: BLE001 - whatever the proposer's failure, this step decodes plainly
            return self._plain_step("proposer_error", err, ctx, seq.stats)

    def _plain_step(self, reason: str, err: Exception, ctx: ProposalContext, stats: GenerationStats) -> DraftTree:
        stats.fallbacks += 1
        self.fallback(reason, err)
        return DraftTree.root_only(ctx.tokens[-1])

    def abort(self) -> None:
        """Drop every sequence in flight and the cache (after a failed step, whose rows may be half-written, or before
        dropping an engine mid-way: their proposers free what they hold, e.g. rows of a shared head cache)."""
        for seq in self._waiting + self._running:
            finish(seq.proposer)
        self._waiting.clear()
        self._running.clear()
        self._cache = None

    def _release(self, seq: Sequence) -> None:
        """Free a finished sequence's row; the last running row moves into it."""
        moved = self._cache.remove_row(seq.row)
        self._running.remove(seq)
        finished(seq.proposer, seq.tokens[: seq.n])
        finish(seq.proposer)
        if moved is not None:
            mover = next(s for s in self._running if s.row == moved)
            mover.row = seq.row
            self._running.sort(key=lambda s: s.row)
        seq.row = -1
