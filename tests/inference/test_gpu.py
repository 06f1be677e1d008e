"""CUDA output equals CPU output for every method (fp32), and bf16 greedy decoding stays exact vs bf16 `ar`."""

from __future__ import annotations

import pytest
import torch

from specheads.inference import Engine, SamplingParams
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.draft_model import DraftConfig, DraftModelProposer, early_exit_model
from specheads.inference.proposers.eagle import EagleProposer
from specheads.inference.proposers.lookup import WithPromptLookup
from specheads.inference.proposers.medusa import MedusaProposer
from specheads.inference.proposers.ngram import NgramProposer
from specheads.trees import PRESETS
from tests.conftest import random_eagle_head, repetitive_prompt, tiny_model
from tests.inference.test_medusa_proposer import random_heads

pytestmark = pytest.mark.gpu


def proposers(target):
    yield "ar", AutoregressiveProposer()
    yield "ngram", NgramProposer()
    yield "early-exit", DraftModelProposer(early_exit_model(target, 2), DraftConfig(depth=3, width=2))
    yield "eagle", EagleProposer(random_eagle_head(target))
    yield "medusa", MedusaProposer(random_heads(target).to(target.device), PRESETS["medusa-16"])
    yield "eagle+lookup", WithPromptLookup(EagleProposer(random_eagle_head(target)))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_cuda_matches_cpu(arch):
    cpu = tiny_model(arch)
    gpu = tiny_model(arch).to("cuda")
    prompt = repetitive_prompt()
    reference = Engine(cpu, AutoregressiveProposer()).generate(prompt, max_new_tokens=32).output_ids
    for name, proposer in proposers(gpu):
        out = Engine(gpu, proposer).generate(prompt, max_new_tokens=32).output_ids
        assert out == reference, name


def test_bf16_speculation_equals_bf16_ar_and_sampling_runs():
    model = tiny_model("llama").to("cuda", torch.bfloat16)
    prompt = repetitive_prompt()
    ar = Engine(model, AutoregressiveProposer()).generate(prompt, max_new_tokens=32).output_ids
    for name, proposer in proposers(model):
        assert Engine(model, proposer).generate(prompt, max_new_tokens=32).output_ids == ar, name
        res = Engine(model, proposer).generate(prompt, max_new_tokens=16, sampling=SamplingParams(temperature=1.0, seed=0))
        assert res.stats.new_tokens == 16
