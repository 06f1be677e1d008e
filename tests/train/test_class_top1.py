"""Top-1 by token class in training evaluation: counts by (draft position, class), the metrics they give, and every
objective scoring by class exactly the draft tokens its own counts score."""

from __future__ import annotations

import pytest
import torch

from specheads.token_classes import TOKEN_CLASSES, TokenClasses
from specheads.train.chain_loss import chain_eval
from specheads.train.class_top1 import (
    CLASS_HITS,
    CLASS_POSITIONS,
    TOKEN_HITS,
    TokenHits,
    class_row,
    class_sums,
    join_hits,
    token_hits,
)
from specheads.train.dflash import DFlashHeadsConfig, build_dflash, dflash_eval
from specheads.train.eagle import EagleHeadsConfig, build_eagle
from specheads.train.eagle3 import Eagle3HeadsConfig, build_eagle3
from specheads.train.medusa import MedusaHeadsConfig, build_medusa, medusa_eval
from specheads.train.peagle import PEagleHeadsConfig, block_eval, build_peagle
from tests.conftest import tiny_model
from tests.drafters import perturbed

WORD, WHITESPACE, PUNCT, STRUCT = (TOKEN_CLASSES.index(n) for n in ("word", "whitespace", "punctuation", "structural"))
# tokens 0-3 words, 4-5 whitespace, 6 punctuation, 7 structural
CLASSES = TokenClasses(of_token=torch.tensor([WORD] * 4 + [WHITESPACE] * 2 + [PUNCT, STRUCT]))


def test_sums_count_every_scored_token_by_position_and_class():
    first = token_hits(torch.tensor([[0, 4, 7], [7, 1, 5]]), torch.tensor([[True, False, False], [True, True, True]]),
                       0, depth=2)
    second = token_hits(torch.tensor([6, 7, 2]), torch.tensor([False, True, True]), 1, depth=2,
                        keep=torch.tensor([True, True, False]))
    sums = class_sums(join_hits([first, second], 2), CLASSES)
    scored, right = torch.zeros(2, len(TOKEN_CLASSES)), torch.zeros(2, len(TOKEN_CLASSES))
    scored[0, WORD], right[0, WORD] = 2, 2  # tokens 0 and 1, both right
    scored[0, WHITESPACE], right[0, WHITESPACE] = 2, 1  # 4 wrong, 5 right
    scored[0, STRUCT], right[0, STRUCT] = 2, 1  # 7 twice, once right
    scored[1, PUNCT], scored[1, STRUCT], right[1, STRUCT] = 1, 1, 1  # token 2 not kept
    assert torch.equal(sums[CLASS_POSITIONS], scored) and torch.equal(sums[CLASS_HITS], right)

    row = class_row(sums)
    assert row["eval/top1_word"] == 1.0 and row["eval/top1_whitespace"] == 0.5 and row["eval/top1_structural"] == 0.5
    assert row["eval/top1_punctuation_step2"] == 0.0 and row["eval/top1_structural_step2"] == 1.0
    assert "eval/top1_digits" not in row and "eval/top1_word_step2" not in row  # nothing scored there
    assert row["eval/share_word"] == pytest.approx(1 / 3) and row["eval/share_digits"] == 0.0
    assert sum(v for k, v in row.items() if k.startswith("eval/share_")) == pytest.approx(1.0)


def test_a_batch_that_scored_nothing_adds_zeros_and_no_hits_give_no_metrics():
    sums = class_sums(join_hits([], 3), CLASSES)
    assert sums[CLASS_POSITIONS].shape == (3, len(TOKEN_CLASSES)) and float(sums[CLASS_POSITIONS].sum()) == 0
    assert class_row(sums) == {} and class_row({"positions": torch.ones(3)}) == {}


def test_hits_of_different_shapes_are_refused():
    with pytest.raises(ValueError, match="three \\[M\\] tensors"):
        TokenHits(torch.zeros(3, dtype=torch.long), torch.zeros(2, dtype=torch.bool), torch.zeros(3, dtype=torch.long),
                  1)


def _per_position(hits: TokenHits) -> tuple[list[float], list[float]]:
    scored = torch.bincount(hits.position, minlength=hits.depth).float()
    right = torch.bincount(hits.position[hits.hit], minlength=hits.depth).float()
    return right.tolist(), scored.tolist()


def _objectives(target):
    yield "eagle", build_eagle(EagleHeadsConfig(aux_layers=(1, 2)), target), chain_eval, "correct_top1", "positions"
    yield "eagle3", build_eagle3(Eagle3HeadsConfig(aux_layers=(1, 2, 3)), target, draft_vocab=list(range(3, 60))), \
        chain_eval, "correct_top1", "positions"
    yield "peagle", build_peagle(PEagleHeadsConfig(aux_layers=(1, 2, 3), num_depths=3), target), block_eval, \
        "correct_top1", "positions"
    yield "dflash", build_dflash(DFlashHeadsConfig(aux_layers=(1, 2, 3), block_size=4), target), dflash_eval, \
        "correct_top1", "positions"
    yield "medusa", build_medusa(MedusaHeadsConfig(num_heads=3), target), medusa_eval, "hits", "positions"


@torch.no_grad()
def test_every_objective_scores_by_class_the_tokens_its_own_counts_score():
    target = tiny_model("llama", seed=0)
    tokens = torch.randint(3, 96, (8, 20), generator=torch.Generator().manual_seed(0))
    loss_mask = torch.ones_like(tokens)
    loss_mask[:, :3] = 0  # a prompt: its positions are not scored
    batch = {"input_ids": tokens, "attention_mask": torch.ones_like(tokens), "loss_mask": loss_mask}
    torch.manual_seed(0)  # the heads' initialisation: fixed, so each is right on some tokens and wrong on others
    for name, module, eval_sums, right_key, scored_key in _objectives(target):
        sums = eval_sums(perturbed(module, scale=0.02, seed=2).eval(), target, batch)
        hits = sums[TOKEN_HITS]
        right, scored = _per_position(hits)
        own_right = sums[right_key][:, 0] if right_key == "hits" else sums[right_key]  # medusa: [heads, topk]
        assert right == own_right.tolist() and scored == sums[scored_key].tolist(), name
        assert sum(scored) > 0 and 0 < sum(right) < sum(scored), name  # a drafter neither always right nor wrong
        by_class = class_sums(hits, TokenClasses(of_token=torch.arange(96) % len(TOKEN_CLASSES)))
        assert by_class[CLASS_POSITIONS].sum(1).tolist() == scored, name
        assert by_class[CLASS_HITS].sum(1).tolist() == right, name
