"""What the drafters that read the target's fused layers share (eagle3, peagle, dflash): the target's frozen token
embedding, the feature rows they read (by default `default_aux_layers`), an output side (final norm, LM head over
a draft vocabulary) that starts as the target's own next-token head, and the default token of mask entries."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from torch import nn

from specheads.draft_layers import DraftLayerClasses, embedding_rows, final_norm_scale
from specheads.features import feature_rows, feature_width
from specheads.heads.draft_vocab import check_draft_vocab
from specheads.target_logits import logit_map, target_draft_weight


def default_aux_layers(num_target_layers: int) -> tuple[int, ...]:
    """The low, middle and high target layers fused by default (EAGLE-3's; speculators' and vLLM's default):
    hidden_states 2, L//2, L-3."""
    return (2, num_target_layers // 2, num_target_layers - 3)


def default_mask_token(target: nn.Module) -> int:
    """The target's pad token if it has one of its own (not also its end of turn), else its last id: a token the
    text rarely holds, so a masked entry rarely looks like a real one (the default mask of block drafters)."""
    vocab = target.get_output_embeddings().weight.shape[0]
    tcfg = target.config.get_text_config()
    pad, eos = getattr(tcfg, "pad_token_id", None), getattr(tcfg, "eos_token_id", None)
    eos = set(eos) if isinstance(eos, list) else {eos}
    return int(pad) if isinstance(pad, int) and 0 <= pad < vocab and pad not in eos else vocab - 1


@dataclass(frozen=True, kw_only=True)
class MaskEntries:
    """The setting of a drafter that feeds mask entries (peagle, dflash): declared once here, for the head configs
    and the recipes' `heads:` sections alike (the range is checked by `check_fused_config`)."""

    # Chosen when the head is built where None (`with_mask_token`).
    mask_token_id: int | None = None  # the masked positions' token; None: the target's own pad token, else its last id


C = TypeVar("C")


def with_mask_token(config: C, target: nn.Module) -> C:
    """`config` with its mask token chosen for `target` where it names none."""
    if config.mask_token_id is not None:
        return config
    return dataclasses.replace(config, mask_token_id=default_mask_token(target))


def declared_by(settings_cls: type, obj: Any) -> dict[str, Any]:
    """The values `obj` holds for the fields dataclass `settings_cls` declares: a recipe section's share of a head
    config (settings both inherit from `settings_cls`)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(settings_cls)}


# Fields of the draft layer's HF config a drafter may set apart from its target's (an imported drafter's
# transformer_layer_config can differ in these); anything else is the target's.
LAYER_FIELDS = ("intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps",
                "hidden_act", "attention_bias", "mlp_bias", "rope_parameters", "max_position_embeddings")


def check_fused_layers(num_layers: int, aux_layers: Any, where: str) -> tuple[int, ...] | None:
    """`aux_layers` as a tuple of ints (None stays None: the default, resolved against the target), after checking
    both of the settings every fused-layer drafter has; `where` prefixes the messages ("eagle3", "heads.")."""
    if num_layers < 1:
        raise ValueError(f"{where}num_layers must be >= 1, got {num_layers}")
    if aux_layers is None:
        return None
    aux = tuple(int(i) for i in aux_layers)
    if not aux:
        raise ValueError(f"{where}aux_layers must name at least one target layer, or be null for 2, L//2, L-3")
    return aux


def check_fused_config(config: Any, kind: str) -> None:
    """Validate (and normalise) the fields every fused-layer drafter's config has: num_layers, aux_layers,
    draft_vocab, layer; and mask_token_id where it has one."""
    if config.aux_layers is None:
        raise ValueError(f"{kind} aux_layers must name the target layers the head fuses")
    object.__setattr__(config, "aux_layers", check_fused_layers(config.num_layers, config.aux_layers, f"{kind} "))
    object.__setattr__(config, "draft_vocab", check_draft_vocab(config.draft_vocab, config.vocab_size, kind))
    unknown = sorted(set(config.layer) - set(LAYER_FIELDS))
    if unknown:
        raise ValueError(f"{kind} layer may only set {', '.join(LAYER_FIELDS)}; got {unknown}")
    mask = getattr(config, "mask_token_id", None)
    if mask is not None and not 0 <= mask < config.vocab_size:
        raise ValueError(f"{kind} mask_token_id {mask} is outside the target vocabulary [0, {config.vocab_size}); "
                         "pick an id of a token the target rarely sees (e.g. its pad token)")


class FusedHead(nn.Module):
    """Base of such heads: `config` has hidden_size, aux_layers, draft_vocab and draft_vocab_size."""

    config: Any

    def _add_output(self, target: nn.Module, decoder: nn.Module, layer_cfg: Any, classes: DraftLayerClasses) -> None:
        """The final norm and draft LM head (starting as the target's), the rotary embedding, the shared embedding."""
        h = self.config.hidden_size
        self.norm = classes.norm(h, eps=layer_cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.config.draft_vocab_size, bias=False)
        self.rotary_emb = classes.rotary(config=layer_cfg)
        self._frozen = (target.get_input_embeddings(),)  # shared, frozen, outside this module's parameters
        draft = self.config.draft_vocab
        ids = None if draft is None else torch.tensor(draft, dtype=torch.long)
        self.register_buffer("draft_ids", ids, persistent=False)  # [Vd] or None; rebuilt from the config
        with torch.no_grad():  # start from the target's own next-token head, its logit scale folded in
            rows = target_draft_weight(target, ids)
            self.lm_head.weight.copy_(rows * logit_map(target.config).scale)
            # the target's own norm class takes its weights; a Llama norm the scale the target's applies
            self.norm.weight.copy_(decoder.norm.weight if classes.mirrored else final_norm_scale(target))

    def _to_target_dtype(self, target: nn.Module) -> None:
        dtype = next(target.parameters()).dtype
        for name, module in self.named_children():
            if name != "rotary_emb":  # its inverse frequencies stay fp32, as in the target
                module.to(dtype)

    def embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:  # [...] -> [..., H]: the target's rows, unscaled
        return embedding_rows(self._frozen[0], ids)

    @property
    def feature_width(self) -> int:  # D: the aux layers and the last layer, the feature rows every drafter reads
        return feature_width(self.config.hidden_size, self.config.aux_layers)

    def select_features(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:  # HF hidden_states -> [..., D]
        return feature_rows(hidden_states, self.config.aux_layers)

    def token_ids(self, index: torch.Tensor) -> torch.Tensor:  # indices into the draft logits -> token ids
        return index if self.draft_ids is None else self.draft_ids[index]
