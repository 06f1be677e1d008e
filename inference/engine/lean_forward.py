"""The target's forward without transformers' per-call overhead, for Llama-family decoders.

A one-token step of a small target on CPU spends a third or more of its time outside the matrix products: module
calls, mask and cache bookkeeping, and separate q/k/v and gate/up products (docs/results.md, "where a decode step
goes"). `LeanForward` runs the maths of the HF model's own forward over the engine's `BatchKVCache`, in fewer calls:

1. q, k and v come from one product on their concatenated weights, gate and up from another: two products per layer
   instead of five, each fused weight stored in the model's own layout (packed bf16, column-major fp32, ...);
2. RoPE comes from the model's rotary module; each row's new k/v entries are written in place right after its
   committed prefix (`BatchKVCache`'s contract), and SDPA attends over the first `span` slots of the row buffers
   under the engine's mask, `span` rounded up to a multiple of SPAN_STEP so a run sees few distinct shapes;
3. o_proj, down_proj, the final norm and the LM head are the model's own modules, so the weight layout and
   `--fp32-head` apply unchanged; the layers' RMSNorms are one `F.rms_norm` kernel each on their own weights, and
   RoPE runs once on q and k together;
4. with `compiled`, the decoder layers run as one graph compiled by torch.compile (`_CompiledStack`), with dynamic
   shapes: one graph serves every width and context length (torch specialises sizes 1, so a one-token step, a
   wider forward and a batch of rows may each get their own). The graph reads the rows' committed entries as
   views of the cache, attends over them and the new entries concatenated, and returns the new keys and values,
   which are then written in place: it mutates none of its inputs, and the same code is what CUDA graphs capture
   on a GPU. On CPU, inductor's freezing takes the weights as constants, and the elementwise work between products
   becomes a few fused kernels per layer. Products of layers in a planned layout (`measured`, `packed`,
   `transposed`: `gemm_layout.py`) stay on their own kernels through one opaque op each
   (`specheads::planned_linear`); inductor's own fp32 products (MKL's packed GEMM) read weights at a third of the
   rate for a tree's few rows (docs/results.md). Products of other layouts are inductor's. The embedding,
   RoPE's tables, the final norm and the LM head stay eager (so `--fp32-head` applies unchanged), and so does a
   row's first prefill, which sizes the cache.

The eager forward and the compiled stack run the same code, `decoder_stack` over `decoder_layer`: they differ only in
how a layer's products are held (the model's modules in their layouts, or the stack's parameters through `F.linear`)
and in how it attends (writing the new entries into the cache first, or concatenating them to the committed ones).

Its outputs equal the HF forward's up to the rounding of the fused products (and, compiled, of inductor's
kernels). Every engine method, `ar` included,
runs through the same forward, so speculative greedy output still equals plain greedy output
(tests/inference/engine/test_lean_forward.py). Families it covers are listed in LEAN_MODEL_TYPES; any other target
runs the HF forward (`step="auto"`), or is refused by name (`step="lean"`).
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from transformers import PreTrainedModel

from specheads.gemm_layout import linear_layout, set_linear_layout, traceable_product
from specheads.hf import LLAMA_LAYOUT_FAMILIES, decoder_of, text_config
from specheads.inference.engine.batch_cache import BatchKVCache, batch_tree_mask, causal_mask, committed_then_new_mask
from specheads.inference.engine.tree import DraftTree

log = logging.getLogger(__name__)

# Families whose decoder layer is exactly: input norm -> attention (q/k/v/o projections, optional per-head q/k norms,
# RoPE, full causal attention scaled by head_dim^-0.5) -> residual -> post-attention norm -> gated MLP -> residual.
LEAN_MODEL_TYPES = LLAMA_LAYOUT_FAMILIES
SPAN_STEP = 64  # key slots attended are rounded up to a multiple of this (masked), so shapes change rarely
STEPS = ("auto", "lean", "hf")

_LAYER_PARTS = {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
_ATTN_PARTS = {"q_proj", "k_proj", "v_proj", "o_proj"}
_ATTN_OPTIONAL = {"q_norm", "k_norm", "rotary_emb"}
_MLP_PARTS = {"gate_proj", "up_proj", "down_proj", "act_fn"}


def lean_unsupported(model: PreTrainedModel) -> str | None:
    """Why `LeanForward` cannot run `model` (None: it can)."""
    cfg = text_config(model)
    if cfg.model_type not in LEAN_MODEL_TYPES:
        return f"model type {cfg.model_type!r} is not one of {', '.join(LEAN_MODEL_TYPES)}"
    if any(t != "full_attention" for t in getattr(cfg, "layer_types", None) or ()):
        return "some layers use sliding-window or other non-full attention"
    if cfg.model_type == "mistral" and getattr(cfg, "sliding_window", None) is not None:
        return "it uses sliding-window attention"
    try:
        decoder = decoder_of(model)
    except ValueError as err:
        return str(err)
    if not hasattr(decoder, "rotary_emb") or not hasattr(decoder, "embed_tokens"):
        return "its decoder has no rotary_emb or embed_tokens"
    for layer in decoder.layers:
        names = {name for name, _ in layer.named_children()}
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if names != _LAYER_PARTS or attn is None or mlp is None:
            return f"its decoder layer holds {sorted(names)}, not {sorted(_LAYER_PARTS)}"
        attn_names = {name for name, _ in attn.named_children()}
        if not _ATTN_PARTS <= attn_names or attn_names - _ATTN_PARTS - _ATTN_OPTIONAL:
            return f"its attention holds {sorted(attn_names)}"
        if {name for name, _ in mlp.named_children()} != _MLP_PARTS or cfg.hidden_act not in ("silu", "swish"):
            return "its MLP is not a SiLU-gated gate/up/down MLP"
        norms = [layer.input_layernorm, layer.post_attention_layernorm, *(getattr(attn, n) for n in ("q_norm", "k_norm")
                                                                            if hasattr(attn, n))]
        if not all(type(n).__name__.endswith("RMSNorm") and hasattr(n, "variance_epsilon") for n in norms):
            return "its norms are not the families' RMSNorm"
        if not all(isinstance(getattr(attn, n), nn.Linear) for n in _ATTN_PARTS):
            return "its attention projections are not linear layers"
        head_dim = attn.head_dim
        if abs(attn.scaling - head_dim**-0.5) > 1e-12 or getattr(cfg, "attn_logit_softcapping", None):
            return "its attention is scaled or soft-capped otherwise than by head_dim^-0.5"
    return None


def resolve_step(step: str, model: PreTrainedModel) -> str:
    """"lean" or "hf" for `step` ("auto": lean where the model's family allows it); a bad name or a lean step the
    model cannot take is refused with the reason."""
    if step not in STEPS:
        raise ValueError(f"unknown step {step!r}; use one of: {', '.join(STEPS)}")
    reason = lean_unsupported(model) if step != "hf" else None
    if step == "lean" and reason:
        raise ValueError(f"--step lean cannot run {type(model).__name__}: {reason}; use --step hf (or auto)")
    if step == "auto":
        return "hf" if reason else "lean"
    return step


def _fused(parts: list[nn.Linear], layout: str) -> nn.Linear:
    """One linear layer whose output is the concatenation of `parts`' outputs, in `layout`."""
    weight = torch.cat([p.weight.detach() for p in parts])
    biases = [p.bias for p in parts]
    fused = nn.Linear(weight.shape[1], weight.shape[0], bias=biases[0] is not None, device="meta")
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if biases[0] is not None:
        fused.bias = nn.Parameter(torch.cat([b.detach() for b in biases]), requires_grad=False)
    return set_linear_layout(fused, layout)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The families' RMSNorm in one kernel (accumulating in fp32 like their modules; a bf16 result is rounded once,
    where the modules round before scaling by the weight)."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def attention_inputs(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_norm: torch.Tensor | None,
                     k_norm: torch.Tensor | None, eps: float, q_size: int,
                     head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """qkv [B, W, q + 2 kv] -> q [B, H, W, D], k and v [B, KV, W, D]: split into heads, the per-head norms (Qwen3)
    and RoPE on q and k together. `sin` is `signed_sin`'s: RoPE's rotate-half, cat(-x2, x1) * sin, is then
    roll(x) * sin, the same products with the sign moved to sin, in fewer operations."""
    b, w, _ = qkv.shape
    kv_size = (qkv.shape[-1] - q_size) // 2
    qk, v = qkv.split([q_size + kv_size, kv_size], dim=-1)
    qk, v = qk.view(b, w, -1, head_dim), v.view(b, w, -1, head_dim)
    heads = q_size // head_dim
    if q_norm is not None:
        q, k = qk.split([heads, qk.shape[2] - heads], dim=2)
        qk = torch.cat([rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)], dim=2)
    qk = qk.transpose(1, 2)
    qk = qk * cos + qk.roll(head_dim // 2, dims=-1) * sin
    q, k = qk.split([heads, qk.shape[1] - heads], dim=1)
    return q, k, v.transpose(1, 2)


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """sin [..., D] with its first half negated (see `attention_inputs`)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)


def add_norm(x: torch.Tensor, update: torch.Tensor, weight: torch.Tensor,
             eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual stream after `update`, and its RMSNorm."""
    x = x + update
    return x, rms_norm(x, weight, eps)


def gated(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2I] -> silu(gate) * up [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- torch.compile: every setting the compiled stack depends on, here ----------------------------------------------

def compile_stack(stack: nn.Module, device: torch.device) -> nn.Module:
    """`stack` compiled for `device`: dynamic shapes, one graph; on CPU with inductor's freezing (weights become
    constants, reordered once for its products), on CUDA as a CUDA graph ("reduce-overhead")."""
    # every model's stack shares one code object, and its frozen weights are guarded by identity: each model compiled
    # in a process (a target and its draft model, say) adds a few graphs against dynamo's recompile limit, a
    # process-wide setting raised (never lowered) here
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    return torch.compile(stack, dynamic=True, fullgraph=True,
                         mode="reduce-overhead" if device.type == "cuda" else None,
                         options={"freezing": True} if device.type == "cpu" else None)


def compile_settings() -> contextlib.AbstractContextManager:
    """Settings around each call of a compiled stack: no duck shaping, so a width that happens to equal another size (a
    head count, say) is not tied to it and the warm-up's width stands for every width. The switch lives in a private
    torch config (`torch.fx.experimental._config`); it is patched for the call only."""
    return torch.fx.experimental._config.patch(use_duck_shape=False)



Product = Callable[[torch.Tensor], torch.Tensor]  # x [..., in] -> [..., out]: one of a layer's linear maps
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]  # q, new k, new v -> attention output


class LayerParts(NamedTuple):  # a tuple, which torch.compile traces through as plainly as the eager forward
    """What one decoder layer computes with. The eager forward holds the layer's products as modules (so each weight
    keeps its layout: packed bf16, column-major fp32, ...); the compiled stack builds them from its parameters with
    `gemm_layout.traceable_product` (the layer's own kernels, or `F.linear`), the weights frozen in as constants."""

    qkv: Product  # q, k and v in one product
    o: Product
    gate_up: Product  # gate and up in one product
    down: Product
    post_norm: torch.Tensor  # [H] the post-attention RMSNorm's weight
    q_norm: torch.Tensor | None  # [D] per-head norms (Qwen3), else None
    k_norm: torch.Tensor | None
    eps: float
    q_size: int  # q's width in the fused qkv output
    head_dim: int
    scaling: float


def decoder_layer(x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: LayerParts,
                  attend: Attend) -> tuple[torch.Tensor, torch.Tensor]:
    """One decoder layer, for the eager forward and the compiled stack alike: (residual stream x [B, W, H], its input
    norm h) -> (x after attention, the MLP's output to add to it). The caller adds that output fused with the next
    layer's input norm (`add_norm`). `attend` writes or gathers the keys and values (the eager forward writes the new
    ones into the cache first; the compiled graph attends over the committed ones and the new ones concatenated) and
    returns the attention output [B, heads, W, D]."""
    b, w, _ = x.shape
    q, k, v = attention_inputs(parts.qkv(h), cos, sin, parts.q_norm, parts.k_norm, parts.eps, parts.q_size,
                               parts.head_dim)
    out = attend(q, k, v)
    x, h = add_norm(x, parts.o(out.transpose(1, 2).reshape(b, w, -1)), parts.post_norm, parts.eps)
    return x, parts.down(gated(parts.gate_up(h)))


def decoder_stack(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, parts: list[LayerParts],
                  input_norms: list[torch.Tensor], attend: Callable[[int], Attend],
                  keep_hidden: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    """Every decoder layer over the embedded inputs x [B, W, H] (`attend(i)`: layer i's attention) -> (the last
    layer's output, before the final norm; with `keep_hidden`, the embeddings and every layer's output)."""
    hidden = [x] if keep_hidden else None
    h = rms_norm(x, input_norms[0], parts[0].eps)
    for i, layer in enumerate(parts):
        x, update = decoder_layer(x, h, cos, sin, layer, attend(i))
        if i + 1 < len(parts):  # the residual add fused with the next layer's input norm
            x, h = add_norm(x, update, input_norms[i + 1], parts[i + 1].eps)
        else:
            x = x + update
        if hidden is not None:
            hidden.append(x)
    return x, hidden


def _eager_parts(layer: nn.Module, layout: str) -> tuple[LayerParts, torch.Tensor]:
    """A model layer's parts for the eager forward (its fused products in `layout`), and its input norm's weight."""
    attn, mlp = layer.self_attn, layer.mlp
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    parts = LayerParts(
        qkv=_fused([attn.q_proj, attn.k_proj, attn.v_proj], layout), o=attn.o_proj,
        gate_up=_fused([mlp.gate_proj, mlp.up_proj], layout), down=mlp.down_proj,
        post_norm=layer.post_attention_layernorm.weight,
        q_norm=q_norm.weight if q_norm is not None else None, k_norm=k_norm.weight if k_norm is not None else None,
        eps=layer.input_layernorm.variance_epsilon, q_size=attn.q_proj.out_features, head_dim=attn.head_dim,
        scaling=attn.scaling)
    return parts, layer.input_layernorm.weight


class _CompiledStack(nn.Module):
    """The decoder layers as one graph for torch.compile: each layer's committed keys and values come in as views of
    the cache and its new ones go out (the caller writes them), so the graph mutates nothing it is given. The
    weights are this module's parameters (the same tensors the eager forward uses), which inductor's freezing folds
    into the graph as constants; each product runs on the kernels of the layer it came from where that layer has a
    plan (`traceable_product`), else on inductor's."""

    _PRODUCTS = ("qkv", "o", "gate_up", "down")

    def __init__(self, parts: list[LayerParts], input_norms: list[torch.Tensor]) -> None:
        super().__init__()
        self.specs = [(p.eps, p.q_size, p.head_dim, p.scaling) for p in parts]
        self.products = {}  # name -> each layer's (x, weight, bias) -> product, on the kernels its layout chose
        for name in self._PRODUCTS:
            modules = [getattr(p, name) for p in parts]
            self.products[name] = [traceable_product(m) for m in modules]
            self.register_module(name, nn.ParameterList([m.weight for m in modules]))
            if modules[0].bias is not None:
                self.register_module(f"{name}_bias", nn.ParameterList([m.bias for m in modules]))
        self.input_norm = nn.ParameterList(input_norms)
        self.post_norm = nn.ParameterList([p.post_norm for p in parts])
        self.q_norm = nn.ParameterList([p.q_norm for p in parts if p.q_norm is not None])
        self.k_norm = nn.ParameterList([p.k_norm for p in parts if p.k_norm is not None])

    def _product(self, name: str, i: int) -> Product:
        weight = getattr(self, name)[i]
        bias = getattr(self, f"{name}_bias")[i] if hasattr(self, f"{name}_bias") else None
        product = self.products[name][i]
        return lambda x: product(x, weight, bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, W, H] embedded inputs; keys/values[i] [B, KV, S, D] layer i's first S slots; mask [B, 1, W, S + W]
        over those slots then the W new entries -> (hidden states [L + 1, B, W, H]: the embeddings and every
        layer's output, the last before the final norm; new keys and values [L, B, KV, W, D])."""
        new_keys, new_values = [], []
        parts = [LayerParts(*(self._product(name, i) for name in self._PRODUCTS), post_norm=self.post_norm[i],
                            q_norm=self.q_norm[i] if len(self.q_norm) else None,
                            k_norm=self.k_norm[i] if len(self.k_norm) else None,
                            eps=eps, q_size=q_size, head_dim=head_dim, scaling=scaling)
                 for i, (eps, q_size, head_dim, scaling) in enumerate(self.specs)]

        def attend(i: int) -> Attend:
            def over_committed_and_new(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                new_keys.append(k)
                new_values.append(v)
                return F.scaled_dot_product_attention(q, torch.cat([keys[i], k], dim=2),
                                                      torch.cat([values[i], v], dim=2), attn_mask=mask,
                                                      scale=parts[i].scaling, enable_gqa=q.shape[1] != k.shape[1])
            return over_committed_and_new

        _, hidden = decoder_stack(x, cos, sin, parts, list(self.input_norm), attend, keep_hidden=True)
        return torch.stack(hidden), torch.stack(new_keys), torch.stack(new_values)


@dataclass
class LeanOutput:
    logits: torch.Tensor  # [B, W or logits_to_keep, V]
    hidden_states: tuple[torch.Tensor, ...] | None  # as HF's: embeddings, each layer's output, the last normed


class LeanForward:
    """The forward of a Llama-family target over a `BatchKVCache` window (see the module doc). Build it with
    `lean_forward(model)`, which reuses one per model."""

    def __init__(self, model: PreTrainedModel, compiled: bool = False) -> None:
        reason = lean_unsupported(model)
        if reason:
            raise ValueError(f"the lean forward cannot run {type(model).__name__}: {reason}")
        decoder = decoder_of(model)
        # the model's own modules, not the model: `lean_forward`'s per-model store must not keep the model alive
        self.embed, self.rotary, self.norm = decoder.embed_tokens, decoder.rotary_emb, decoder.norm
        self.head = model.get_output_embeddings()
        built = [_eager_parts(layer, linear_layout(layer)) for layer in decoder.layers]
        self.layers = [parts for parts, _ in built]
        self.input_norms = [norm for _, norm in built]
        self.compiled = compiled
        self.compile_s = 0.0  # wall time of the calls that compiled a graph
        self._stack = None
        self._warm: set[bool] = set()  # row counts (one: False, several: True) whose graphs are compiled
        if compiled:
            device = model.get_input_embeddings().weight.device
            self._stack = compile_stack(_CompiledStack(self.layers, self.input_norms), device)

    @staticmethod
    def span(needed: int) -> int:
        """Key slots attended for a forward that needs `needed` (the longest prefix plus the input width)."""
        return -(-needed // SPAN_STEP) * SPAN_STEP

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache: BatchKVCache,
                 trees: list[DraftTree] | None = None, *, logits_to_keep: int = 0,
                 output_hidden_states: bool = False) -> LeanOutput:
        """input_ids, position_ids [B, W] for the cache's window rows, row b's inputs `trees[b]` padded to W (None:
        each row's inputs are a chain, as in a prefill or plain decoding); each row's new entries are written at its
        length."""
        lengths = cache.window_lengths()
        width = input_ids.shape[1]
        x, cos, sin = self._inputs(input_ids, position_ids)
        if self._stack is not None and cache.layers[0].is_initialized:  # a first prefill sizes the buffers
            hidden = self._compiled(x, cos, sin, cache, trees, lengths)
            x = hidden[-1]
            hidden = tuple(hidden) if output_hidden_states else None
        else:
            span = self.span(max(lengths) + width)
            mask = (causal_mask(lengths, width, span, x.dtype, x.device) if trees is None
                    else batch_tree_mask(trees, lengths, x.dtype, x.device, span=span))
            x, hidden = self._eager(x, cos, sin, cache, mask, output_hidden_states)
        if hidden is None and logits_to_keep:
            x = x[:, -logits_to_keep:]  # only the kept positions need the final norm
        x = self.norm(x)
        if hidden is not None:
            hidden = (*hidden[:-1], x)  # HF's last hidden state is the normed one
            x = x[:, -logits_to_keep:] if logits_to_keep else x
        return LeanOutput(logits=self.head(x), hidden_states=hidden)

    def _inputs(self, input_ids: torch.Tensor, position_ids: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """[B, W] ids and positions -> embeddings [B, W, H] and RoPE's cos and signed sin [B, 1, W, D] (broadcast
        over heads)."""
        x = self.embed(input_ids)
        cos, sin = self.rotary(x, position_ids)
        return x, cos[:, None], signed_sin(sin)[:, None]

    def _eager(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: BatchKVCache, mask: torch.Tensor,
               output_hidden_states: bool) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        def attend(i: int) -> Attend:
            def over_cache(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                keys, values = cache.layers[i].write(k, v, mask.shape[-1])  # the new entries in place, then attended
                return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.layers[i].scaling,
                                                      enable_gqa=q.shape[1] != keys.shape[1])
            return over_cache

        return decoder_stack(x, cos, sin, self.layers, self.input_norms, attend, output_hidden_states)

    def _compiled(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: BatchKVCache,
                  trees: list[DraftTree] | None, lengths: list[int]) -> torch.Tensor:  # [L + 1, B, W, H]
        """The compiled stack over the rows' committed entries, then its new keys and values written in place."""
        # at least one span of slots, all masked for a new row's prompt: an empty committed span would be a graph of
        # its own (torch specialises a size of 0 as it does 1)
        span = self.span(max(*lengths, 1))
        committed = [layer.committed(span) for layer in cache.layers]
        several = x.shape[0] > 1
        if several not in self._warm:
            # torch specialises sizes of 1, so a one-token step and a wider forward (a tree, a prompt) are two
            # graphs for each of one row and several: the first call of either compiles both, the other on inputs
            # whose outputs are dropped, so that no later step (a timed one, a served one) waits for a compile
            self._warm.add(several)
            other = 2 if x.shape[1] == 1 else 1
            ids = torch.zeros(x.shape[0], other, dtype=torch.long, device=x.device)
            positions = torch.tensor(lengths, device=x.device)[:, None] + torch.arange(other, device=x.device)
            self._run_stack(*self._inputs(ids, positions), committed,
                            committed_then_new_mask(None, lengths, other, span, x.dtype, x.device))
        mask = committed_then_new_mask(trees, lengths, x.shape[1], span, x.dtype, x.device)
        hidden, keys, values = self._run_stack(x, cos, sin, committed, mask)
        for layer, k, v in zip(cache.layers, keys, values):
            layer.write(k, v)
        return hidden

    def _run_stack(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   committed: list[tuple[torch.Tensor, torch.Tensor]], mask: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        graphs = counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        with compile_settings():
            out = self._stack(x, cos, sin, [k for k, _ in committed], [v for _, v in committed], mask)
        if counters["stats"]["unique_graphs"] != graphs:
            self.compile_s += time.perf_counter() - start
            log.info("compiled the lean forward for %d row(s) of width %d in %.1f s", x.shape[0], x.shape[1],
                     time.perf_counter() - start)
        return out


_built: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {compiled: its LeanForward}


def target_forward(model: PreTrainedModel, step: str = "auto", compile: bool = False) -> LeanForward | None:
    """The lean forward `step` picks for `model` (`resolve_step`), or None for the model's own; `compile` is refused
    where the pick is the model's own forward."""
    kind = resolve_step(step, model)
    if compile and kind != "lean":
        raise ValueError(f"--compile compiles the lean forward, which {type(model).__name__} does not run "
                         f"(step {step!r}); drop --compile, or use --step lean on a family it covers")
    return lean_forward(model, compiled=compile) if kind == "lean" else None


def lean_forward(model: PreTrainedModel, compiled: bool = False) -> LeanForward:
    """The model's `LeanForward` (`compiled`: its elementwise work compiled), built once per model: its fused weights
    are copies, so build it after the model's last change (`load_target` returns it finished)."""
    forwards = _built.setdefault(model, {})
    if compiled not in forwards:
        forwards[compiled] = LeanForward(model, compiled)
    return forwards[compiled]
