"""The distill objective: a standalone draft model trained to match the frozen target token by token.

    python -m specheads.train configs/distill-smollm2-cpu.yaml drafter.divergence=tv

The drafter starts as a copy of the target's first N layers with its final norm and LM head
(`init: early-exit:N`, trained independently of the target), as any causal LM with the target's
tokenizer (a folder or Hub id), or fresh from a config (`init: config:PATH`). Each step the target
scores the batch (no grad; or its cached last hidden states with `features: offline`) and the drafter
is pulled toward the target's next-token distribution at every position whose next token is an
assistant token, by one of the divergences in `divergence.py`. `final/` is a plain HF model folder
(config, weights, tokenizer) that `--method draft --draft DIR/final` and HF assisted generation load.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from specheads.hf import decoder_of
from specheads.inference.proposers.draft_model import EARLY_EXIT, check_same_vocabulary, early_exit_model
from specheads.train.divergence import DIVERGENCES, check_divergence, token_divergence, token_divergences
from specheads.train.features import batch_features
from specheads.train.objective import Objective, register_objective

RECIPE = "distill"
CONFIG_PREFIX = "config:"
CHAIN_DEPTH = 4  # the draft chain the simulated τ assumes (the `draft` method's default depth)
META_FILE = "specheads_distill.json"  # beside the HF files in final/: what the drafter was distilled from


@dataclass(frozen=True)
class LoraSettings:
    """`drafter.lora:` train low-rank adapters on a pretrained drafter instead of all its weights (peft); the
    saved drafter has them merged, so it loads as a plain model."""

    r: int = 16  # adapter rank
    alpha: int = 32  # scaling: the update is (alpha / r) B A
    dropout: float = 0.0
    target_modules: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj")  # names of the drafter's linear layers

    def __post_init__(self) -> None:
        if self.r < 1 or self.alpha <= 0 or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"drafter.lora needs r >= 1, alpha > 0 and 0 <= dropout < 1, got r={self.r}, "
                             f"alpha={self.alpha}, dropout={self.dropout}")
        if not self.target_modules:
            raise ValueError("drafter.lora.target_modules is empty; name linear layers, e.g. [q_proj, v_proj]")


@dataclass(frozen=True)
class DistillSettings:
    """The `drafter:` section of a distill recipe."""

    init: str = "early-exit:8"  # early-exit:N (a trainable copy of the target's first N layers + norm + LM head), a
    # causal LM with the target's tokenizer (folder or Hub id), or config:PATH (fresh weights from a config.json)
    divergence: str = "forward_kl"  # one of divergence.DIVERGENCES
    beta: float = 0.5  # jsd: the weight of the target's side
    temperature: float = 1.0  # both distributions at logits / temperature
    lora: LoraSettings | None = None  # train LoRA adapters only (merged into final/); none: every weight trains

    def __post_init__(self) -> None:
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"drafter.divergence {self.divergence!r} is unknown; use one of: {', '.join(DIVERGENCES)}")
        check_divergence(self.divergence, self.beta, self.temperature)
        if self.init.startswith(EARLY_EXIT) and not self.init[len(EARLY_EXIT):].isdigit():
            raise ValueError(f"drafter.init {self.init!r}: N must be a layer count, e.g. early-exit:8")
        if self.init == CONFIG_PREFIX:
            raise ValueError("drafter.init config: needs a path, e.g. config:configs/my-drafter/config.json")


class Drafter(nn.Module):
    """The draft model being distilled, returning logits only where the loss needs them (a [B, T, V] tensor
    at every position would dwarf the model on a 49k vocabulary)."""

    def __init__(self, model: PreTrainedModel) -> None:
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, T]
        attention_mask: torch.Tensor,  # [B, T]
        keep: torch.Tensor,  # [B, T] bool: the positions whose logits are wanted
    ) -> torch.Tensor:  # [M, V] logits at the kept positions (M = keep.sum())
        hidden = decoder_of(self.model)(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return self.model.get_output_embeddings()(hidden.last_hidden_state[keep])


def _target_tokenizer(target: PreTrainedModel):
    try:
        return AutoTokenizer.from_pretrained(target.config._name_or_path)
    except (OSError, ValueError):
        return None  # a target built in memory: the vocabulary size is still checked


def build_drafter(settings: DistillSettings, target: PreTrainedModel, draft_vocab: list[int] | None = None) -> Drafter:
    """The drafter `settings.init` names, in fp32 with gradients on (mixed precision comes from the recipe)."""
    init = settings.init
    if init.startswith(EARLY_EXIT):
        model = copy.deepcopy(early_exit_model(target, int(init[len(EARLY_EXIT):])))  # own weights, not the target's
        # The copy's embedding and LM head are separate tensors (a tied target's included) and train apart: the LM
        # head adapts to layer-N states without moving the input embeddings. Say so, so the saved folder loads untied.
        model.config.tie_word_embeddings = False
        model.config.get_text_config().tie_word_embeddings = False
    elif init.startswith(CONFIG_PREFIX):
        config = AutoConfig.from_pretrained(init[len(CONFIG_PREFIX):])
        model = AutoModelForCausalLM.from_config(config)
        check_same_vocabulary(target, None, model, None)
    else:
        model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32)
        try:
            draft_tokenizer = AutoTokenizer.from_pretrained(init)
        except (OSError, ValueError):
            draft_tokenizer = None
        check_same_vocabulary(target, _target_tokenizer(target), model, draft_tokenizer)
    model = model.float().to(next(target.parameters()).device).train().requires_grad_(True)
    if settings.lora is not None:
        model = with_lora(model, settings.lora)
    return Drafter(model)


def with_lora(model: PreTrainedModel, lora: LoraSettings) -> nn.Module:
    """`model` with LoRA adapters on `lora.target_modules`; only the adapters train."""
    from peft import LoraConfig, get_peft_model

    linear = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    unknown = [m for m in lora.target_modules if m not in linear]
    if unknown:
        raise ValueError(f"drafter.lora.target_modules {unknown} are not linear layers of the drafter; its linear "
                         f"layers are: {', '.join(sorted(linear))}")
    config = LoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def _scored(target: nn.Module, drafter: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(target logits, drafter logits), both [M, V], at the M positions whose next token is an assistant token."""
    keep = torch.zeros_like(batch["attention_mask"], dtype=torch.bool)
    keep[:, :-1] = (batch["loss_mask"] * batch["attention_mask"])[:, 1:].bool()  # position t predicts token t + 1
    with torch.no_grad():
        features = batch_features(target, batch)  # [B, T, H] the target's last hidden state
        target_logits = target.get_output_embeddings()(features[keep])
    return target_logits, drafter(batch["input_ids"], batch["attention_mask"], keep)


def distill_step_loss(drafter: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor],
                      settings: DistillSettings) -> tuple[torch.Tensor, dict[str, float]]:
    target_logits, draft_logits = _scored(target, drafter, batch)
    per_token = token_divergence(settings.divergence, target_logits, draft_logits, temperature=settings.temperature,
                                 beta=settings.beta)
    loss = per_token.mean() if per_token.numel() else draft_logits.sum() * 0.0  # a batch without assistant tokens
    with torch.no_grad():
        agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
    return loss, {"top1": float(agree.mean()) if agree.numel() else 0.0}


@torch.no_grad()
def distill_eval(drafter: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor],
                 settings: DistillSettings | None = None) -> dict[str, torch.Tensor]:
    """Sums over the batch: every divergence (so runs with different objectives compare), argmax agreement, positions."""
    target_logits, draft_logits = _scored(target, drafter, batch)
    sums = {f"div_{name}": d.sum().cpu() for name, d in token_divergences(DIVERGENCES, target_logits, draft_logits).items()}
    sums["agree"] = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float().sum().cpu()
    sums["positions"] = torch.tensor(float(target_logits.shape[0]))
    return sums


def distill_eval_row(sums: dict[str, torch.Tensor]) -> tuple[dict[str, float], None]:
    n = float(sums["positions"].clamp(min=1))
    row = {f"eval/{name}": float(sums[f"div_{name}"]) / n for name in DIVERGENCES}
    top1 = float(sums["agree"]) / n
    # 1 − TV is the chance one sampled draft token is accepted; greedy acceptance is argmax agreement. τ of a greedy
    # chain if positions erred independently: 1 + a + a² + ... + a^depth.
    row |= {"eval/top1_step1": top1, "eval/simulated_tau_chain": sum(top1**k for k in range(CHAIN_DEPTH + 1))}
    return row, None


def save_distilled(drafter: nn.Module, folder: Path, *, target: nn.Module, tokenizer: Any, target_name: str,
                   config: Any, metadata: dict[str, Any]) -> None:
    """A plain HF model folder (weights, config, the target's tokenizer) plus what it was distilled from."""
    model = drafter.model
    if hasattr(model, "merge_and_unload"):  # LoRA: fold the adapters in, so the folder is a plain model
        model = model.merge_and_unload()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    (Path(folder) / META_FILE).write_text(json.dumps({"target": target_name, **metadata}, indent=2) + "\n")


register_objective(Objective(
    name=RECIPE, kind="draft", settings=DistillSettings, build=build_drafter, step_loss=distill_step_loss,
    eval_sums=distill_eval, eval_row=distill_eval_row, final_config=lambda module, extra: None,
    save=save_distilled, section="drafter",
))
