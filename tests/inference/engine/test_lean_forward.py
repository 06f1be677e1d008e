"""The lean target forward: the HF forward's logits and hidden states up to product rounding, on every family it
covers; every method's greedy output equal to plain greedy decoding through it (rows and trees included); families it
does not cover refused by name or left to the HF forward."""

from __future__ import annotations

import pytest
import torch

from specheads.gemm_layout import PlannedLinear, packing_available, set_linear_layout
from specheads.hf import cache_kwargs
from specheads.inference.engine.batch_cache import BatchKVCache
from specheads.inference.engine.engine import Engine
from specheads.inference.engine.forward import batch_forward, prefill_forward
from specheads.inference.engine.lean_forward import SPAN_STEP, lean_forward, lean_unsupported, resolve_step
from specheads.inference.engine.proposer import AutoregressiveProposer
from specheads.inference.engine.tree import DraftTree
from specheads.inference.proposers.draft_model import DraftConfig, DraftModelProposer
from specheads.inference.proposers.ngram import NgramConfig, NgramProposer
from tests.conftest import perturbed_copy, repetitive_prompt, tiny_model
from tests.inference.engine.test_engine_rows import MAX_NEW, PROMPTS, decode_together

FAMILIES = ["llama", "qwen2", "qwen3", "mistral"]
# The compiled stack is one graph of every layer, each the same code: two layers check what four would, and halve
# inductor's compile time.
COMPILED_LAYERS = 2
TREE = DraftTree(tokens=torch.tensor([5, 6, 7, 8, 9]), parents=torch.tensor([-1, 0, 0, 1, 1]))


def _forwards(model, lean, prompts: list[list[int]], trees: list[DraftTree]):
    """Prefill each prompt into its row, then verify `trees` (one per row) in one forward; (prefill outputs, verify
    output), through the lean forward or (lean None) the model's own."""
    cache = BatchKVCache(model.config, rows=len(prompts), capacity=8)  # small: the forwards must grow it
    prefills = []
    for prompt in prompts:
        row = cache.add_row()
        prefills.append(prefill_forward(model, cache, row, torch.tensor(prompt), output_hidden_states=True, lean=lean))
        cache.commit(row, torch.arange(len(prompt)))
    return prefills, batch_forward(model, cache, trees, output_hidden_states=True, lean=lean)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # fused products sum the same terms in another blocking: differences of a few fp32 ulps of the largest value
    scale = want.abs().max().item()
    torch.testing.assert_close(got, want, rtol=0, atol=64 * torch.finfo(want.dtype).eps * max(scale, 1.0))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_logits_and_hidden_states_are_the_hf_forwards(arch, compiled, monkeypatch):
    """Compiled, the second row's prefill and the two-row verify run the compiled graph (the first prefill sizes
    the cache eagerly): rows of different lengths, a tree, and a narrower tree's padding. Qwen3's weights are in a
    planned layout, whose products the compiled graph runs on each layer's own kernels (`specheads::planned_linear`):
    every fused product of every layer runs through its PlannedLinear each time; the other families' products are
    inductor's."""
    model = tiny_model(arch, layers=COMPILED_LAYERS)
    assert lean_unsupported(model) is None
    if arch == "qwen3":
        set_linear_layout(model, "packed" if packing_available(torch.float32) else "transposed")
    calls = []
    forward = PlannedLinear.forward
    monkeypatch.setattr(PlannedLinear, "forward", lambda self, x: calls.append(self) or forward(self, x))
    prompts = [repetitive_prompt(19, seed=1), repetitive_prompt(7, seed=2)]  # rows of different lengths
    trees = [TREE, DraftTree(tokens=torch.tensor([3, 4]), parents=torch.tensor([-1, 0]))]
    hf_pre, hf_out = _forwards(model, None, prompts, trees)
    calls.clear()
    lean = lean_forward(model, compiled=compiled)
    lean_pre, lean_out = _forwards(model, lean, prompts, trees)
    for hf, got in [*zip(hf_pre, lean_pre), (hf_out, lean_out)]:
        assert got.logits.shape == hf.logits.shape
        _close(got.logits, hf.logits)
        assert len(got.hidden_states) == len(hf.hidden_states) == model.config.num_hidden_layers + 1
        for mine, want in zip(got.hidden_states, hf.hidden_states):
            _close(mine, want)
    # the verify's padding (row 2's tree is narrower) is never read; the real nodes match, checked above
    if arch == "qwen3":  # two prefills and the verify, and compiled each graph's first call warms its sibling up
        fused = {id(m) for parts in lean.layers for m in (parts.qkv, parts.o, parts.gate_up, parts.down)}
        ran = [id(m) for m in calls if id(m) in fused]
        assert set(ran) == fused and len(ran) == (5 if compiled else 3) * len(fused)


def test_attended_slots_round_up_to_few_shapes():
    assert [lean_forward(tiny_model()).span(n) for n in (1, SPAN_STEP, SPAN_STEP + 1)] == [
        SPAN_STEP, SPAN_STEP, 2 * SPAN_STEP]


@pytest.mark.parametrize("arch", FAMILIES)
def test_every_method_decodes_plain_greedy_through_the_lean_forward(arch):
    model = tiny_model(arch)
    prompt = repetitive_prompt(seed=1)
    hf = Engine(model, AutoregressiveProposer(), step="hf").generate(prompt, max_new_tokens=40).output_ids
    ar = Engine(model, AutoregressiveProposer(), step="lean")
    assert ar.lean is not None
    assert ar.generate(prompt, max_new_tokens=40).output_ids == hf
    draft = perturbed_copy(model, noise=0.05)
    for proposer in (NgramProposer(NgramConfig(num_candidates=5, depth=6, max_nodes=20, min_ngram=1)),
                     DraftModelProposer(draft, DraftConfig(depth=3, width=3))):
        res = Engine(model, proposer, step="lean").generate(prompt, max_new_tokens=40)
        assert res.output_ids == hf
        assert res.stats.accepted > 0  # trees were verified and multi-token paths committed


def test_rows_decode_through_the_lean_forward_as_each_would_alone():
    model = tiny_model("qwen2")
    alone = [Engine(model, AutoregressiveProposer(), step="hf").generate(p, max_new_tokens=m).output_ids
             for p, m in zip(PROMPTS, MAX_NEW)]
    engine = Engine(model, DraftModelProposer(perturbed_copy(model, 0.02)), max_rows=3, step="lean")
    assert decode_together(engine) == alone


@pytest.mark.skipif(not packing_available(), reason="oneDNN bf16 packing is not available on this CPU")
def test_packed_bf16_weights_stay_packed_in_the_fused_products():
    model = set_linear_layout(tiny_model().to(torch.bfloat16), "packed")
    lean = lean_forward(model)
    assert type(lean.layers[0].qkv).__name__ == type(lean.layers[0].gate_up).__name__ == "PlannedLinear"
    prompt = torch.tensor(repetitive_prompt(12))
    (hf,), _ = _forwards(model, None, [prompt.tolist()], [TREE])
    (got,), _ = _forwards(model, lean, [prompt.tolist()], [TREE])
    # bf16 keeps 8 bits: the two forwards' logits agree to a few bf16 ulps of the largest
    scale = hf.logits.abs().max().item()
    assert (got.logits.float() - hf.logits.float()).abs().max().item() <= 8 * 2**-8 * scale


def test_steps_resolve_by_family():
    llama = tiny_model()
    assert resolve_step("auto", llama) == "lean" and resolve_step("hf", llama) == "hf"
    with pytest.raises(ValueError, match="unknown step 'fast'"):
        resolve_step("fast", llama)
    windowed = tiny_model("mistral")
    windowed.config.sliding_window = 16
    assert "sliding-window" in lean_unsupported(windowed)
    assert resolve_step("auto", windowed) == "hf"
    with pytest.raises(ValueError, match="--step lean cannot run MistralForCausalLM: it uses sliding-window"):
        Engine(windowed, AutoregressiveProposer(), step="lean")


def test_a_layer_of_another_shape_is_refused_by_name():
    model = tiny_model()
    model.model.layers[1].extra_norm = torch.nn.LayerNorm(4)  # as Gemma's pre/post feed-forward norms
    assert "decoder layer holds" in lean_unsupported(model)
    assert Engine(model, AutoregressiveProposer()).lean is None


def test_the_lean_forward_is_built_once_per_model_and_does_not_keep_it_alive():
    import gc
    import weakref

    model = tiny_model()
    assert lean_forward(model) is lean_forward(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_the_hf_forward_still_writes_through_the_cache_update():
    # the HF path and the lean path share the cache's write: an HF forward leaves keys the lean one then reads
    model = tiny_model()
    prompt = repetitive_prompt(10)
    cache = BatchKVCache(model.config, rows=1, capacity=8)
    row = cache.add_row()
    model(input_ids=torch.tensor([prompt]), **cache_kwargs(model, cache.window(row, 1)), logits_to_keep=1)
    cache.commit(row, torch.arange(len(prompt)))
    lean_next = batch_forward(model, cache, [TREE], lean=lean_forward(model)).logits
    hf_next = batch_forward(model, cache, [TREE]).logits
    _close(lean_next, hf_next)


def test_the_compiled_forward_decodes_plain_greedy_and_never_recompiles_per_step():
    from torch._dynamo.utils import counters

    model = tiny_model("qwen3", layers=COMPILED_LAYERS)  # the per-head norms go through the compiled code too
    prompts = [repetitive_prompt(seed=1), repetitive_prompt(length=13, seed=2)]
    plain = [Engine(model, AutoregressiveProposer(), step="hf").generate(p, max_new_tokens=30).output_ids
             for p in prompts]
    engine = Engine(model, NgramProposer(NgramConfig(num_candidates=5, depth=6, max_nodes=20, min_ngram=1)),
                    step="lean", compile=True)
    assert engine.lean.compiled
    first = engine.generate(prompts[0], max_new_tokens=30)  # compiles: a prefill, one-token steps, trees
    assert first.output_ids == plain[0]
    graphs = counters["stats"]["unique_graphs"]
    assert graphs > 0
    draft = Engine(model, DraftModelProposer(perturbed_copy(model, 0.05), DraftConfig(depth=3, width=3)),
                   step="lean", compile=True)
    second = draft.generate(prompts[1], max_new_tokens=30)  # another prompt length, other tree widths
    assert second.output_ids == plain[1] and second.stats.accepted > 0
    assert counters["stats"]["unique_graphs"] == graphs  # no width, length or step compiled anew


def test_the_first_compiled_step_compiles_the_graph_a_later_prompt_needs():
    """Plain decoding runs one-token steps only; a later prompt into the warm cache runs the wider graph, which the
    first step compiled beside its own, so no generation after the first waits for a compile."""
    from torch._dynamo.utils import counters

    model = tiny_model("llama", layers=COMPILED_LAYERS)
    prompts = [repetitive_prompt(seed=3), repetitive_prompt(length=17, seed=4)]
    plain = [Engine(model, AutoregressiveProposer(), step="hf").generate(p, max_new_tokens=12).output_ids
             for p in prompts]
    engine = Engine(model, AutoregressiveProposer(), step="lean", compile=True)
    assert engine.generate(prompts[0], max_new_tokens=12).output_ids == plain[0]
    graphs = counters["stats"]["unique_graphs"]
    assert engine.generate(prompts[1], max_new_tokens=12).output_ids == plain[1]
    assert counters["stats"]["unique_graphs"] == graphs and engine.lean.compile_s > 0


def test_compile_is_refused_without_the_lean_forward():
    with pytest.raises(ValueError, match="--compile compiles the lean forward"):
        Engine(tiny_model(), AutoregressiveProposer(), step="hf", compile=True)
