"""CUDA output equals CPU output for the training-free methods (fp32), and bf16 greedy decoding stays exact vs bf16
`ar`; every drafter kind gets the same checks in tests/test_drafters.py."""

from __future__ import annotations

import pytest
import torch

from specheads.draft_models import early_exit_model
from specheads.inference import Engine, SamplingParams
from specheads.inference.methods.options import LookaheadConfig
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.draft_model import DraftConfig, DraftModelProposer
from specheads.inference.proposers.lookahead import LookaheadProposer
from specheads.inference.proposers.ngram import NgramProposer
from specheads.inference.proposers.suffix import SuffixProposer
from tests.conftest import GPU_TEST_DEVICE, repetitive_prompt, tiny_model

pytestmark = pytest.mark.gpu


def proposers(target):
    yield "ar", AutoregressiveProposer()
    yield "ngram", NgramProposer()
    yield "suffix", SuffixProposer()
    yield "lookahead", LookaheadProposer(LookaheadConfig(lazy_window=False))  # the window in every verify forward
    yield "early-exit", DraftModelProposer(early_exit_model(target, 2), DraftConfig(depth=3, width=2))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_matches_cpu(arch):
    cpu = tiny_model(arch)
    gpu = tiny_model(arch).to(GPU_TEST_DEVICE)
    prompt = repetitive_prompt()
    reference = Engine(cpu, AutoregressiveProposer()).generate(prompt, max_new_tokens=32).output_ids
    for name, proposer in proposers(gpu):
        out = Engine(gpu, proposer).generate(prompt, max_new_tokens=32).output_ids
        assert out == reference, name


def test_bf16_speculation_equals_bf16_ar_and_sampling_runs():
    model = tiny_model("llama").to(GPU_TEST_DEVICE, torch.bfloat16)
    prompt = repetitive_prompt()
    ar = Engine(model, AutoregressiveProposer()).generate(prompt, max_new_tokens=32).output_ids
    for name, proposer in proposers(model):
        assert Engine(model, proposer).generate(prompt, max_new_tokens=32).output_ids == ar, name
        res = Engine(model, proposer).generate(prompt, max_new_tokens=16,
                                               sampling=SamplingParams(temperature=1.0, seed=0))
        assert res.stats.new_tokens == 16
