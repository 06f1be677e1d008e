"""The distill objective: a standalone draft model trained to match the frozen target token by token.

    python -m specheads.train configs/distill-smollm2-cpu.yaml drafter.divergence=tv

The drafter starts as a copy of the target's first N layers with its final norm and LM head
(`init: early-exit:N`, trained independently of the target), as any causal LM with the target's
tokenizer (a folder or Hub id), or fresh from a config (`init: config:PATH`). Each step the target
scores the batch (no grad; or its cached last hidden states with `features: offline`) and the drafter
is pulled toward the target's next-token distribution at every position whose next token is an
assistant token, by one of the divergences in `divergence.py`. `final/` is a plain HF model folder
(config, weights, tokenizer) that `--method draft --draft DIR/final` and HF assisted generation load.

`parallel_k: K` trains a parallel drafter instead (`parallel_layout.py`: K tokens per draft forward, with a
placeholder embedding row added past the vocabulary); `on_policy_fraction` replaces that share of batches by
the drafter's own samples of the training prompts, scored by the target (DistillSpec's on-policy data).
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

from specheads.draft_models import (
    EARLY_EXIT,
    ParallelSpec,
    check_same_vocabulary,
    early_exit_model,
    mark_parallel,
    parallel_spec,
    vocab_size,
)
from specheads.hf import decoder_of
from specheads.train.class_top1 import TOKEN_HITS, token_hits
from specheads.train.data import next_token_positions
from specheads.train.divergence import DIVERGENCES, check_divergence, token_divergence, token_divergences
from specheads.train.features import batch_features
from specheads.train.lora import LoraSettings, with_lora
from specheads.train.objective import Objective, register_objective
from specheads.train.parallel_layout import parallel_layout

RECIPE = "distill"
CONFIG_PREFIX = "config:"
CHAIN_DEPTH = 4  # the draft chain the simulated τ assumes (the `draft` method's default depth)
META_FILE = "specheads_distill.json"  # beside the HF files in final/: what the drafter was distilled from


@dataclass(frozen=True)
class DistillSettings:
    """The `drafter:` section of a distill recipe."""

    init: str = "early-exit:8"  # early-exit:N (a trainable copy of the target's first N layers + norm + LM head), a
    # causal LM with the target's tokenizer (folder or Hub id), or config:PATH (fresh weights from a config.json)
    divergence: str = "forward_kl"  # one of divergence.DIVERGENCES
    beta: float = 0.5  # jsd: the weight of the target's side
    temperature: float = 1.0  # both distributions at logits / temperature
    lora: LoraSettings | None = None  # train LoRA adapters only (merged into final/); none: every weight trains
    parallel_k: int = 1  # > 1: a parallel drafter, K tokens from one forward (K-1 placeholder tokens after the context)
    cod_keep_rate: float = 0.5  # parallel: each placeholder block keeps this share of the previous block's anchors
    on_policy_fraction: float = 0.0  # share of steps whose batch is the drafter's own samples of the training prompts
    on_policy_max_new_tokens: int = 128  # tokens the drafter samples per prompt on those steps

    def __post_init__(self) -> None:
        if self.parallel_k < 1:
            raise ValueError(f"drafter.parallel_k must be >= 1 (1: an ordinary drafter), got {self.parallel_k}")
        if not 0.0 < self.cod_keep_rate <= 1.0:
            raise ValueError(f"drafter.cod_keep_rate must be in (0, 1] (1: no token dropping), "
                             f"got {self.cod_keep_rate}")
        if not 0.0 <= self.on_policy_fraction <= 1.0:
            raise ValueError(f"drafter.on_policy_fraction must be in [0, 1] (the share of on-policy steps), "
                             f"got {self.on_policy_fraction}")
        if self.on_policy_max_new_tokens < 1:
            raise ValueError(f"drafter.on_policy_max_new_tokens must be >= 1, got {self.on_policy_max_new_tokens}")
        if self.divergence not in DIVERGENCES:
            raise ValueError(f"drafter.divergence {self.divergence!r} is unknown; use one of: {', '.join(DIVERGENCES)}")
        check_divergence(self.divergence, self.beta, self.temperature)
        if self.init.startswith(EARLY_EXIT) and not self.init[len(EARLY_EXIT):].isdigit():
            raise ValueError(f"drafter.init {self.init!r}: N must be a layer count, e.g. early-exit:8")
        if self.init == CONFIG_PREFIX:
            raise ValueError("drafter.init config: needs a path, e.g. config:configs/my-drafter/config.json")


def check_distill_config(settings: DistillSettings, cfg: Any) -> None:
    """What the drafter settings need of the rest of the training config."""
    if settings.parallel_k >= cfg.data.max_length:
        raise ValueError(f"drafter.parallel_k={settings.parallel_k} does not fit the training context "
                         f"(data.max_length={cfg.data.max_length}); use a smaller parallel_k")
    if settings.on_policy_fraction > 0 and cfg.features == "offline":
        raise ValueError("drafter.on_policy_fraction needs features: online (the target scores the drafter's own "
                         "samples each step, which no cache holds)")


def check_distill_partitioned(settings: DistillSettings) -> None:
    if settings.on_policy_fraction > 0:
        raise ValueError("on-policy steps sample a different number of tokens in each process, which DeepSpeed ZeRO-3 "
                         "(collective weight gathering per layer) cannot follow; set drafter.on_policy_fraction: 0 or "
                         "launch with configs/accelerate/deepspeed_zero2.yaml")


class Drafter(nn.Module):
    """The draft model being distilled, returning logits only where the loss needs them (a [B, T, V] tensor
    at every position would dwarf the model on a 49k vocabulary), over the target's vocabulary."""

    def __init__(self, model: PreTrainedModel, vocab: int | None = None) -> None:
        super().__init__()
        self.model = model
        # The target's vocabulary (default: the model's): a parallel drafter's placeholder row is never a prediction.
        self.vocab = vocab or model.get_output_embeddings().weight.shape[0]
        self.spec = parallel_spec(model.config)

    def forward(
        self,
        input_ids: torch.Tensor,  # [B, L]
        attention_mask: torch.Tensor,  # [B, L] padding mask, or [B, 1, L, L] bool (query may attend key)
        keep: torch.Tensor,  # [B, L] bool: the positions whose logits are wanted
        position_ids: torch.Tensor | None = None,  # [B, L]; needed with a 4D mask
    ) -> torch.Tensor:  # [M, V] logits at the kept positions (M = keep.sum())
        if attention_mask.dim() == 4:  # additive, in the model's dtype, as HF attention adds it to the scores
            dtype = next(self.model.parameters()).dtype
            attention_mask = torch.zeros(attention_mask.shape, dtype=dtype, device=attention_mask.device).masked_fill_(
                ~attention_mask, torch.finfo(dtype).min)
        hidden = decoder_of(self.model)(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                        use_cache=False)
        return self.model.get_output_embeddings()(hidden.last_hidden_state[keep])[:, : self.vocab]


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
    vocab = vocab_size(target)
    if settings.parallel_k > 1 or parallel_spec(model.config) is not None:
        with_placeholder(model, ParallelSpec(k=settings.parallel_k, mask_token_id=vocab))
    if settings.lora is not None:
        model = with_drafter_lora(model, settings.lora)
    return Drafter(model, vocab)


def with_placeholder(model: PreTrainedModel, spec: ParallelSpec) -> None:
    """Give `model` the placeholder token (one embedding and LM head row past the target's vocabulary, unless it
    has it already) and mark its config as a parallel drafter."""
    if model.get_input_embeddings().weight.shape[0] == spec.mask_token_id:
        model.resize_token_embeddings(spec.mask_token_id + 1)  # the new row starts at the embeddings' mean
    mark_parallel(model.config, spec)


def with_drafter_lora(model: PreTrainedModel, lora: LoraSettings) -> nn.Module:
    """`model` with LoRA adapters; a parallel drafter's placeholder embedding row, which starts untrained, trains
    too."""
    spec = parallel_spec(model.config)
    return with_lora(model, lora, trainable_token_indices=None if spec is None else [spec.mask_token_id])


def _inner(drafter: nn.Module) -> Drafter:
    return getattr(drafter, "module", drafter)  # under DDP or DeepSpeed the recipe hands over a wrapper


def _scored(target: nn.Module, drafter: nn.Module, batch: dict[str, torch.Tensor], keep_rate: float = 1.0,
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(target logits [M, V], drafter logits [M, V], draft offset [M]) at the M trained slots: positions whose
    next token is an assistant token (offset 0) and, for a parallel drafter, its placeholders (offset j: the
    token j + 1 ahead), COD-subsampled at `keep_rate`."""
    labelled = next_token_positions(batch)
    with torch.no_grad():
        features = batch_features(target, batch)  # [B, T, H] the target's last hidden state
    spec = _inner(drafter).spec
    if spec is None or spec.k == 1:
        with torch.no_grad():
            target_logits = target.get_output_embeddings()(features[labelled])
        draft_logits = drafter(batch["input_ids"], batch["attention_mask"], labelled)
        return target_logits, draft_logits, torch.zeros(draft_logits.shape[0], dtype=torch.long)
    layout = parallel_layout(batch["input_ids"].cpu(), batch["attention_mask"].cpu(), labelled.cpu(), spec.k,
                             spec.mask_token_id, keep_rate=keep_rate)
    device = batch["input_ids"].device
    rows, slots = layout.keep.nonzero(as_tuple=True)  # row-major: the order `Drafter` returns kept logits in
    with torch.no_grad():
        target_logits = target.get_output_embeddings()(features[rows.to(device),
                                                                 layout.label_position[rows, slots].to(device)])
    draft_logits = drafter(layout.input_ids.to(device), layout.attention.to(device), layout.keep.to(device),
                           layout.position_ids.to(device))
    return target_logits, draft_logits, layout.block[rows, slots]


def distill_step_loss(drafter: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor],
                      settings: DistillSettings) -> tuple[torch.Tensor, dict[str, float]]:
    on_policy = settings.on_policy_fraction > 0 and float(torch.rand(())) < settings.on_policy_fraction
    if on_policy:
        batch = on_policy_batch(_inner(drafter), batch, settings.on_policy_max_new_tokens)
    target_logits, draft_logits, _ = _scored(target, drafter, batch, settings.cod_keep_rate)
    per_token = token_divergence(settings.divergence, target_logits, draft_logits, temperature=settings.temperature,
                                 beta=settings.beta)
    loss = per_token.mean() if per_token.numel() else draft_logits.sum() * 0.0  # a batch without assistant tokens
    with torch.no_grad():
        agree = (draft_logits.argmax(-1) == target_logits.argmax(-1)).float()
    return loss, {"top1": float(agree.mean()) if agree.numel() else 0.0, "on_policy": float(on_policy)}


@torch.no_grad()
def on_policy_batch(drafter: Drafter, batch: dict[str, torch.Tensor], max_new_tokens: int) -> dict[str, torch.Tensor]:
    """Each conversation cut before its first assistant token and continued by the drafter sampling at temperature
    1; the continuation is the assistant part the loss reads. Rows without an assistant token stay as they are."""
    model, rows = drafter.model, []
    was_training = model.training
    model.eval()
    suppress = None if drafter.spec is None else [drafter.spec.mask_token_id]
    for ids, attn, loss in zip(batch["input_ids"], batch["attention_mask"], batch["loss_mask"]):
        first = int((loss * attn).argmax()) if bool((loss * attn).any()) else 0
        if first == 0:
            n = int(attn.sum())
            rows.append((ids[:n], loss[:n]))
            continue
        out = model.generate(input_ids=ids[None, :first], attention_mask=torch.ones_like(ids[None, :first]),
                             do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens,
                             suppress_tokens=suppress, pad_token_id=0)[0]
        rows.append((out, torch.cat([torch.zeros(first, dtype=loss.dtype, device=loss.device),
                                     torch.ones(out.numel() - first, dtype=loss.dtype, device=loss.device)])))
    model.train(was_training)
    width = max(ids.numel() for ids, _ in rows)
    new = {key: torch.zeros(len(rows), width, dtype=torch.long, device=batch["input_ids"].device)
           for key in ("input_ids", "attention_mask", "loss_mask")}
    for b, (ids, loss) in enumerate(rows):
        new["input_ids"][b, : ids.numel()] = ids
        new["attention_mask"][b, : ids.numel()] = 1
        new["loss_mask"][b, : ids.numel()] = loss
    return new


@torch.no_grad()
def distill_eval(drafter: nn.Module, target: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Sums over the batch: every divergence at the next token (so runs with different objectives compare), argmax
    agreement at each draft offset (a parallel drafter's placeholders too, without token dropping), positions."""
    target_logits, draft_logits, offset = _scored(target, drafter, batch)
    first = offset == 0
    sums = {f"div_{name}": d.sum().cpu()
            for name, d in token_divergences(DIVERGENCES, target_logits[first], draft_logits[first]).items()}
    wanted = target_logits.argmax(-1)
    hit = draft_logits.argmax(-1) == wanted
    agree = hit.float().cpu()
    for j in range(int(offset.max()) + 1 if offset.numel() else 1):
        sums[f"agree_{j}"] = agree[offset == j].sum()
        sums[f"positions_{j}"] = torch.tensor(float((offset == j).sum()))
    spec = _inner(drafter).spec
    return sums | {TOKEN_HITS: token_hits(wanted, hit, offset.to(wanted.device), 1 if spec is None else spec.k)}


def distill_eval_row(sums: dict[str, torch.Tensor]) -> tuple[dict[str, float], None]:
    n = float(sums["positions_0"].clamp(min=1))
    row = {f"eval/{name}": float(sums[f"div_{name}"]) / n for name in DIVERGENCES}
    offsets = sorted(int(key.split("_")[1]) for key in sums if key.startswith("positions_"))
    agree = [float(sums[f"agree_{j}"]) / float(sums[f"positions_{j}"].clamp(min=1)) for j in offsets]
    row |= {f"eval/top1_step{j + 1}": a for j, a in zip(offsets, agree)}
    # 1 − TV is the chance one sampled draft token is accepted; greedy acceptance is argmax agreement. τ of a greedy
    # chain if positions erred independently: 1 + a1 + a1·a2 + ...; an ordinary drafter repeats its next-token
    # agreement to CHAIN_DEPTH, a parallel one uses its agreement at each of its K offsets.
    if len(agree) == 1:
        agree = agree * CHAIN_DEPTH
    tau, reach = 1.0, 1.0
    for a in agree:
        reach *= a
        tau += reach
    row["eval/simulated_tau_chain"] = tau
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
    save=save_distilled, section="drafter", check=check_distill_config, check_partitioned=check_distill_partitioned,
))
