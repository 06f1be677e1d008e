"""Draft models as models, for the proposers that decode with them and the recipe that distills them: the
self-drafter made of the target's first layers (`early-exit:N`), the vocabulary checks a draft must pass, and the
marks a parallel (PARD-style) drafter carries in its config.

Imports no torch at import time: the `draft` method's declaration reads `EARLY_EXIT` from here, and declaring methods
imports no torch (every command's `--help` answers at once).
"""

from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EARLY_EXIT = "early-exit:"  # `--draft early-exit:N`: the target's first N layers and its LM head draft
PARALLEL_CONFIG_KEY = "specheads_parallel"  # in a parallel drafter's config.json: {k, mask_token_id}


def vocab_size(model: PreTrainedModel) -> int:
    return model.get_output_embeddings().weight.shape[0]


def check_vocab_size(draft: PreTrainedModel, target_vocab_size: int) -> None:
    if vocab_size(draft) != target_vocab_size:
        raise ValueError(
            f"the draft model's vocabulary has {vocab_size(draft)} tokens but the target's has {target_vocab_size}; "
            "use a draft model from the target's family (same tokenizer)"
        )


_LAYER_KEY = re.compile(r"(^|\.)layers\.(\d+)\.")


def early_exit_model(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """The target's first `num_layers` decoder layers + its final norm and LM head, sharing its weights."""
    from transformers import AutoModelForCausalLM  # here: this module imports no torch at import time

    text_config = target.config.get_text_config()
    total = text_config.num_hidden_layers
    if not 1 <= num_layers < total:
        raise ValueError(f"early-exit:N needs 1 <= N < {total} (the target's layer count), got N={num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:num_layers]
    draft = AutoModelForCausalLM.from_config(config, dtype=target.dtype,
                                             attn_implementation=target.config._attn_implementation)
    state = {k: v for k, v in target.state_dict().items()
             if (m := _LAYER_KEY.search(k)) is None or int(m.group(2)) < num_layers}
    missing, unexpected = draft.load_state_dict(state, strict=False, assign=True)
    assert not unexpected and all("rotary" in k or k.endswith("lm_head.weight") for k in missing), (missing, unexpected)
    return draft.to(next(target.parameters()).device).eval().requires_grad_(False)


def check_same_vocabulary(target: PreTrainedModel, target_tokenizer, draft: PreTrainedModel, draft_tokenizer) -> None:
    """A draft must map token ids to the same strings as the target, or its guesses mean nothing; a parallel
    drafter's LM head has the target's rows plus its placeholder's."""
    spec = parallel_spec(draft.config)
    if spec is not None:  # a parallel drafter: one placeholder row past the target's vocabulary
        check_parallel_vocabulary(draft, spec, vocab_size(target))
    else:
        check_vocab_size(draft, vocab_size(target))
    if (target_tokenizer is not None and draft_tokenizer is not None
            and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab()):
        raise ValueError("the draft model's tokenizer differs from the target's (same size, different tokens); "
                         "use a draft model from the target's family")


@dataclass(frozen=True)
class ParallelSpec:
    """A parallel drafter reads K-1 placeholder tokens after the real context and predicts the next K tokens; the
    placeholder is an extra embedding row past the target's vocabulary, so its LM head has one row more."""

    k: int  # tokens one forward drafts
    mask_token_id: int  # the placeholder's id: the target's vocabulary size (the drafter's extra last row)

    def __post_init__(self) -> None:
        if self.k < 1 or self.mask_token_id < 1:
            raise ValueError(f"a parallel drafter needs k >= 1 and a mask token id, got {self}")


def parallel_spec(config: Any) -> ParallelSpec | None:
    """The parallel drafting settings a draft model's config carries, or None for an ordinary causal LM."""
    raw = getattr(config, PARALLEL_CONFIG_KEY, None)
    return None if raw is None else ParallelSpec(k=int(raw["k"]), mask_token_id=int(raw["mask_token_id"]))


def mark_parallel(config: Any, spec: ParallelSpec) -> None:
    setattr(config, PARALLEL_CONFIG_KEY, {"k": spec.k, "mask_token_id": spec.mask_token_id})


def check_parallel_vocabulary(model: PreTrainedModel, spec: ParallelSpec, target_vocab_size: int) -> None:
    rows = model.get_output_embeddings().weight.shape[0]
    if spec.mask_token_id != target_vocab_size or rows != target_vocab_size + 1:
        raise ValueError(f"this parallel drafter has {rows} LM head rows and mask token {spec.mask_token_id}, but the "
                         f"target's vocabulary has {target_vocab_size} tokens (expected {target_vocab_size + 1} rows, "
                         "mask token last); it was distilled for another target")
