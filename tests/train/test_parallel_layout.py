"""The packed parallel-drafting layout: each slot computes what the drafter computes at decode time, and token
dropping keeps every placeholder's own earlier placeholders."""

from __future__ import annotations

import torch

from specheads.train.distill import DistillSettings, build_drafter
from specheads.train.parallel_layout import parallel_layout
from tests.conftest import TINY_VOCAB, tiny_model


def batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 90, (2, 12), generator=g)
    attention = torch.ones_like(ids)
    attention[1, 9:] = 0  # row 1 is right-padded
    labelled = torch.zeros_like(ids, dtype=torch.bool)
    labelled[:, 3:11] = True  # positions 3..10 predict assistant tokens
    return ids, attention, labelled & attention.bool()


def test_every_packed_slot_equals_the_decode_time_forward():
    target = tiny_model("llama")
    drafter = build_drafter(DistillSettings(init="early-exit:2", parallel_k=3), target).eval()
    ids, attention, labelled = batch()
    layout = parallel_layout(ids, attention, labelled, k=3, mask_token_id=TINY_VOCAB)
    with torch.no_grad():
        packed = drafter(layout.input_ids, layout.attention, layout.keep, layout.position_ids)
    rows, slots = layout.keep.nonzero(as_tuple=True)
    assert {int(b) for b in layout.block[rows, slots]} == {0, 1, 2}
    for i, (b, s) in enumerate(zip(rows.tolist(), slots.tolist())):
        j = int(layout.block[b, s])
        anchor = int(layout.position_ids[b, s]) - j
        assert int(layout.label_position[b, s]) == anchor + j and bool(labelled[b, anchor + j])
        # Decoding: the context up to the anchor, then j placeholders; the last position's logits.
        context = torch.cat([ids[b, : anchor + 1], torch.full((j,), TINY_VOCAB)])
        with torch.no_grad():
            decoded = drafter.model(context[None]).logits[0, -1, :TINY_VOCAB]
        torch.testing.assert_close(packed[i], decoded, rtol=1e-4, atol=1e-4)


def test_k1_is_the_causal_layout_and_labels_only_assistant_positions():
    ids, attention, labelled = batch()
    layout = parallel_layout(ids, attention, labelled, k=1, mask_token_id=TINY_VOCAB)
    assert torch.equal(layout.input_ids, ids) and torch.equal(layout.keep, labelled)
    causal = torch.tril(torch.ones(12, 12, dtype=torch.bool))
    assert torch.equal(layout.attention[0, 0], causal)


def test_token_dropping_is_conditional_and_shrinks_the_packed_sequence():
    ids, attention, labelled = batch()
    full = parallel_layout(ids, attention, labelled, k=4, mask_token_id=TINY_VOCAB)
    dropped = parallel_layout(ids, attention, labelled, k=4, mask_token_id=TINY_VOCAB, keep_rate=0.5,
                              generator=torch.Generator().manual_seed(0))
    assert dropped.keep.sum() < full.keep.sum()
    for layout in (full, dropped):
        for b in range(2):
            anchors = {(int(p) - int(j), int(j)) for p, j in zip(layout.position_ids[b], layout.block[b]) if j > 0}
            assert all(j == 1 or (a, j - 1) in anchors for a, j in anchors)  # m_j never without its m_{j-1}
    per_block = [int((full.block[0] == j).sum()) for j in range(4)]
    assert per_block == [12, 8, 7, 6]  # m_j for anchors a whose a + 1 .. a + j all lie in the labelled span 3..10
