"""The engine loop: propose -> verify forward -> verify -> commit -> on_verified.

Every method, the plain autoregressive baseline included, runs through the same
`Engine.generate`, with the same cache and sampling code, so speedups compare
like with like. The target's forwards are in `forward.py`, a sequence's state in `generation.py`; what cuts across
the loop sits behind one hook each: a constraint on the output (`output_constraint.py`) and proposer failures
(`fallback.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from collections.abc import Sequence as Sequence_
from dataclasses import replace

import torch
from transformers import PreTrainedModel

from specheads.inference.engine.fallback import FallbackHandler, FallbackProposer
from specheads.inference.engine.generation import Generation, GenerationResult, Request
from specheads.inference.engine.lean_forward import LeanForward
from specheads.inference.engine.output_constraint import UNCONSTRAINED, OutputConstraint
from specheads.inference.engine.proposer import (
    ProposalContext,
    Proposer,
    finish,
    finished,
    fork,
    propose_rows,
    target_layers,
    verified_on,
)
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.speculation import AlwaysSpeculate, Speculation
from specheads.inference.engine.target_backend import TargetBackend, TargetHidden, TorchBackend
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult, verify


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

    With `fallback` (set before sequences are added), each row's proposer is wrapped in `FallbackProposer`: one that
    raises or returns a tree the target cannot verify makes that step a plain (root-only) step, which is exact like
    any other, and `fallback` is told the reason; without it the error propagates (benchmarks and tests want proposer
    bugs loud).

    `backend` runs the target's forwards and holds its cache (`target_backend.py`); by default our PyTorch forward of
    `model`, where `step` chooses it: "lean" (`lean_forward.py`: fused projections, fewer calls; Llama-family
    targets), "hf" (the model's own forward) or "auto" (lean where the target's family allows it), and `compile`
    compiles the lean forward's elementwise work (torch.compile, once per process for every layer and width; refused
    with the HF forward). Every step of a run, `ar`'s included, uses the same one. With another backend (llama.cpp's:
    `llamacpp_backend.py`), `model` is the same target's HF model, read for its config and by proposers that use its
    weights (heads share its embeddings)."""

    def __init__(self, model: PreTrainedModel, proposer: Proposer, *, max_context: int | None = None,
                 fallback: FallbackHandler | None = None, max_rows: int = 1,
                 speculation: Speculation | None = None, step: str = "auto", compile: bool = False,
                 backend: TargetBackend | None = None) -> None:
        if max_rows < 1:
            raise ValueError(f"max_rows must be >= 1, got {max_rows}")
        if backend is not None and (step != "auto" or compile):
            raise ValueError(f"step and compile choose our PyTorch forward; the {backend.name} backend runs its own")
        self.backend: TargetBackend = backend or TorchBackend(model, max_rows=max_rows, step=step, compile=compile)
        self.model = model
        self.proposer = proposer
        self.device = self.backend.device
        self.max_context = max_context or self.backend.max_context
        self.fallback = fallback
        self.max_rows = max_rows
        self.speculation: Speculation = speculation if speculation is not None else AlwaysSpeculate()
        self.drafted_last_step = False  # whether the last verify step checked any drafted token
        self.vocab_size = model.config.get_text_config().vocab_size
        if proposer.needs_target_hidden:
            self.backend.read_layers(target_layers(proposer))
        verified_on(proposer, self.backend)
        self._waiting: list[Generation] = []
        self._running: list[Generation] = []  # in row order

    @property
    def lean(self) -> LeanForward | None:
        """The lean forward our PyTorch backend runs (None: HF's own forward, or another backend)."""
        return getattr(self.backend, "lean", None)

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
        constraint: OutputConstraint | None = None,
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
        constraint: OutputConstraint | None = None,
    ) -> Generation:
        """Queue a sequence; it is prefilled at the first `step` with a free row. Arguments as `generate`."""
        prompt = torch.as_tensor(prompt_ids, dtype=torch.long).flatten().cpu()
        return self.submit(Request(prompt=prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                                   stop_token_ids=frozenset(int(t) for t in stop_token_ids), on_tokens=on_tokens,
                                   should_stop=should_stop, constraint=constraint or UNCONSTRAINED))

    def submit(self, request: Request) -> Generation:
        """Queue `request`'s sequence; it is prefilled at the first `step` with a free row."""
        n_prompt = request.prompt.shape[0]
        if n_prompt == 0:
            raise ValueError("the prompt is empty; pass at least one token")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if self.max_context is not None and n_prompt >= self.max_context:
            raise ValueError(
                f"the prompt has {n_prompt} tokens but the model's context holds {self.max_context}; "
                "shorten the prompt (it is never truncated silently)"
            )
        limit = n_prompt + request.max_new_tokens
        length_limited = True
        if self.max_context is not None and self.max_context < limit:
            limit, length_limited = self.max_context, False
        tokens = torch.empty(limit + 1, dtype=torch.long)
        tokens[:n_prompt] = request.prompt
        seq = Generation(request=request, proposer=self._row_proposer(), generator=request.sampling.generator(
                             self.device), stops=request.stop_token_ids | frozenset(request.constraint.end_tokens),
                         tokens=tokens, n=n_prompt, limit=limit, length_limited=length_limited,
                         started=time.perf_counter())
        if self.fallback is not None:
            seq.proposer = FallbackProposer(seq.proposer, self.vocab_size, lambda reason, err: self._fell_back(
                seq, reason, err))
        self._waiting.append(seq)
        return seq

    def _row_proposer(self) -> Proposer:
        """The engine's proposer for a new row while no other row holds it, else a fork of it."""
        held = (s.proposer.inner if isinstance(s.proposer, FallbackProposer) else s.proposer
                for s in self._running + self._waiting)
        return fork(self.proposer) if any(p is self.proposer for p in held) else self.proposer

    def _fell_back(self, seq: Generation, reason: str, err: Exception) -> None:
        seq.stats.fallbacks += 1
        self.fallback(reason, err)

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
        if not self._running:
            return 0.0
        per_row = self.max_context or max(s.limit for s in self._running)
        return self.backend.committed_tokens() / (self.max_rows * per_row)

    @torch.inference_mode()
    def step(self) -> list[Generation]:
        """One step: prefill the waiting sequences that fit (their first token each), then draft a tree for every
        sequence already running and verify them all in one forward. Returns the sequences that finished in it
        (their rows are free)."""
        finished: list[Generation] = []
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

    def _prefill(self, seq: Generation) -> None:
        """Step 1 is the prefill itself: one forward over the whole prompt, whose last token is the first
        (root-only) tree, gives the first token. Proposers start from the prompt's other positions."""
        seq.row = self.backend.add_row(seq.limit)
        prompt = seq.tokens[: seq.n_prompt]
        out = self.backend.prefill(seq.row, prompt, hidden=bool(seq.proposer.needs_target_hidden))
        hidden = out.hidden_states
        seq.proposer.start(seq.context(), _each(hidden, (slice(None), slice(None, -1))) if seq.n_prompt > 1 else None)
        self.speculation.start(seq.policy)
        seq.hidden = _each(hidden, (slice(None), slice(-1, None)))
        # The prefill forward has no room for drafts: its tree is the root alone, shaped (depth 0) like any step's;
        # the root's entry is committed with the step's path, as any root's.
        seq.tree = seq.constraint.shape(DraftTree.root_only(int(prompt[-1])), max_depth=0)
        self._advance(seq, out.logits[0, -1:], batch=1)

    def _verify_step(self, seqs: list[Generation]) -> None:
        """One target forward over every sequence's tree (rows are consecutive: the running ones, in row order)."""
        first = seqs[0].row
        assert [s.row for s in seqs] == list(range(first, first + len(seqs))), "running rows must be consecutive"
        out = self.backend.verify(first, [s.tree for s in seqs],
                                  hidden=any(s.proposer.needs_target_hidden for s in seqs))
        for b, seq in enumerate(seqs):
            n = seq.tree.size
            seq.hidden = _each(out.hidden_states, (slice(b, b + 1), slice(None, n)))
            extra = seq.tree.extra  # its rows' logits go to the proposer, never to the verifier
            seq.extra_logits = None if extra is None else out.logits[b, n : n + extra.size]
            self._advance(seq, out.logits[b, :n], batch=len(seqs))

    def _advance(self, seq: Generation, logits: torch.Tensor, batch: int) -> None:
        """After `seq`'s verify forward (its logits [N, V] over its tree): verify, commit, hand on, and either end the
        sequence or tell its proposer."""
        result = self._verify(seq, logits, batch)
        new = self._commit(seq, result)
        self._hand_on(seq, new)
        if seq.done:
            seq.stats.new_tokens = len(seq.output)
            seq.stats.wall_s = time.perf_counter() - seq.started
        else:
            self._tell_proposer(seq, result)
        seq.extra_logits = None  # held for this step only

    def _verify(self, seq: Generation, logits: torch.Tensor, batch: int) -> VerifyResult:
        """The accepted path and new tokens of `seq`'s tree under its (constrained) logits, committed in the cache and
        counted."""
        tree = seq.tree
        result = verify(tree, seq.constraint.mask_logits(tree, logits), seq.sampling, seq.generator)
        self.backend.commit(seq.row, result.path)
        self.speculation.observe(seq.policy, batch, tree, result)
        seq.stats.record_step(tree.num_drafted, result.num_accepted)
        return result

    def _commit(self, seq: Generation, result: VerifyResult) -> list[int]:
        """The step's new tokens, cut at the first stop token and at the sequence's limit (setting why it finished),
        appended to its tokens and output; its constraint follows them while it goes on."""
        stats = seq.stats
        new = result.tokens.tolist()
        for i, tok in enumerate(new):
            if tok in seq.stops:
                new = new[: i + 1]
                stats.finish_reason = "stop"
                break
        if len(new) >= seq.limit - seq.n:
            new = new[: seq.limit - seq.n]
            stats.finish_reason = stats.finish_reason or ("length" if seq.length_limited else "context")
        if not stats.finish_reason:
            seq.constraint.commit(new)
        seq.tokens[seq.n : seq.n + len(new)] = torch.tensor(new, dtype=torch.long)
        seq.n += len(new)
        seq.output.extend(new)
        return new

    def _hand_on(self, seq: Generation, new: list[int]) -> None:
        """Give the caller the new tokens (the first step's time is the time to first token) and ask whether the
        sequence should stop."""
        stats = seq.stats
        if stats.steps == 1:
            stats.ttft_s = time.perf_counter() - seq.started
        if seq.request.on_tokens is not None:
            seq.request.on_tokens(new)
        if not stats.finish_reason and seq.request.should_stop is not None:
            stats.finish_reason = seq.request.should_stop() or ""

    def _tell_proposer(self, seq: Generation, result: VerifyResult) -> None:
        """Hand the verification to the proposer, in the nodes of the tree it drafted (timed as drafting)."""
        told = time.perf_counter()
        result, hidden = seq.constraint.proposer_view(result, seq.hidden)
        if seq.extra_logits is not None:
            result = replace(result, extra_logits=seq.extra_logits)
        seq.proposer.on_verified(result, hidden)
        seq.stats.draft_s += time.perf_counter() - told

    def _draft(self, seqs: list[Generation]) -> None:
        """Set each sequence's next tree: its proposer's, as deep as the speculation policy allows (a plain step, root
        only, when it allows none). The rows that draft do so together (`propose_rows`: one batched call where their
        proposer class drafts rows together); the time is shared out evenly among them."""
        drafting: list[tuple[Generation, ProposalContext]] = []
        for seq in seqs:
            ctx = seq.context()
            cap = self.speculation.depth(seq.policy, len(seqs))
            if cap == 0 or ctx.max_depth == 0:
                seq.tree = DraftTree.root_only(ctx.tokens[-1])
                continue
            depth = ctx.max_depth if cap is None else min(cap, ctx.max_depth)
            drafting.append((seq, replace(ctx, max_depth=depth, batch=len(seqs))))
        if not drafting:
            return
        start = time.perf_counter()
        trees = propose_rows([s.proposer for s, _ in drafting], [c for _, c in drafting])
        for (seq, ctx), tree in zip(drafting, trees):
            seq.tree = tree.truncated(ctx.max_depth)
            if self.backend.max_leaves is not None:  # llama.cpp: a sequence id per leaf, a row has so many
                seq.tree = seq.tree.within_leaves(self.backend.max_leaves)
        share = (time.perf_counter() - start) / len(drafting)
        for seq, _ in drafting:
            seq.stats.draft_s += share

    def _constrain(self, seqs: list[Generation]) -> None:
        """Shape each row's tree by its output constraint (a grammar: forbidden deterministic drafts pruned, forced
        tokens drafted; `constraint.py`); the time counts as drafting."""
        for seq in seqs:
            start = time.perf_counter()
            seq.tree = seq.constraint.shape(seq.tree, seq.context().max_depth)
            seq.stats.draft_s += time.perf_counter() - start

    def abort(self) -> None:
        """Drop every sequence in flight and the cache (after a failed step, whose rows may be half-written, or before
        dropping an engine mid-way: their proposers free what they hold, e.g. rows of a shared head cache)."""
        for seq in self._waiting + self._running:
            finish(seq.proposer)
        self._waiting.clear()
        self._running.clear()
        self.backend.reset()

    def _release(self, seq: Generation) -> None:
        """Free a finished sequence's row; the last running row moves into it."""
        moved = self.backend.remove_row(seq.row)
        self._running.remove(seq)
        finished(seq.proposer, seq.tokens[: seq.n])
        finish(seq.proposer)
        if moved is not None:
            mover = next(s for s in self._running if s.row == moved)
            mover.row = seq.row
            self._running.sort(key=lambda s: s.row)
        seq.row = -1


def _each(hidden: TargetHidden | None, index: tuple[slice, ...]) -> TargetHidden | None:
    """Every layer `hidden` holds indexed by `index` (a layer the backend did not read stays None)."""
    return None if hidden is None else tuple(None if h is None else h[index] for h in hidden)
