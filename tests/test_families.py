"""The family matrix: every drafter kind, n-gram lookup and a draft model decode each decoder family's tiny target
exactly as the target's own forward would (greedy, past the sliding windows), with drafts accepted; heads of
families whose layers do not fit a head get Llama layers of the target's sizes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from specheads.draft_layers import draft_layer_classes, final_norm_scale, source_layer_config
from specheads.heads.medusa import MedusaConfig, MedusaHeads
from specheads.hf import decoder_of
from specheads.inference.engine.engine import Engine
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.draft_model import DraftModelProposer
from specheads.inference.proposers.fused_tree import FusedTreeProposer
from specheads.target_logits import logit_map, target_draft_logits
from specheads.train.objective import OBJECTIVES
from tests.conftest import (
    base_args,
    perturbed_copy,
    random_eagle_head,
    repetitive_prompt,
    tiny_config,
    tiny_model,
    tiny_tokenizer,
)
from tests.drafters import (
    COUNTING_PROMPT,
    DRAFTERS,
    PARAMS,
    SAMPLES,
    chi_square_p,
    exact_two_token_law,
    first_two_tokens,
    proposer_for,
    save_case,
)
from tests.inference.engine.test_layer_attention import WINDOWED

FAMILIES = ["llama", "qwen2", "qwen3", "qwen3_moe", "mistral-window", "gemma2", "gemma3_text", "gpt_oss", "phi3",
            "granite", "olmo2", "exaone4", "gemma3", "qwen2_5_vl"]
MIRRORED = {"llama", "qwen3", "mistral-window"}  # heads copy these targets' own layers
PROMPT = repetitive_prompt(24, seed=1)
NEW = 30


@pytest.fixture(scope="module", params=FAMILIES)
def family(request):
    model = tiny_model(request.param)
    ids = list(PROMPT)
    with torch.inference_mode():  # the target's own forward over the whole sequence, its own masks
        for _ in range(NEW):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return request.param, model, ids[len(PROMPT):]


@pytest.mark.parametrize("method", ["ngram", "draft", *DRAFTERS])
def test_every_method_decodes_every_family_as_its_own_forward(family, method, tmp_path):
    arch, model, want = family
    if method == "draft":
        proposer = DraftModelProposer(perturbed_copy(model, 0.02))
    elif method == "ngram":
        proposer = make_proposer(method, model, METHODS.get(method).make_options({}), None)
    else:
        save_case(method, model, tmp_path)
        proposer = proposer_for(method, model, tmp_path, {"lookup": 0})
    out = Engine(model, proposer).generate(PROMPT, max_new_tokens=NEW)
    assert out.output_ids == want, (arch, method)
    if method != "ngram":
        assert out.stats.drafted > 0, (arch, method)


def test_heads_copy_llama_family_layers_and_build_llama_layers_for_the_others(family):
    arch, model, _ = family
    classes = draft_layer_classes(model)
    assert classes.mirrored == (arch in MIRRORED)
    if classes.mirrored:
        assert classes.layer is type(decoder_of(model).layers[0])
        return
    assert classes.layer is LlamaDecoderLayer
    text = model.config.get_text_config()
    layers = source_layer_config(text)
    assert (layers.hidden_size, layers.num_attention_heads, layers.intermediate_size) == (
        text.hidden_size, text.num_attention_heads, text.intermediate_size)
    # a Llama final norm starts as the scale the target's own applies (Gemma's 1 + w included)
    row = torch.randn(3, text.hidden_size)
    normed = row * torch.rsqrt(row.pow(2).mean(-1, keepdim=True) + text.rms_norm_eps)
    torch.testing.assert_close(normed * final_norm_scale(model), decoder_of(model).norm(row), atol=1e-4, rtol=1e-4)


FULL_ATTENTION = [a for a in FAMILIES if a not in WINDOWED and a not in ("llama", "qwen2")]  # those: test_drafters


@pytest.mark.parametrize("arch", FULL_ATTENTION)
def test_sampling_keeps_every_familys_law(arch):
    # Rows sampled together with draft-model trees: the first two tokens follow the target's exact law from its own
    # forward. The windowed families' test (test_layer_attention) also shows the sample's power on a broken verifier.
    model = tiny_model(arch)
    engine = Engine(model, DraftModelProposer(perturbed_copy(model, 0.03)), max_rows=3)
    counts, accepted = first_two_tokens(engine, COUNTING_PROMPT, PARAMS, SAMPLES)
    law = exact_two_token_law(model, COUNTING_PROMPT, PARAMS)
    assert accepted > SAMPLES // 10 and chi_square_p(counts, law) > 1e-3, (arch, accepted, counts)


def test_heads_score_tokens_as_the_target_does(family):
    # Granite divides its logits, Gemma 2 soft-caps them: what a head reusing the LM head drafts from, and what every
    # recipe trains towards, must be the target's own logits, not its LM head's raw output.
    arch, model, _ = family
    ids = torch.tensor([PROMPT[:16]])
    caught = []
    hook = decoder_of(model).norm.register_forward_hook(lambda module, args, out: caught.append(args[0]))
    with torch.no_grad():
        out = model(input_ids=ids, output_hidden_states=True)
    hook.remove()
    want, last, residual = out.logits[0], out.hidden_states[-1][0], caught[0][0]  # [T, V], [T, H], [T, H]
    close = dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target_draft_logits(model, last), want, **close)
    draft = torch.arange(3, 90)
    torch.testing.assert_close(target_draft_logits(model, last, draft), want[:, draft], **close)
    with torch.no_grad():
        eagle = random_eagle_head(model, aux_layers=(), draft_vocab=tuple(draft.tolist()))  # reuses the LM head
        torch.testing.assert_close(eagle.draft_logits(last), want[:, draft], **close)
        vocab = FusedTreeProposer(eagle).vocab  # what EAGLE-1 drafting scores with
        torch.testing.assert_close(vocab.logits(last), want[:, draft], **close)
        shared = MedusaHeads.for_target(MedusaConfig.for_target(model, num_heads=2), model)  # fresh blocks: identity
        torch.testing.assert_close(shared(last[None])[:, 0], want.expand(2, -1, -1), **close)
        # Heads with LM heads of their own start from the target's, scale folded in (a soft cap cannot be)
        uncapped = residual.new_tensor(logit_map(model.config).scale) * (last @ model.get_output_embeddings().weight.T)
        own = MedusaHeads.for_target(MedusaConfig.for_target(model, num_heads=1, own_lm_head=True), model)
        torch.testing.assert_close(own(last[None])[0, 0], uncapped, **close)
        fused = OBJECTIVES.get("eagle3").build(OBJECTIVES.get("eagle3").settings(aux_layers=(1, 2, 3)), model, None)
        torch.testing.assert_close(fused.draft_logits(residual), uncapped, rtol=1e-4, atol=1e-4)
    assert logit_map(model.config).identity == (arch not in ("granite", "gemma2")), arch


def test_the_targets_table_is_the_suites_matrix():
    lines = (Path(__file__).parents[1] / "docs" / "targets.md").read_text().splitlines()
    rows = [line.split("|")[1:-1] for line in lines if line.startswith("| `")]
    documented = {cells[0].strip().split("`")[1] for cells in rows}
    assert documented == {tiny_config(arch).model_type for arch in FAMILIES}
    assert all(cells[-1].strip() == "yes" for cells in rows)
    assert {cells[0].strip().split("`")[1] for cells in rows if cells[2].strip() == "the target's"} == {
        tiny_config(arch).model_type for arch in MIRRORED}
    header = next(line for line in lines if line.startswith("| family")).split("|")
    assert header[-2].split(":")[1].replace(" ", "").split(",") == ["n-gram", "draftmodel", *DRAFTERS]
    assert header[-3].split(":")[1].replace(" ", "").split(",") == list(RECIPES)
    assert all(cells[-2].strip() == "yes" for cells in rows)
    from tests.test_family_exports import REFUSED

    assert header[4].strip().startswith("exports") and header[5].strip().startswith("whole run")
    for cells in rows:
        arch = next(a for a in FAMILIES if tiny_config(a).model_type == cells[0].strip().split("`")[1])
        listed = cells[3].strip().split(" (")[0]
        refused = set() if listed == "all" else set(listed.removeprefix("all but ").split(", "))
        assert refused == {f"{fmt} {kind}" for a, fmt, kind in REFUSED if a == arch}, arch
        assert cells[4].strip() == WHOLE_RUN.get(arch, "—"), arch


RECIPES = {"eagle": {}, "eagle3": {"aux_layers": (1, 2, 3)}, "peagle": {"aux_layers": (1, 2, 3)},
           "dflash": {"aux_layers": (1, 2, 3)}, "dspark": {"aux_layers": (1, 2, 3), "markov_rank": 8},
           "xpress": {"aux_layers": (1, 2, 3), "xpress_rank": 8}, "medusa": {},
           "dflash2": {"aux_layers": (1, 2, 3), "selector_rank": 8, "selector_top_k": 6},
           "domino": {"aux_layers": (1, 2, 3), "gru_hidden_dim": 16, "emb_dim": 8}}
FULL_VOCAB = ("dflash2", "domino")  # recipes that score the target's whole vocabulary (no draft vocabulary)


def answers(n: int = 4, length: int = 24) -> dict[str, torch.Tensor]:
    """A batch of sequences counting up by 3 after a random start (a learnable pattern), loss on all but the
    first 4 tokens."""
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(3, 60, (n, 1), generator=g)
    ids = (starts + 3 * torch.arange(length)) % 93 + 3
    loss_mask = torch.ones_like(ids)
    loss_mask[:, :4] = 0
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "loss_mask": loss_mask}


def few_steps(recipe: str, model: torch.nn.Module, **settings) -> list[float]:
    """The recipe's own build and step loss (online features from `model`), 8 AdamW steps on one batch: the losses."""
    objective = OBJECTIVES.get(recipe)
    config = objective.settings(**settings)
    torch.manual_seed(0)
    head = objective.build(config, model, None if recipe in FULL_VOCAB else list(range(3, 90)))
    optimizer = torch.optim.AdamW(objective.param_groups(head, 3e-3, config), lr=3e-3)
    batch, losses = answers(), []
    for _ in range(8):
        loss, stats = objective.step_loss(head, model, batch, config)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
        assert "top1" in stats
    return losses


@pytest.mark.parametrize("recipe", RECIPES)
def test_every_recipe_trains_on_every_family(family, recipe):
    arch, model, _ = family
    losses = few_steps(recipe, model, **RECIPES[recipe])
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0], (arch, recipe, losses)


# One whole run per family, the kinds taken in turn: every family and every kind meet the real entry point once.
# Not qwen2: transformers loads any qwen2 folder's tokenizer as its own byte-level Qwen2Tokenizer, which cannot read
# the word-level test vocabulary (qwen2 heads train and decode in the matrix above and in the Qwen2.5-VL whole run).
WHOLE_RUN = {arch: list(RECIPES)[i % len(RECIPES)] for i, arch in enumerate(a for a in FAMILIES if a != "qwen2")}


@pytest.mark.parametrize("arch", WHOLE_RUN)
def test_a_whole_run_trains_from_a_saved_target_and_its_drafter_decodes_exactly(arch, tiny_run_inputs, tmp_path):
    # the training entry point on a saved checkpoint: load_target, chat data, an offline feature cache, evaluation,
    # the final drafter saved; then the checkpoint loaded again decodes with it as plain greedy decoding does
    from specheads.target import load_target
    from specheads.train.__main__ import main as train_main

    kind = WHOLE_RUN[arch]
    folder = tmp_path / "target"
    tiny_model(arch).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    aux = [] if kind in ("eagle", "medusa") else ["heads.aux_layers=[1,2,3]"]
    aux += ["draft_vocab_size=null"] if kind in FULL_VOCAB else []
    out = tmp_path / "run"
    assert train_main(base_args((folder, tiny_run_inputs[1]), out, f"recipe={kind}", *aux, "max_steps=4",
                                "save_every=4", "eval_every=4", "features=offline", "feature_dtype=float32",
                                "measure_prompts=0")) == 0
    assert any((out / "features").iterdir())
    target, _ = load_target(str(folder))
    assert type(target) is type(tiny_model(arch))
    plain = Engine(target, AutoregressiveProposer()).generate(PROMPT, max_new_tokens=NEW)
    options = METHODS.get(kind).make_options({"heads": str(out / "final"), "lookup": 0})
    res = Engine(target, make_proposer(kind, target, options, None)).generate(PROMPT, max_new_tokens=NEW)
    assert res.output_ids == plain.output_ids and res.stats.drafted > 0, (arch, kind)
