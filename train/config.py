"""The training recipe's configuration: YAML recipes in configs/ load into these frozen dataclasses."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specheads.config import build, read_config_data, to_dict
from specheads.train.budget import SHAPES
from specheads.train.objective import OBJECTIVES
from specheads.train.onpolicy import OnPolicyConfig
from specheads.train.regenerated_data import RegenerateConfig
from specheads.train.target_sharding import check_shard_settings


@dataclass(frozen=True)
class DataConfig:
    source: str = "sharegpt"  # "sharegpt" (the PyPI package) or a local .json/.jsonl/.parquet file
    max_conversations: int | None = 2000  # usable conversations read (train + eval); None: all
    skip_conversations: int = 0  # pass over the first N usable conversations (e.g. those an earlier run trained on)
    max_length: int = 512  # tokens per conversation; longer ones are truncated (and counted)
    eval_fraction: float = 0.02  # share of the conversations held out for evaluation
    max_eval_conversations: int = 32  # at most this many held-out conversations
    split_seed: int | None = None  # the held-out split's seed (None: the run's `seed`); fix it to vary `seed` alone

    def __post_init__(self) -> None:
        if self.max_conversations is not None and self.max_conversations < 2:
            raise ValueError("data.max_conversations must be >= 2 (one for training, one for evaluation)")
        if self.skip_conversations < 0:
            raise ValueError(f"data.skip_conversations must be >= 0, got {self.skip_conversations}")
        if not 0.0 < self.eval_fraction < 1.0:
            raise ValueError(f"data.eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if self.max_length < 16:
            raise ValueError(f"data.max_length must be >= 16, got {self.max_length}")


@dataclass(frozen=True)
class OptimConfig:
    optimizer: str = "adamw"  # "adamw", or "muon": Muon on the hidden matrices, AdamW on the rest (train/optimizer.py)
    lr: float = 1e-3  # peak learning rate (linear warmup, then `schedule`'s decay)
    schedule: str = "cosine"  # decay after the warmup to 0 at max_steps (or max_minutes): "cosine" or "linear"
    weight_decay: float = 0.0  # AdamW weight decay
    muon_weight_decay: float = 0.1  # Muon's weight decay (optimizer: muon)
    warmup_steps: int = 20  # steps of linear warmup to the peak rate
    batch_size: int = 4  # conversations per step and process
    grad_accum: int = 1  # steps whose gradients are summed before an optimizer step
    max_grad_norm: float = 0.5  # gradient clipping (global L2 norm)

    def __post_init__(self) -> None:
        if self.lr <= 0 or self.batch_size < 1 or self.grad_accum < 1:
            raise ValueError("optim.lr must be > 0 and optim.batch_size, optim.grad_accum >= 1")
        if self.schedule not in SHAPES:
            raise ValueError(f"optim.schedule must be one of {', '.join(SHAPES)}, got {self.schedule!r}")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optim.optimizer must be adamw or muon, got {self.optimizer!r}")
        if self.weight_decay < 0 or self.muon_weight_decay < 0:
            raise ValueError("optim.weight_decay and optim.muon_weight_decay must be >= 0")


@dataclass(frozen=True)
class TrainConfig:
    recipe: str | None = None  # the objective to train (a name in OBJECTIVES); every config names one
    target: str = "default"  # "default" (SmolLM2-135M-Instruct), an HF model id or a local folder
    output_dir: str | None = None  # default: runs/<recipe>
    max_steps: int = 300  # optimizer steps
    # The run's last step is the first after this many minutes of training (the target's load, data and feature cache
    # not counted): evaluated, saved, measured; the LR decays to 0 at whichever of max_steps and max_minutes comes
    # first (train/budget.py)
    max_minutes: float | None = None  # minutes of training; the LR schedule anneals over them (None: no time limit)
    seed: int = 0  # data order, initialisation and noise; also the held-out split unless data.split_seed is set
    resume: bool = False  # continue from the newest checkpoint in output_dir/checkpoints
    init_heads: str | None = None  # start from these saved heads (a run's final/) for more steps or new data
    report_to: str = "none"  # "none" or "wandb" (works with WANDB_MODE=offline)
    mixed_precision: str = "auto"  # "auto" (bf16 on CUDA and on CPUs with native bf16, else none), "no", "bf16", "fp16"
    log_every: int = 10  # steps between training-metric rows in metrics.jsonl
    eval_every: int = 100  # steps between evaluations on the held-out conversations
    save_every: int = 100  # steps between checkpoints (output_dir/checkpoints/step_N)
    features: str = "online"  # "online": the target runs inside each step; "offline": cached once to disk, reused
    feature_dtype: str = "bfloat16"  # storage dtype of the offline cache
    feature_cache_dir: str | None = None  # default: OUTPUT_DIR/features
    draft_vocab_size: int | None = 8192  # most frequent training tokens the draft LM head scores (None: all)
    measure_prompts: int = 4  # held-out prompts the final heads decode greedily for the measured τ (0: skip)
    measure_max_new_tokens: int = 64  # new tokens per measured prompt
    # the same prompts decoded again drafting a chain of this many tokens, one guess per position, as chain engines
    # (llama.cpp, vLLM's EAGLE) draft: chain τ and how often the first guess is right (0: skip; trees only)
    measure_chain: int = 3
    shard_target: bool = False  # split the target's decoder layers over the processes (FSDP2; target_sharding.py)
    data: DataConfig = field(default_factory=DataConfig)
    heads: Any = None  # the recipe's own settings class (Objective.settings); None: its defaults
    optim: OptimConfig = field(default_factory=OptimConfig)
    onpolicy: OnPolicyConfig = field(default_factory=OnPolicyConfig)  # rollouts replayed into training (onpolicy.py)
    # the training answers regenerated by the target itself (regenerated_data.py)
    regenerate: RegenerateConfig = field(default_factory=RegenerateConfig)

    def __post_init__(self) -> None:
        if self.recipe is None:
            raise ValueError(f"the config names no recipe; add recipe: one of {', '.join(sorted(OBJECTIVES.names()))} "
                             "(or pass recipe=NAME)")
        settings = OBJECTIVES.get(self.recipe).settings
        if self.heads is None:
            object.__setattr__(self, "heads", settings())
        elif not isinstance(self.heads, settings):
            raise TypeError(f"the {self.recipe} recipe takes heads settings of type {settings.__name__}, "
                            f"got {type(self.heads).__name__}")
        if self.init_heads and not OBJECTIVES.get(self.recipe).trains_heads:
            section = OBJECTIVES.get(self.recipe).section
            start = (f"starts from its {section}.init (e.g. a previous run's final/)" if hasattr(self.heads, "init")
                     else "trains more than a heads checkpoint holds; drop init_heads")
            raise ValueError(f"init_heads applies to heads recipes; the {self.recipe} recipe {start}")
        if self.output_dir is None:
            object.__setattr__(self, "output_dir", f"runs/{self.recipe}")
        if self.max_steps < 1:
            raise ValueError(f"max_steps must be >= 1, got {self.max_steps}")
        if self.max_minutes is not None and not self.max_minutes > 0:
            raise ValueError(f"max_minutes must be > 0 (or null for no time limit), got {self.max_minutes}")
        if self.report_to not in ("none", "wandb"):
            raise ValueError(f"report_to must be 'none' or 'wandb', got {self.report_to!r}")
        if self.mixed_precision not in ("auto", "no", "bf16", "fp16"):
            raise ValueError(f"mixed_precision must be auto, no, bf16 or fp16, got {self.mixed_precision!r}")
        if self.features not in ("online", "offline"):
            raise ValueError(f"features must be 'online' or 'offline', got {self.features!r}")
        if self.measure_prompts < 0 or self.measure_max_new_tokens < 1:
            raise ValueError("measure_prompts must be >= 0 and measure_max_new_tokens >= 1")
        if not 0 <= self.measure_chain <= 99:
            raise ValueError(f"measure_chain must be a chain length in 1..99, or 0 to skip; got {self.measure_chain}")
        if self.shard_target:
            check_shard_settings(self.measure_prompts)
        for name in ("log_every", "eval_every", "save_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.onpolicy.enabled:
            self._check_onpolicy()
        OBJECTIVES.get(self.recipe).check(self.heads, self)

    def _check_onpolicy(self) -> None:
        objective = OBJECTIVES.get(self.recipe)
        if not objective.decodes_as_saved:
            raise ValueError(f"onpolicy.every applies to heads recipes whose drafter decodes from its own config; the "
                             f"{self.recipe} recipe's is made from an evaluation; set onpolicy.every=0")
        if self.optim.grad_accum != 1:
            raise ValueError("onpolicy replays rollouts into each optimizer step's batch; use optim.grad_accum=1 "
                             "(a larger optim.batch_size instead) or onpolicy.every=0")
        if self.shard_target:
            raise ValueError("onpolicy decodes with the whole target; it cannot run with shard_target=true")
        if self.onpolicy.max_new_tokens >= self.data.max_length:
            raise ValueError(f"onpolicy.max_new_tokens ({self.onpolicy.max_new_tokens}) must be below data.max_length "
                             f"({self.data.max_length}): a rollout row is its prompt and its tokens")

    @property
    def split_seed(self) -> int:
        """The held-out split's seed. Runs that differ only in `seed` with one `data.split_seed` train on the same
        rows, and so reuse one feature cache: a seed study measures initialisation and batch order alone."""
        return self.seed if self.data.split_seed is None else self.data.split_seed


def load_train_config(path: str | Path | None, overrides: list[str]) -> TrainConfig:
    """YAML + overrides -> TrainConfig; the recipe's section (`heads:`, or `drafter:` for distill) is built with the
    named recipe's own settings class."""
    data = read_config_data(path, overrides)
    if data.get("recipe") is None:  # unknown keys are reported first, then the missing recipe
        return build(TrainConfig, {k: v for k, v in data.items() if k not in ("heads", "drafter")})
    objective = OBJECTIVES.get(str(data["recipe"]))
    section = objective.section
    other = "drafter" if section == "heads" else "heads"
    if other in data:
        raise ValueError(f"the {objective.name} recipe takes its settings under '{section}:', not '{other}:'; "
                         f"rename the section")
    heads = data.pop(section, None) or {}
    if not isinstance(heads, dict):
        raise ValueError(f"config key '{section}' must be a section (mapping), got {heads!r}")
    return build(TrainConfig, {**data, "heads": build(objective.settings, heads, prefix=f"{section}.")})


def train_config_dict(cfg: TrainConfig) -> dict[str, Any]:
    """The config as plain data, its recipe settings under the recipe's own section name (what config.yaml holds,
    so a saved config loads back)."""
    data = to_dict(cfg)
    section = OBJECTIVES.get(cfg.recipe).section
    return {(section if k == "heads" else k): v for k, v in data.items()}
