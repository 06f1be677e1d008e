"""How close to a tie the target was where a greedy output parted from `ar`'s.

In reduced precision a verify forward over many tokens does not round like a one-token step, so
speculative greedy output may leave plain greedy output. That is acceptable only at near-ties, and
this module measures it: at the first position where a method's output differs from `ar`'s, the
target runs in fp32 over the shared text (prompt + the common output prefix) and the margin is the
gap between its logits for the two tokens (nats, since both are logits of one softmax). A margin of
0.01 means the target itself barely preferred one; a margin of 3 would mean a real error.
"""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from specheads.inference.bench.runner import Record


@torch.inference_mode()
def fp32_margin(model: PreTrainedModel, prompt_ids: list[int], output_a: list[int], output_b: list[int],
                position: int) -> float | None:
    """|logit(a) - logit(b)| of the fp32 `model` after prompt + output_a[:position], where a = output_a[position]
    and b = output_b[position]; None when one output ended there (a stop or length difference, not a choice)."""
    if position >= len(output_a) or position >= len(output_b):
        return None
    if model.dtype != torch.float32:
        raise ValueError(f"fp32_margin needs the target in float32, got {model.dtype}")
    ids = torch.tensor([prompt_ids + output_a[:position]], device=model.device)
    logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1]
    return abs(float(logits[output_a[position]] - logits[output_b[position]]))


def attach_margins(records: list[Record], model: PreTrainedModel, reference: str = "ar") -> None:
    """Set `margin_fp32` on every record whose output differs from the reference's for the same prompt.

    A second turn that follows a diverged first turn has another prompt, so it gets no margin: its
    divergence is the first turn's.
    """
    refs = {(r.question_id, r.turn): r for r in records if r.method == reference}
    for r in records:
        ref = refs.get((r.question_id, r.turn))
        if r.matches_ar is False and ref is not None and r.prompt_ids == ref.prompt_ids:
            r.margin_fp32 = fp32_margin(model, r.prompt_ids, ref.output_ids, r.output_ids, r.first_mismatch)
