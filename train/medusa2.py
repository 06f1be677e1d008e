"""The Medusa-2 objective: Medusa heads trained jointly with LoRA adapters on the target.

    python -m specheads.train configs/medusa2-smollm2-cpu.yaml

The target gets LoRA adapters (peft; its own weights stay frozen) and the heads read the *adapted* target's last
hidden state, so the target's features can move toward what the heads predict well. Each step:

1. Under `disable_adapter()` (no grad), the frozen target's features and its greedy choices: the labels, as in
   Medusa-1 (`medusa.features_and_labels`), and the distribution the adapted target is held to.
2. The adapted target's features (grad through the adapters); the heads' Medusa-1 loss on them (`medusa_loss`).
3. Self-distillation: forward KL(frozen || adapted) of the next-token distribution at every position whose next
   token is an assistant token, weighted by `distill_weight`, so the adapted target stays close to the frozen one.

Two stages: for the first `heads_only_steps` optimizer steps only the heads learn, on the frozen target's features
(the adapters are still the identity then; they get a zero gradient, as DDP wants every parameter to); then the
heads and the adapters learn together. The heads learn at `heads_lr_multiplier` x optim.lr (they start from scratch,
the adapters from the target); optim.weight_decay applies to the heads only.

final/ holds the heads as Medusa-1 saves them (`--method medusa --heads RUN/final`, exact with respect to the frozen
target) and final/adapter/ (peft's folder; `--adapter RUN/final/adapter` verifies against the adapted target, on
whose features the heads were trained). The run's measured τ (`eval/measured_tau`) decodes with the frozen target,
as `specheads generate` does by default: `save_medusa2` removes the adapters from the recipe's target once they are
saved. Evaluation reports the heads on both: eval/simulated_tau_chain on adapted features, the frozen_ one on the
frozen target's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from accelerate.state import GradientState
from accelerate.utils import extract_model_from_parallel
from torch import nn

from specheads.adapter import save_adapter
from specheads.heads.medusa import KIND_NAME, MedusaHeads, medusa_loss
from specheads.hf import decoder_of
from specheads.train.class_top1 import TOKEN_HITS
from specheads.train.data import next_token_positions
from specheads.train.divergence import token_divergence
from specheads.train.lora import LoraSettings, with_lora
from specheads.train.medusa import (
    MedusaHeadsConfig,
    build_medusa,
    features_and_labels,
    head_hits,
    medusa_eval_row,
    with_measured_tree,
)
from specheads.train.objective import Objective, register_objective, save_heads

RECIPE = "medusa2"
ADAPTER_DIR = "adapter"  # final/adapter: the LoRA adapter, beside the heads checkpoint


@dataclass(frozen=True)
class Medusa2Settings(MedusaHeadsConfig):
    """The `heads:` section of a medusa2 recipe: Medusa-1's heads settings and the joint training's."""

    lora: LoraSettings = field(default_factory=LoraSettings)  # adapters on the target's linear layers (not its LM head)
    heads_lr_multiplier: float = 4.0  # the heads learn at this multiple of optim.lr, the adapters at optim.lr
    heads_only_steps: int = 100  # stage 1: optimizer steps that train the heads alone, before the joint stage
    distill_weight: float = 1.0  # weight of KL(frozen target || adapted target) next to the heads' loss

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.heads_lr_multiplier > 0:
            raise ValueError(f"heads.heads_lr_multiplier must be > 0 (1: the adapters' rate), "
                             f"got {self.heads_lr_multiplier}")
        if self.heads_only_steps < 0:
            raise ValueError(f"heads.heads_only_steps must be >= 0 (0: joint from the start), "
                             f"got {self.heads_only_steps}")
        if self.distill_weight < 0:
            raise ValueError(f"heads.distill_weight must be >= 0 (0: no self-distillation), got {self.distill_weight}")


def check_medusa2_config(settings: Medusa2Settings, cfg: Any) -> None:
    """What joint training needs of the rest of the training config."""
    if cfg.features == "offline":
        raise ValueError("the medusa2 recipe needs features: online (the adapted target's features change every "
                         "joint step, so no cache can hold them); set features: online")
    if settings.heads_only_steps >= cfg.max_steps:
        raise ValueError(f"heads.heads_only_steps={settings.heads_only_steps} leaves no joint step in "
                         f"max_steps={cfg.max_steps}; lower heads_only_steps (or raise max_steps)")


class Medusa2Module(nn.Module):
    """The target with LoRA adapters and the Medusa heads reading its adapted last hidden state."""

    def __init__(self, model: nn.Module, heads: MedusaHeads) -> None:
        super().__init__()
        self.model = model  # the peft model around the target (the adapters live inside the target itself)
        self.heads = heads
        # Optimizer steps taken, for the stage switch; a buffer so checkpoints resume in the right stage.
        self.register_buffer("steps_done", torch.zeros((), dtype=torch.long))
        # Checkpoints leave out the frozen weights (the whole target: ~0.5 GB for the default one, per checkpoint);
        # a resumed run builds them again from the target.
        self.register_state_dict_post_hook(_drop_frozen)
        self.register_load_state_dict_post_hook(_frozen_may_be_missing)

    def frozen_names(self) -> set[str]:
        return {name for name, p in self.named_parameters(remove_duplicate=False) if not p.requires_grad}

    def adapted_features(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:  # [B, T, H]
        out = decoder_of(self.model.get_base_model())(input_ids=input_ids, attention_mask=attention_mask,
                                                      use_cache=False)
        return out.last_hidden_state

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        frozen: torch.Tensor | None = None,  # [B, T, H] stage 1: the frozen target's features, which the heads read
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(heads' logits [K, B, T, Vd], the features they read [B, T, H], a zero to add to the loss).

        In stage 1 the adapters are still at their initialisation, the identity (peft starts lora_B at zero, and
        nothing moves them before the joint stage), so the adapted features are the frozen ones: the target does not
        run again, and the zero is 0 x the adapters, so every parameter still gets a (zero) gradient, as DDP wants."""
        if frozen is None:
            features = self.adapted_features(input_ids, attention_mask)
            return self.heads(features), features, features.new_zeros(())
        anchor = sum(p.sum() for p in self.model.parameters() if p.requires_grad) * 0.0
        return self.heads(frozen), frozen, anchor


def _drop_frozen(module: Medusa2Module, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
    for name in module.frozen_names():
        state_dict.pop(prefix + name, None)


def _frozen_may_be_missing(module: Medusa2Module, incompatible: Any) -> None:
    frozen = module.frozen_names()  # missing keys are named from where loading started (e.g. a DDP wrapper)
    incompatible.missing_keys[:] = [key for key in incompatible.missing_keys
                                    if not any(key == name or key.endswith("." + name) for name in frozen)]


def _lm_head_name(model: nn.Module) -> str:
    head = model.get_output_embeddings()
    return next(name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is head)


def build_medusa2(settings: Medusa2Settings, target: nn.Module, draft_vocab: list[int] | None = None) -> Medusa2Module:
    """The heads (built on the target as Medusa-1's) and the adapters, injected into `target` in place."""
    lm_head = _lm_head_name(target)
    if lm_head in settings.lora.target_modules:
        raise ValueError(f"heads.lora.target_modules names the LM head ({lm_head}), which the heads share with the "
                         "frozen target; adapt the decoder's linear layers only")
    heads = build_medusa(settings, target, draft_vocab)
    model = with_lora(target, settings.lora, section="heads.lora", what="the target")
    return Medusa2Module(model, heads)


def medusa2_param_groups(module: Medusa2Module, lr: float, settings: Medusa2Settings) -> list[dict[str, Any]]:
    """The heads at lr x heads_lr_multiplier (and optim.weight_decay), the adapters at lr without weight decay: AdamW
    would otherwise shrink them during stage 1, where their gradient is zero but present."""
    heads = [p for p in module.heads.parameters() if p.requires_grad]
    adapters = [p for p in module.model.parameters() if p.requires_grad]
    return [{"params": heads, "lr": lr * settings.heads_lr_multiplier},
            {"params": adapters, "lr": lr, "weight_decay": 0.0}]


def _self_distill_kl(lm_head: nn.Module, frozen: torch.Tensor, adapted: torch.Tensor,
                     labelled: torch.Tensor) -> torch.Tensor:  # [M] KL(frozen || adapted) per position, fp32
    with torch.no_grad():
        frozen_logits = lm_head(frozen[labelled])
    return token_divergence("forward_kl", frozen_logits, lm_head(adapted[labelled]))


def medusa2_step_loss(module: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor],
                      settings: Medusa2Settings) -> tuple[torch.Tensor, dict[str, float]]:
    inner = extract_model_from_parallel(module)  # DDP hides the module's own attributes
    joint = int(inner.steps_done) >= settings.heads_only_steps
    with inner.model.disable_adapter():  # `target` is the adapted model itself (peft injects in place)
        frozen, labels = features_and_labels(target, batch)
    # Through the DDP wrapper, so gradients sync.
    logits, adapted, anchor = module(batch["input_ids"], batch["attention_mask"], None if joint else frozen)
    mask = batch["loss_mask"] * batch["attention_mask"]
    heads_loss, accs = medusa_loss(logits, labels, mask, decay=settings.decay, draft_ids=inner.heads.draft_ids)
    loss, kl = heads_loss + anchor, torch.zeros(())  # stage 1: the adapted target is the frozen one, the KL zero
    if joint:
        per_token = _self_distill_kl(target.get_output_embeddings(), frozen, adapted, next_token_positions(batch))
        kl = per_token.mean() if per_token.numel() else adapted.sum() * 0.0  # a batch without assistant tokens
        loss = loss + settings.distill_weight * kl
    if GradientState().sync_gradients:  # the last micro-batch of this optimizer step
        inner.steps_done += 1
    stats = {f"top1_head{k}": a for k, a in enumerate(accs)} | {"top1": accs[0]}
    return loss, stats | {"loss_heads": float(heads_loss.detach()), "self_distill_kl": float(kl.detach()),
                          "joint": float(joint)}


@torch.no_grad()
def medusa2_eval(module: Medusa2Module, target: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Medusa-1's sums for the heads on adapted features (by token class too), the same on the frozen target's
    features (`frozen_hits`), and the summed self-distillation KL over its positions."""
    with module.model.disable_adapter():
        frozen, labels = features_and_labels(target, batch)
    adapted = module.adapted_features(batch["input_ids"], batch["attention_mask"])
    mask = batch["loss_mask"] * batch["attention_mask"]
    hits, positions, scored = head_hits(module.heads, adapted, labels, mask)
    frozen_hits, _, _ = head_hits(module.heads, frozen, labels, mask)
    kl = _self_distill_kl(target.get_output_embeddings(), frozen, adapted, next_token_positions(batch))
    return {"hits": hits, "positions": positions, "frozen_hits": frozen_hits, "kl": kl.sum().cpu().reshape(1),
            "kl_positions": torch.tensor([float(kl.numel())]), TOKEN_HITS: scored}


def medusa2_eval_row(sums: dict[str, torch.Tensor]) -> tuple[dict[str, float], list[list[float]]]:
    """Medusa-1's row (heads on adapted features; their accuracies build the stored tree), the simulated τ on the
    frozen target's features and the mean KL."""
    row, accuracies = medusa_eval_row(sums)
    frozen, _ = medusa_eval_row({"hits": sums["frozen_hits"], "positions": sums["positions"]})
    row["eval/frozen_simulated_tau_chain"] = frozen["eval/simulated_tau_chain"]
    row["eval/self_distill_kl"] = float(sums["kl"][0] / sums["kl_positions"][0].clamp(min=1))
    return row, accuracies


def save_medusa2(module: Medusa2Module, folder: Path, *, target: nn.Module, tokenizer: Any, target_name: str,
                 config: Any, metadata: dict[str, Any]) -> None:
    """final/: the heads checkpoint (as Medusa-1's) and final/adapter/; then the adapters leave the recipe's target,
    so the measured τ that follows verifies against the frozen target, as `specheads generate` does by default."""
    save_heads(module.heads, folder, target=target, tokenizer=tokenizer, target_name=target_name, config=config,
               metadata=metadata)
    save_adapter(module.model, Path(folder) / ADAPTER_DIR, target, target_name)
    module.model.unload()  # the original linear layers back in place, untouched: the frozen target again
    target.eval()  # as loaded (training put it in train mode with the module)


register_objective(Objective(
    name=RECIPE, kind=KIND_NAME, settings=Medusa2Settings, build=build_medusa2, step_loss=medusa2_step_loss,
    eval_sums=medusa2_eval, eval_row=medusa2_eval_row,
    final_config=lambda module, accuracies: with_measured_tree(module.heads, accuracies),
    save=save_medusa2, check=check_medusa2_config, param_groups=medusa2_param_groups,
))
