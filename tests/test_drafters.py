"""Every registered drafter kind, through the registries: greedy output equals plain greedy on tiny Llama and
Qwen2 targets, sampling preserves the target's distribution, checkpoints roundtrip and the strict loader refuses
what does not fit, and (with a GPU) CUDA decodes as the CPU does. A kind with no DRAFTERS entry fails here."""

from __future__ import annotations

import pytest
import torch

from specheads import gemm_choice
from specheads.formats.load import load_heads
from specheads.gemm_layout import linear_layout, packing_available, resolve_layout, set_linear_layout
from specheads.inference import Engine, SamplingParams
from specheads.inference.methods import METHODS
from specheads.kinds import KINDS
from specheads.train.objective import OBJECTIVES
from tests.conftest import GPU_TEST_DEVICE, repetitive_prompt, tiny_model
from tests.drafters import (
    DRAFTERS,
    MAX_NEW,
    check_greedy_equals_plain_greedy,
    check_roundtrip,
    check_sampling_preserves_the_target_distribution,
    check_strict_loader,
    proposer_for,
    save_case,
)

KIND_NAMES = KINDS.names()


def test_every_kind_has_a_drafters_entry_an_objective_and_a_method():
    assert set(DRAFTERS) == set(KIND_NAMES), "add an entry to tests/drafters.py for every registered kind"
    for name in KIND_NAMES:
        assert name in METHODS, f"kind {name} has no decoding method"
        assert any(o.kind == name for _, o in OBJECTIVES.items()), f"kind {name} has no training objective"


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_greedy_equals_plain_greedy(kind, target, tmp_path):
    check_greedy_equals_plain_greedy(kind, target, tmp_path)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_checkpoint_roundtrip(kind, tmp_path):
    check_roundtrip(kind, tiny_model("llama"), tmp_path)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_strict_loader_refuses_what_does_not_fit(kind, tmp_path):
    check_strict_loader(kind, tiny_model("llama"), tmp_path)


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_sampling_preserves_the_target_distribution(kind, tmp_path):
    check_sampling_preserves_the_target_distribution(kind, tmp_path)


@pytest.mark.parametrize("kind", KIND_NAMES)
def test_a_bf16_target_on_cpu_decodes_with_every_option(kind, tmp_path):
    # bf16 on CPU is opt-in and within a stated rule (not token for token), so this checks that every option set,
    # int8 drafts of bf16 heads included, drafts and decodes in the layout `auto` picks (packed on native bf16)
    target = set_linear_layout(tiny_model("llama").to(torch.bfloat16), resolve_layout("auto", "cpu", torch.bfloat16))
    save_case(kind, target, tmp_path)
    for values in DRAFTERS[kind].options:
        res = Engine(target, proposer_for(kind, target, tmp_path, values)).generate(repetitive_prompt(),
                                                                                     max_new_tokens=MAX_NEW)
        assert res.stats.drafted > 0 and res.stats.new_tokens == MAX_NEW, (kind, values)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_cuda_decodes_as_the_cpu_and_bf16_speculation_equals_bf16_ar(kind, arch, tmp_path):
    from specheads.inference.proposers import AutoregressiveProposer

    cpu = tiny_model(arch)
    save_case(kind, cpu, tmp_path)
    prompt = repetitive_prompt()
    reference = Engine(cpu, AutoregressiveProposer()).generate(prompt, max_new_tokens=MAX_NEW).output_ids
    gpu = tiny_model(arch).to(GPU_TEST_DEVICE)
    for values in DRAFTERS[kind].options:
        out = Engine(gpu, proposer_for(kind, gpu, tmp_path, values)).generate(prompt, max_new_tokens=MAX_NEW)
        assert out.output_ids == reference, (kind, values)
    bf16 = tiny_model(arch).to(GPU_TEST_DEVICE, torch.bfloat16)
    ar = Engine(bf16, AutoregressiveProposer()).generate(prompt, max_new_tokens=MAX_NEW).output_ids
    for values in DRAFTERS[kind].options:
        engine = Engine(bf16, proposer_for(kind, bf16, tmp_path, values))
        assert engine.generate(prompt, max_new_tokens=MAX_NEW).output_ids == ar, (kind, values)
        sampled = engine.generate(prompt, max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=0))
        assert sampled.stats.new_tokens == 16


MIXED_PLAN = ("packed", "transposed", "row", "packed", "transposed", "row", "packed")  # a kernel per row bucket


@pytest.mark.parametrize("layout", ["column", "transposed", "packed", "measured"])
@pytest.mark.parametrize("kind", KIND_NAMES)
def test_greedy_equals_plain_greedy_with_another_weight_layout(kind, layout, tmp_path, monkeypatch):
    """Every weight form the engine can pick on CPU in fp32 (column-major weights, transposed products, oneDNN's
    packed weights, and `--weight-layout auto`'s measured plan, here one that changes kernel with the row count): the
    heads load in the target's layout too; only GEMM kernels change, so outputs still equal plain greedy (in the same
    layout)."""
    if layout == "packed" and not packing_available(torch.float32):
        pytest.skip("oneDNN packs no fp32 weights on this CPU")
    monkeypatch.setattr(gemm_choice, "plans", lambda shapes, dtype: {
        s: MIXED_PLAN if packing_available(dtype) else tuple(k.replace("packed", "row") for k in MIXED_PLAN)
        for s in shapes})
    target = set_linear_layout(tiny_model("llama"), layout)
    check_greedy_equals_plain_greedy(kind, target, tmp_path, DRAFTERS[kind].options[:2])
    assert linear_layout(load_heads(tmp_path, target, kind=kind)) == layout
