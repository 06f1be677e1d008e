"""LoRA adapters (peft) on a model being trained: the settings section and the wrapping, shared by the recipes that
train adapters (`distill`'s `drafter.lora`, `medusa2`'s `heads.lora`)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class LoraSettings:
    """`lora:` low-rank adapters on a pretrained model instead of training all its weights (peft)."""

    r: int = 16  # adapter rank
    alpha: int = 32  # scaling: the update is (alpha / r) B A
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # names of the model's linear layers

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"lora needs r >= 1, alpha > 0 and 0 <= dropout < 1, got r={self.r}, "
                             f"alpha={self.alpha}, dropout={self.dropout}")
        if not self.target_modules:
            raise ValueError("lora.target_modules is empty; name linear layers, e.g. [q_proj, v_proj]")


def linear_names(model: nn.Module) -> set[str]:
    """The last name component of every nn.Linear in `model`: what `target_modules` may name."""
    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}


def with_lora(model: nn.Module, lora: LoraSettings, *, section: str = "drafter.lora", what: str = "the drafter",
              trainable_token_indices: list[int] | None = None) -> nn.Module:
    """`model` wrapped in a peft model with LoRA adapters on `lora.target_modules`; only the adapters train (and the
    embedding rows `trainable_token_indices` names). peft injects the adapters into `model` itself, in place.

    `section` and `what` name the config section and the model in the error for an unknown module name."""
    from peft import LoraConfig, get_peft_model

    linear = linear_names(model)
    unknown = [m for m in lora.target_modules if m not in linear]
    if unknown:
        raise ValueError(f"{section}.target_modules {unknown} are not linear layers of {what}; its linear "
                         f"layers are: {', '.join(sorted(linear))}")
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM",
                        trainable_token_indices=trainable_token_indices)
    return get_peft_model(model, config)
