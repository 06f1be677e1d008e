"""Int8 drafters on CPU: linear layers with int8 weights, for proposers only.

Drafting a tree is a handful of one-to-four-row products per level, so on CPU it is bound by how many
weight bytes it reads; int8 weights read a quarter of fp32's. A drafter only proposes and the target
verifies every token, so a quantised drafter leaves the output exact; it can only change how many
drafts are accepted (measure τ with `specheads bench`, e.g. `eagle:DIR+draft_dtype=int8`).

Weights are quantised per output channel (symmetric, scale = max |w| / 127); activations are quantised
per call (dynamic quantisation, 7-bit range) by PyTorch's fbgemm (x86) or qnnpack (ARM) kernels.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn


def input_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype a linear layer takes its input in: its weight's, or fp32 for an Int8Linear."""
    return torch.float32 if isinstance(layer, Int8Linear) else layer.weight.dtype


def int8_supported() -> bool:
    """True where this PyTorch has int8 CPU kernels and the dynamic quantised linear op (deprecated upstream)."""
    try:
        has_op = torch.ops.quantized.linear_dynamic is not None and torch.ops.quantized.linear_prepack is not None
    except (AttributeError, RuntimeError):
        has_op = False
    return has_op and bool(set(torch.backends.quantized.supported_engines) & {"fbgemm", "x86", "qnnpack"})


def _check_supported() -> None:
    if not int8_supported():
        raise ValueError("this PyTorch build has no int8 CPU kernels (quantized::linear_dynamic with fbgemm, x86 or "
                         "qnnpack); leave --draft-dtype at its default (target)")


class Int8Matrix:
    """A [N, K] weight matrix packed as per-channel int8 for `x @ Wᵀ` products with fp32 inputs."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        _check_supported()
        if weight.device.type != "cpu":
            raise ValueError(f"int8 drafters run on the CPU, but these heads are on {weight.device}; leave "
                             "--draft-dtype at its default there")
        w = weight.detach().float()
        scale = (w.abs().amax(dim=1) / 127).clamp(min=1e-12)  # [N]
        with warnings.catch_warnings():  # quantised tensor types are deprecated; int8_supported() guards their removal
            warnings.simplefilter("ignore", UserWarning)
            q = torch.quantize_per_channel(w, scale.double(), torch.zeros(w.shape[0], dtype=torch.long), 0, torch.qint8)
        self._packed = torch.ops.quantized.linear_prepack(q, None if bias is None else bias.detach().float())

    def __call__(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N], fp32
        # reduce_range: 7-bit activations, or x86 kernels saturate their 16-bit pair sums (errors of ~30%).
        return torch.ops.quantized.linear_dynamic(x.float().contiguous(), self._packed, True)


class Int8Linear(nn.Module):
    """An nn.Linear replaced by its int8 form (no gradients; inference only)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.matrix = Int8Matrix(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # in the input's dtype, so a bf16 drafter stays bf16
        return self.matrix(x).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8"


def quantize_linears(module: nn.Module) -> nn.Module:
    """Replace every nn.Linear inside `module` (not the module itself) with an Int8Linear, in place."""
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, Int8Linear(child))
    return module
