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
   on a GPU. On CPU, inductor's freezing takes the weights as constants and reorders them once for its own
   products, so a step is a few hundred fused kernels and products with no Python between them. The embedding,
   RoPE's tables, the final norm and the LM head stay eager (so `--fp32-head` applies unchanged), and so does a
   row's first prefill, which sizes the cache.

Its outputs equal the HF forward's up to the rounding of the fused products (and, compiled, of inductor's
kernels). Every engine method, `ar` included,
runs through the same forward, so speculative greedy output still equals plain greedy output
(tests/inference/engine/test_lean_forward.py). Families it covers are listed in LEAN_MODEL_TYPES; any other target
runs the HF forward (`step="auto"`), or is refused by name (`step="lean"`).
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch._dynamo.utils import counters
from transformers import PreTrainedModel

from specheads.gemm_layout import linear_layout, set_linear_layout
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



class _LeanLayer:
    def __init__(self, layer: nn.Module, layout: str) -> None:
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm.weight, layer.post_attention_layernorm.weight
        self.eps = layer.input_layernorm.variance_epsilon
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.q_norm, self.k_norm = (q_norm.weight, k_norm.weight) if q_norm is not None else (None, None)
        self.head_dim, self.scaling, self.q_size = attn.head_dim, attn.scaling, attn.q_proj.out_features
        self.qkv = _fused([attn.q_proj, attn.k_proj, attn.v_proj], layout)
        self.gate_up = _fused([mlp.gate_proj, mlp.up_proj], layout)
        self.o_proj, self.down_proj = attn.o_proj, mlp.down_proj

    def __call__(self, x: torch.Tensor, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache_layer,
                 mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(residual stream x, its input norm h) -> (x after the layer, the MLP's output to add to it)."""
        b, w, _ = x.shape
        q, k, v = attention_inputs(self.qkv(h), cos, sin, self.q_norm, self.k_norm, self.eps, self.q_size,
                                   self.head_dim)
        keys, values = cache_layer.write(k, v, mask.shape[-1])
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                             enable_gqa=q.shape[1] != keys.shape[1])
        x, h = add_norm(x, self.o_proj(out.transpose(1, 2).reshape(b, w, -1)), self.post_norm, self.eps)
        return x, self.down_proj(gated(self.gate_up(h)))


class _CompiledStack(nn.Module):
    """The decoder layers as one graph for torch.compile: each layer's committed keys and values come in as views of
    the cache and its new ones go out (the caller writes them), so the graph mutates nothing it is given. The
    weights are this module's parameters (the same tensors the eager forward uses), which inductor's freezing folds
    into the graph as constants and, on CPU, reorders once for its own products."""

    def __init__(self, layers: list[_LeanLayer]) -> None:
        super().__init__()
        self.specs = [(layer.eps, layer.q_size, layer.head_dim, layer.scaling) for layer in layers]
        self.qkv = nn.ParameterList([layer.qkv.weight for layer in layers])
        self.o = nn.ParameterList([layer.o_proj.weight for layer in layers])
        self.gate_up = nn.ParameterList([layer.gate_up.weight for layer in layers])
        self.down = nn.ParameterList([layer.down_proj.weight for layer in layers])
        self.input_norm = nn.ParameterList([layer.input_norm for layer in layers])
        self.post_norm = nn.ParameterList([layer.post_norm for layer in layers])
        self.q_norm = nn.ParameterList([layer.q_norm for layer in layers if layer.q_norm is not None])
        self.k_norm = nn.ParameterList([layer.k_norm for layer in layers if layer.k_norm is not None])
        biases = {name: [getattr(layer, name).bias for layer in layers] for name in ("qkv", "o_proj", "gate_up",
                                                                                       "down_proj")}
        self.biases = {name: nn.ParameterList(b) if b[0] is not None else None for name, b in biases.items()}
        for name, b in self.biases.items():
            if b is not None:
                self.register_module(f"{name}_bias", b)

    def _bias(self, name: str, i: int) -> torch.Tensor | None:
        b = self.biases[name]
        return b[i] if b is not None else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: list[torch.Tensor],
                values: list[torch.Tensor], mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, W, H] embedded inputs; keys/values[i] [B, KV, S, D] layer i's first S slots; mask [B, 1, W, S + W]
        over those slots then the W new entries -> (hidden states [L + 1, B, W, H]: the embeddings and every
        layer's output, the last before the final norm; new keys and values [L, B, KV, W, D])."""
        b, w, _ = x.shape
        hidden, new_keys, new_values = [x], [], []
        h = rms_norm(x, self.input_norm[0], self.specs[0][0])
        for i, (eps, q_size, head_dim, scaling) in enumerate(self.specs):
            q_norm = self.q_norm[i] if len(self.q_norm) else None
            k_norm = self.k_norm[i] if len(self.k_norm) else None
            q, k, v = attention_inputs(F.linear(h, self.qkv[i], self._bias("qkv", i)), cos, sin, q_norm, k_norm, eps,
                                       q_size, head_dim)
            new_keys.append(k)
            new_values.append(v)
            out = F.scaled_dot_product_attention(q, torch.cat([keys[i], k], dim=2), torch.cat([values[i], v], dim=2),
                                                 attn_mask=mask, scale=scaling, enable_gqa=q.shape[1] != k.shape[1])
            x, h = add_norm(x, F.linear(out.transpose(1, 2).reshape(b, w, -1), self.o[i], self._bias("o_proj", i)),
                            self.post_norm[i], eps)
            update = F.linear(gated(F.linear(h, self.gate_up[i], self._bias("gate_up", i))), self.down[i],
                              self._bias("down_proj", i))
            if i + 1 < len(self.specs):
                x, h = add_norm(x, update, self.input_norm[i + 1], self.specs[i + 1][0])
            else:
                x = x + update
            hidden.append(x)
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
        self.layers = [_LeanLayer(layer, linear_layout(layer)) for layer in decoder.layers]
        self.compiled = compiled
        self.compile_s = 0.0  # wall time of the calls that compiled a graph
        self._stack = None
        self._warm: set[bool] = set()  # row counts (one: False, several: True) whose graphs are compiled
        if compiled:
            device = model.get_input_embeddings().weight.device
            # inductor's freezing: weights become constants, reordered once for its CPU products; on CUDA the
            # step runs as a CUDA graph
            # every model's stack shares one code object, and its frozen weights are guarded by identity: each model
            # compiled in a process (a target and its draft model, say) adds a few graphs against dynamo's limit
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
            self._stack = torch.compile(_CompiledStack(self.layers), dynamic=True, fullgraph=True,
                                        mode="reduce-overhead" if device.type == "cuda" else None,
                                        options={"freezing": True} if device.type == "cpu" else None)

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
        hidden = [x] if output_hidden_states else None
        layers = self.layers
        h = rms_norm(x, layers[0].input_norm, layers[0].eps)
        for i, (layer, cache_layer) in enumerate(zip(layers, cache.layers)):
            x, update = layer(x, h, cos, sin, cache_layer, mask)
            if i + 1 < len(layers):  # the residual add fused with the next layer's input norm
                x, h = add_norm(x, update, layers[i + 1].input_norm, layers[i + 1].eps)
            else:
                x = x + update
            if hidden is not None:
                hidden.append(x)
        return x, hidden

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
        # no duck shaping: a width that happens to equal another size (a head count, say) is not tied to it, so the
        # warm-up's width stands for every width
        with torch.fx.experimental._config.patch(use_duck_shape=False):
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
