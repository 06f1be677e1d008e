"""fp32 final norm and LM head for a reduced-precision target (`--fp32-head`).

In bf16 a logit carries about three significant digits, so two candidate tokens a few hundredths
of a nat apart can swap places between a one-token step and a multi-token verify forward, and a
greedy speculative output leaves plain greedy decoding there. Running the last norm and the LM
head in fp32 (on the bf16 residual stream) takes the logits' own rounding out of that decision; the
decoder layers stay in bf16. It is opt-in: it costs an fp32 LM head product per position, and
`specheads bench` measures what it buys (mismatches against `ar` and their fp32 margins).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from transformers import PreTrainedModel


class Fp32Output(nn.Module):
    """Runs `inner` (a final norm or an LM head) in fp32 on its own fp32 copy of the weights.

    `weight` and `bias` stay the inner module's, so drafters that read the target's LM head rows
    (EAGLE, Medusa, EAGLE-3's initialisation) keep the target's dtype.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.fp32 = copy.deepcopy(inner).float().requires_grad_(False)  # a copy: unties a tied LM head too

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.inner, "bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., H] in any dtype -> fp32
        return self.fp32(x.float())


def fp32_head(model: PreTrainedModel) -> PreTrainedModel:
    """Make `model` compute its final norm and LM head in fp32 (in place; fp32 logits). A fp32 model is
    returned as it is."""
    if model.dtype == torch.float32:
        return model
    decoder = model.get_decoder()
    norm = getattr(decoder, "norm", None)
    if not isinstance(norm, nn.Module) or not isinstance(model.get_output_embeddings(), nn.Linear):
        raise ValueError(f"--fp32-head needs a decoder with a final `norm` and a linear LM head (Llama, Qwen2, Mistral "
                         f"and alike); {type(model).__name__} has none; leave --fp32-head off for this target")
    decoder.norm = Fp32Output(norm)
    model.set_output_embeddings(Fp32Output(model.get_output_embeddings()))
    return model
