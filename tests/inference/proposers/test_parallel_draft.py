"""The parallel drafter: one draft forward per step, greedy output equal to plain greedy, sampling that keeps the
target's law, and a drafter trained on a constructed case whose one forward reproduces K sequential target calls."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from specheads.draft_models import ParallelSpec, early_exit_model, parallel_spec
from specheads.inference import Engine
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.parallel_draft import ParallelDraftProposer
from specheads.train.distill import DistillSettings, build_drafter, distill_step_loss, with_placeholder
from tests.conftest import TINY_VOCAB, repetitive_prompt, start_proposer, tiny_model
from tests.drafters import (
    SAMPLES,
    bigram_target,
    check_engine_keeps_the_law,
)


def saved_parallel_drafter(target: torch.nn.Module, folder: Path, k: int = 3, layers: int = 2) -> Path:
    """An untrained parallel drafter (the target's first layers plus a placeholder row), saved as a model folder."""
    drafter = build_drafter(DistillSettings(init=f"early-exit:{layers}", parallel_k=k), target).model
    drafter.save_pretrained(folder)
    return folder


def draft_proposer(target: torch.nn.Module, folder: Path, **values):
    options = METHODS.get("draft").make_options({"draft": str(folder), **values})
    return make_proposer("draft", target, options, AutoModelForCausalLM.from_pretrained)


def decode_counting(target: torch.nn.Module, proposer: ParallelDraftProposer, prompt: list[int]):
    """(the generation, draft forwards, drafts proposed) of one greedy decode."""
    forwards, drafts = [], []
    proposer.model.register_forward_hook(lambda module, args, out: forwards.append(1))
    propose = proposer.propose
    proposer.propose = lambda ctx: drafts.append(propose(ctx)) or drafts[-1]
    return Engine(target, proposer).generate(prompt, max_new_tokens=40), len(forwards), drafts


@pytest.mark.parametrize("values", [{}, {"width": 3}, {"depth": 2}], ids=["chain", "width3", "depth2"])
def test_greedy_equals_plain_greedy_with_one_draft_forward_per_step(tmp_path, values):
    target = tiny_model("llama")
    folder = saved_parallel_drafter(target, tmp_path / "parallel")
    for seed in (1, 2):
        prompt = repetitive_prompt(seed=seed)
        plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=40)
        proposer = draft_proposer(target, folder, **values)
        assert isinstance(proposer, ParallelDraftProposer)
        res, forwards, drafts = decode_counting(target, proposer, prompt)
        assert res.output_ids == plain.output_ids, values
        # Every step that drafts (all but the prefill and those with no room left) takes exactly one draft forward.
        assert forwards == sum(tree.size > 1 for tree in drafts) >= res.stats.steps - 3
        width, depth = values.get("width", 1), values.get("depth", 3)
        assert 0 < res.stats.drafted <= (res.stats.steps - 1) * width * depth


def test_sampling_preserves_the_target_distribution():
    """The first two sampled tokens against the target's exact law, on a target whose next token the parallel
    drafter's first position predicts well (the target's first layer, its LM head slightly perturbed so drafts get
    rejected too); a verifier that keeps a rejected draft must fail the same test."""
    target = bigram_target()
    drafter = copy.deepcopy(early_exit_model(target, 1))
    with_placeholder(drafter, ParallelSpec(k=3, mask_token_id=TINY_VOCAB))
    with torch.no_grad():
        drafter.lm_head.weight.add_(torch.randn(drafter.lm_head.weight.shape,
                                                generator=torch.Generator().manual_seed(0)) * 0.02)
    engine = Engine(target, ParallelDraftProposer(drafter, parallel_spec(drafter.config)))
    # drafts are accepted ~9 times in 10 here: at half the samples the control is still rejected at p < 1e-12
    check_engine_keeps_the_law(engine, target, samples=SAMPLES // 2)


def test_a_drafter_trained_on_a_constructed_case_drafts_k_sequential_target_tokens_in_one_forward():
    """Distilled on the target's own greedy continuations of four prompts, the parallel drafter's one forward
    returns what three sequential target calls return there."""
    torch.manual_seed(0)
    target = tiny_model("llama")
    prompts = [torch.randint(3, 90, (8,), generator=torch.Generator().manual_seed(s)).tolist() for s in range(4)]
    continued = [Engine(target, AutoregressiveProposer()).generate(p, max_new_tokens=6).output_ids for p in prompts]
    ids = torch.tensor([p + c for p, c in zip(prompts, continued)])  # [4, 14]
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
             "loss_mask": torch.cat([torch.zeros(4, 8), torch.ones(4, 6)], 1).long()}
    settings = DistillSettings(init="early-exit:3", parallel_k=3, cod_keep_rate=1.0)
    drafter = build_drafter(settings, target)
    optimizer = torch.optim.Adam(drafter.parameters(), lr=3e-3)
    for _ in range(150):
        loss, _ = distill_step_loss(drafter, target, batch, settings)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    proposer = ParallelDraftProposer(drafter.model.eval(), parallel_spec(drafter.model.config))
    for prompt, tokens in zip(prompts, continued):
        # After the prompt's prefill and one committed token, the draft is the target's next three greedy tokens.
        ctx = start_proposer(proposer, target, prompt + tokens[:1])
        assert proposer.propose(ctx).tokens[1:].tolist() == tokens[1:4]


def test_bad_parallel_settings_are_named(tmp_path):
    target = tiny_model("llama")
    folder = saved_parallel_drafter(target, tmp_path / "parallel", k=3)
    with pytest.raises(ValueError, match=r"--depth 5: this parallel drafter drafts 1 to 3 tokens per forward"):
        draft_proposer(target, folder, depth=5)
    bigger = tiny_model("llama", vocab=TINY_VOCAB + 8)
    with pytest.raises(ValueError, match=r"has 97 LM head rows and mask token 96, but the target's vocabulary has 104"):
        draft_proposer(bigger, folder)
    with pytest.raises(ValueError, match=r"drafter.parallel_k must be >= 1"):
        DistillSettings(parallel_k=0)


def test_hf_assisted_refuses_a_parallel_drafter_by_name(tmp_path):
    from specheads.inference.bench.method_spec import parse_methods
    from specheads.inference.bench.runner import build_runners

    target = tiny_model("llama")
    folder = saved_parallel_drafter(target, tmp_path / "parallel")
    with pytest.raises(ValueError, match=r"is a parallel drafter .* bench it as draft:"):
        build_runners(target, parse_methods(f"hf-assisted:{folder}"), AutoModelForCausalLM.from_pretrained)


def test_the_cli_benches_a_saved_parallel_drafter_exactly(tiny_model_dir, tmp_path, capsys):
    """`specheads bench` loads a parallel drafter folder (its vocabulary one placeholder row longer) as `draft:`."""
    import json

    from specheads.inference.cli import main
    from tests.conftest import tiny_tokenizer

    target = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    folder = saved_parallel_drafter(target, tmp_path / "parallel")
    tiny_tokenizer().save_pretrained(folder)
    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [f"w{i} w{i + 3} w{i + 6}"]})
                                 + "\n" for i in range(3)))
    code = main(["bench", "--target", str(tiny_model_dir), "--methods", f"ar,draft:{folder}", "--questions",
                 str(questions), "--max-new-tokens", "16", "--output", str(tmp_path / "bench"), "--no-plots"])
    assert code == 0, capsys.readouterr().err
    summary = {s["method"]: s for s in json.loads((tmp_path / "bench" / "summary.json").read_text())
               if s["category"] == "all"}
    assert summary[f"draft:{folder}"]["exact_matches"] == "3/3" and summary[f"draft:{folder}"]["tau"] >= 1.0
