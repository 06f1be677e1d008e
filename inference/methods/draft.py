"""`draft`: a draft model (or the target's first layers) drafting for the target; its settings and options
(built by `specheads.inference.proposers.draft_model`)."""

from __future__ import annotations

from dataclasses import dataclass

from specheads.draft_models import EARLY_EXIT
from specheads.inference.methods.method import Method, register_method
from specheads.inference.methods.options import DRAFT_DTYPE_HELP, check_draft_dtype, option


@dataclass(frozen=True)
class DraftConfig:
    depth: int = 4  # draft tokens per branch
    width: int = 1  # branches at the root; 1 drafts a chain

    def __post_init__(self) -> None:
        if self.depth < 1 or self.width < 1:
            raise ValueError(f"draft depth and width must be >= 1, got depth={self.depth}, width={self.width}")


@dataclass(frozen=True)
class DraftOptions:
    draft: str | None = option("draft model (HF id or folder) with the target's vocabulary, or early-exit:N "
                               "(the target's first N layers)")
    depth: int | None = option(f"draft tokens per branch (default {DraftConfig.depth}; a parallel drafter: its K)")
    width: int | None = option(f"branches at the root (default {DraftConfig.width}: a chain); a parallel drafter: "
                               "alternatives at every depth")
    draft_dtype: str | None = option(DRAFT_DTYPE_HELP)

    def __post_init__(self) -> None:
        check_draft_dtype(self.draft_dtype)
        if self.draft is not None and self.draft.startswith(EARLY_EXIT) and not self.draft[len(EARLY_EXIT):].isdigit():
            raise ValueError(f"--draft {self.draft}: N must be a layer count, e.g. early-exit:8")


METHOD = register_method(Method(
    name="draft", summary="a smaller causal LM (or the target's first N layers) drafts a chain or a top-k tree; a "
                          "parallel drafter drafts its K tokens in one forward",
    options=DraftOptions, build="specheads.inference.proposers.draft_model:build", arg="draft",
    arg_hint="PATH or early-exit:N",
))
