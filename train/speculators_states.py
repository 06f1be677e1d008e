"""Hidden states generated with vLLM through `speculators`, imported as this project's offline feature cache.

Train here on the target hidden states speculators' data pipeline already computed with vLLM, without running
the target again:

    speculators prepare-data --model TARGET --data ... --output SRC
    python scripts/launch_vllm.py TARGET [--target-layer-ids 2 16 29] -- ...   (speculators' script: vLLM server)
    speculators generate-offline-data --preprocessed-data SRC
    python -m specheads.train.speculators_states SRC --output DIR CONFIG.yaml [key=value ...] \\
        [--target-layer-ids 2 16 29] [--hidden-states HS_DIR] [--target TARGET]
    python -m specheads.train CONFIG.yaml [key=value ...] data.source=DIR/data.jsonl features=offline \\
        feature_cache_dir=DIR/features

CONFIG.yaml and the key=value overrides are the training run's own (the recipe, target, seed, data.* and
feature_dtype decide which rows land in which split and how they are stored); `--target-layer-ids` are the ones
vLLM was launched with (speculators' default 2, L//2, L-3 when left out). The import needs speculators installed
(its own file checks run on every file) and loads the target once, for its final norm.

What speculators' files hold (speculators 0.9.0 and the vLLM connector it drives, read for this module):

- SRC, the preprocessed dataset (`datasets.save_to_disk`): one row per training sample with `input_ids`,
  `loss_mask` (1 on the tokens the drafter learns to predict, as our `loss_mask`: the draft at position t is
  scored where loss_mask[t + 1] is 1, speculators' `shift_batch` alike) and `seq_len`.
- HS_DIR (default SRC/hidden_states) `hs_{i}.safetensors`, the hidden states of row i: `token_ids` [T] (the
  prompt vLLM ran) and `hidden_states` [T, n, H] in the target's dtype (FP8 with `hidden_states_scales` under
  the FP8 backend, dequantised on reading by speculators' own transfer class), the n layers in ascending id
  order (vLLM collects them in its layer loop). A missing file is a sample generation skipped or did not reach
  (`--max-samples`); its row is left out, as speculators' trainer does with `on_missing=skip`.
- The layer ids are vLLM's `eagle_aux_hidden_state_layer_ids`: speculators' `--target-layer-ids` plus L, the
  target's layer count (`--include-last-layer`, on by default). Id i < L is the residual stream entering
  decoder layer i: HF's `hidden_states[i]`, our aux layer i. Id L is the stream after the last layer *before*
  the final norm (vLLM captures it ahead of `norm`); speculators' trainer applies a frozen copy of the target's
  final norm (`verifier_norm`) to it before the LM head.

How they map onto ours (`specheads/features.py`: cat(hidden_states[i] for i in aux_layers, the last hidden state
after the final norm)): the aux layers the run's heads read are copied from the ids of the same number (ids
vLLM extracted that the heads do not read are dropped, a layer the heads read that vLLM did not extract is
refused by name), and the last layer goes through the target's own final-norm module here, in fp32, then the
cache's dtype. The norm is applied at import rather than stored pre-norm because every recipe, every proposer
at decode time and `FeatureCache` read the last H columns as the post-norm state the LM head takes; storing it
post-norm keeps the cache one layout. The rows equal what `write_feature_cache` computes from the same token ids
up to the numerics of vLLM's kernels and dtype.

Checks, each refusing with a ValueError that names the file and the fix: speculators'
`find_corrupt_hidden_state_indices` (a file that does not open) on every file before any is read, and
`check_hidden_states` (both tensors present, token ids equal to the row's input_ids, one state per token,
finite values) on each as it is read; then the layer count and hidden size against the layer ids and the
target.

The output: DIR/data.jsonl, the rows (pre-tokenized: `train/data.py` reads them as they are), and
DIR/features/{train,eval}, feature caches of the split the run makes of them (the recipe's own functions with
the run's data.* and seed), each keyed by the recipe's fingerprint of its token ids and target name, so the run
reads them instead of running the target.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from specheads.features import feature_width
from specheads.heads.fused_head import default_aux_layers
from specheads.hf import decoder_of
from specheads.target import load_target
from specheads.train.config import TrainConfig, load_train_config
from specheads.train.data import load_conversations, split_by_conversation, tokenize_dataset
from specheads.train.feature_cache import DTYPES, ShardWriter, fingerprint, write_json
from specheads.train.objective import OBJECTIVES

log = logging.getLogger(__name__)

INSTALL = "pip install --no-deps speculators==0.9.0"
REGENERATE = ("delete it and run `speculators generate-offline-data` again (it fills in missing files), or pass the "
              "preprocessed dataset the files were generated from")


@dataclass(frozen=True)
class ImportedStates:
    """What `import_speculators_states` wrote, and the training settings that read it."""

    data: Path  # the rows, pre-tokenized JSONL
    features: Path  # feature caches features/train and features/eval
    aux_layers: tuple[int, ...]  # the target layers the cache holds besides the last
    samples: int  # rows imported (those with a hidden-states file)
    missing: tuple[int, ...]  # dataset rows without a hidden-states file, left out

    def train_overrides(self) -> list[str]:
        return [f"data.source={self.data}", "features=offline", f"feature_cache_dir={self.features}"]


def speculators_file_checks() -> tuple[Any, Any]:
    """speculators' own checks of its offline files and its transfer class that reads them (plain or FP8)."""
    try:
        from hs_connectors.transfer import FP8Transfer
        from speculators.data_generation import offline
    except ImportError as err:
        raise ValueError(f"reading speculators' hidden-state files runs speculators' own checks on them, and "
                         f"speculators is not installed ({err}); install it: {INSTALL}") from err
    return offline, FP8Transfer


def vllm_layer_ids(num_layers: int, target_layer_ids: Sequence[int] | None = None) -> list[int]:
    """The layer ids vLLM extracted, ascending (the order of the files' layers), the way speculators' launcher
    sets them: `target_layer_ids` (default 2, L//2, L-3) plus L, the post-last-layer state."""
    ids = list(default_aux_layers(num_layers) if target_layer_ids is None else target_layer_ids)
    if num_layers not in ids:
        ids.append(num_layers)
    if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) > num_layers:
        given = "the default 2, L//2, L-3" if target_layer_ids is None else "--target-layer-ids"
        raise ValueError(f"target layer ids must be distinct and within [0, {num_layers}] for a {num_layers}-layer "
                         f"target, {given} gives {ids}; pass the --target-layer-ids vLLM was launched with")
    return sorted(ids)


class SpeculatorsStates:
    """speculators' offline output: the preprocessed dataset's rows and the hidden-state file of each, checked."""

    def __init__(self, src: str | Path, hidden_states_dir: str | Path | None = None) -> None:
        import datasets

        self.offline, transfer = speculators_file_checks()
        self.src = Path(src)
        try:
            ds = datasets.load_from_disk(str(self.src)).with_format(None)
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"{self.src} is not a preprocessed dataset of speculators ({err}); pass the --output "
                             "folder of `speculators prepare-data`") from err
        if not {"input_ids", "loss_mask"} <= set(ds.column_names):
            raise ValueError(f"{self.src} has no input_ids/loss_mask columns (found {ds.column_names}); pass the "
                             "--output folder of `speculators prepare-data`")
        self.input_ids: list[list[int]] = ds["input_ids"]
        self.loss_mask: list[list[int]] = [[int(bool(m)) for m in mask] for mask in ds["loss_mask"]]
        self.dir = Path(hidden_states_dir) if hidden_states_dir is not None else self.src / "hidden_states"
        self.indices: list[int] = self.offline.get_existing_hidden_state_indices(self.dir)
        if not self.indices:
            raise ValueError(f"no hs_<i>.safetensors files in {self.dir}; generate them with `speculators "
                             "generate-offline-data`, or pass their folder with --hidden-states")
        corrupt = self.offline.find_corrupt_hidden_state_indices(self.dir, self.indices)
        if corrupt:
            first = min(corrupt)
            raise ValueError(f"{len(corrupt)} hidden-state file(s) in {self.dir} cannot be read, first "
                             f"{self.path(first).name} ({corrupt[first]}); {REGENERATE}")
        beyond = [i for i in self.indices if i >= len(self.input_ids)]
        if beyond:
            raise ValueError(f"{self.path(beyond[0]).name} has no row in {self.src} ({len(self.input_ids)} rows): "
                             f"the files come from another dataset; {REGENERATE}")
        self.missing = sorted(set(range(len(self.input_ids))) - set(self.indices))
        self.transfer = transfer(self.dir, dequantize_dtype=torch.float32)

    def path(self, index: int) -> Path:
        return self.dir / f"hs_{index}.safetensors"

    def states(self, index: int, layer_ids: Sequence[int], hidden_size: int) -> torch.Tensor:  # [T, n, H]
        """Row `index`'s hidden states, checked by speculators' `check_hidden_states` and against the layer ids."""
        path = self.path(index)
        data = self.transfer.get_cached(index)
        try:
            self.offline.check_hidden_states(data, self.input_ids[index])
        except ValueError as err:
            raise ValueError(f"{path} does not hold row {index} of {self.src}: {_short(err)}; {REGENERATE}") from err
        states = data["hidden_states"]
        if states.dim() != 3 or states.shape[1:] != (len(layer_ids), hidden_size):
            raise ValueError(
                f"{path} holds hidden states of shape {list(states.shape)} but layer ids {list(layer_ids)} of a "
                f"target with hidden size {hidden_size} make [T, {len(layer_ids)}, {hidden_size}]: a missing layer "
                "(vLLM launched without --include-last-layer, or with other --target-layer-ids) or another target; "
                "pass the --target-layer-ids and target vLLM ran with")
        return states


def _short(err: Exception, limit: int = 300) -> str:  # speculators' token mismatch message lists every token
    text = str(err)
    return text if len(text) <= limit else text[:limit] + " ..."


def vllm_hidden_states(target: torch.nn.Module, input_ids: Sequence[int],
                       layer_ids: Sequence[int]) -> torch.Tensor:  # [T, n, H]
    """What vLLM's hidden-state extraction saves for a prompt, from the target's own forward here: for id i < L the
    residual stream entering decoder layer i, for id L the stream after the last layer, before the final norm."""
    decoder = decoder_of(target)
    seen: dict[int, torch.Tensor] = {}

    def keep(i: int):
        def hook(module, args, kwargs) -> None:
            seen[i] = args[0] if args else kwargs["hidden_states"]
        return hook

    hooks = [decoder.layers[i].register_forward_pre_hook(keep(i), with_kwargs=True)
             for i in layer_ids if i < len(decoder.layers)]
    hooks.append(decoder.norm.register_forward_pre_hook(keep(len(decoder.layers)), with_kwargs=True))
    try:
        with torch.no_grad():
            decoder(input_ids=torch.tensor([list(input_ids)], device=decoder.norm.weight.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([seen[i][0] for i in layer_ids], dim=1)


def write_speculators_states(
    target: torch.nn.Module,
    tokenizer: Any,
    input_ids: Sequence[Sequence[int]],
    loss_mask: Sequence[Sequence[int]],
    out_dir: str | Path,
    *,
    target_layer_ids: Sequence[int] | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> Path:
    """Rows and their hidden states in speculators' offline layout, as `prepare-data` and `generate-offline-data`
    would leave them, the target run here instead of in vLLM: the dataset goes through speculators' own preprocessing
    (pre-tokenized rows pass through it as they are) and every file through its own `check_hidden_states`. With it,
    speculators' trainer reads the very hidden states a run here imports (`import_speculators_states`)."""
    import datasets
    from safetensors.torch import load_file, save_file

    offline, _ = speculators_file_checks()
    from speculators.data_generation.preprocessing import build_speculator_training_dataset

    text = target.config.get_text_config()
    layer_ids = vllm_layer_ids(text.num_hidden_layers, target_layer_ids)
    rows = datasets.Dataset.from_dict({"input_ids": [list(r) for r in input_ids],
                                       "loss_mask": [list(m) for m in loss_mask]})
    prepared = build_speculator_training_dataset(rows, tokenizer, max_length=max(map(len, input_ids)), num_proc=1)
    kept = prepared.with_format(None)["input_ids"]
    if [list(r) for r in kept] != [list(r) for r in input_ids]:
        raise ValueError(f"speculators' preprocessing kept {len(kept)} of {len(input_ids)} rows or changed them; "
                         "pass rows with at least one loss token each")
    out = Path(out_dir)
    prepared.save_to_disk(str(out))
    states_dir = out / "hidden_states"
    states_dir.mkdir(exist_ok=True)
    for i, ids in enumerate(tqdm(kept, desc="hidden states", unit="row")):
        path = states_dir / f"hs_{i}.safetensors"
        save_file({"hidden_states": vllm_hidden_states(target, ids, layer_ids).to(dtype).contiguous(),
                   "token_ids": torch.tensor(ids)}, path)
        offline.check_hidden_states(load_file(path), ids)
    return out


def import_speculators_states(
    src: str | Path,
    out_dir: str | Path,
    cfg: TrainConfig,
    *,
    hidden_states_dir: str | Path | None = None,
    target_layer_ids: Sequence[int] | None = None,
    shard_tokens: int = 1 << 20,
) -> ImportedStates:
    """Write speculators' offline output (`src`, its hidden states in `hidden_states_dir`) as data and feature
    caches that the training run `cfg` reads (see the module doc); `target_layer_ids` are vLLM's, without L."""
    states = SpeculatorsStates(src, hidden_states_dir)
    target, tokenizer = load_target(cfg.target)
    text = target.config.get_text_config()
    layer_ids = vllm_layer_ids(text.num_hidden_layers, target_layer_ids)
    aux = tuple(int(i) for i in OBJECTIVES.get(cfg.recipe).feature_layers(cfg.heads, text.num_hidden_layers))
    absent = [i for i in aux if i not in layer_ids[:-1]]
    if absent:
        raise ValueError(f"the {cfg.recipe} heads read target layer(s) {absent} but vLLM extracted only "
                         f"{layer_ids[:-1]} (and the last); set heads.aux_layers to ones among them, or launch vLLM "
                         "with --target-layer-ids that include them and generate again")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data.jsonl"
    data.unlink(missing_ok=True)  # an earlier import's rows must not pair with caches this one leaves half-written
    partial = out / ".data.partial.jsonl"  # renamed to data.jsonl once the caches are complete
    with partial.open("w", encoding="utf-8") as f:
        for i in states.indices:
            f.write(json.dumps({"input_ids": states.input_ids[i], "loss_mask": states.loss_mask[i]}) + "\n")

    # The run's own rows and split, from the same functions and settings as the recipe.
    rows, _ = load_conversations(str(partial), max_conversations=cfg.data.max_conversations,
                                 skip_conversations=cfg.data.skip_conversations)
    sample = {}  # equal token ids have equal hidden states: any row holding them serves
    for i in states.indices:
        sample.setdefault(tuple(states.input_ids[i]), i)
    rows = rows.add_column("sample", [sample[tuple(ids)] for ids in rows["input_ids"]])
    train_ds, eval_ds = split_by_conversation(tokenize_dataset(rows, tokenizer, cfg.data.max_length),
                                              cfg.data.eval_fraction, cfg.split_seed)
    eval_ds = eval_ds.select(range(min(len(eval_ds), cfg.data.max_eval_conversations)))

    norm = decoder_of(target).norm
    keep = [layer_ids.index(i) for i in aux]

    def feature_rows(split) -> Iterator[torch.Tensor]:  # [n, D] per row of the split, as the recipe's cache
        for s, n in zip(split["sample"], split["num_tokens"]):
            hs = states.states(s, layer_ids, text.hidden_size)[:n].float()
            with torch.no_grad():
                last = norm(hs[:, -1])
            yield torch.cat([hs[:, keep].flatten(1), last.float()], dim=-1)

    features = out / "features"
    for name, split in (("train", train_ds), ("eval", eval_ds)):
        write_feature_rows(tqdm(feature_rows(split), total=len(split), desc=f"importing {name} states",
                                unit="conv"),
                           split["input_ids"], features / name, target_name=cfg.target, hidden_size=text.hidden_size,
                           aux_layers=aux, dtype=cfg.feature_dtype, shard_tokens=shard_tokens)
    os.replace(partial, data)
    if states.missing:
        log.warning("%d of %d rows of %s have no hidden-state file and were left out (first: row %d)",
                    len(states.missing), len(states.input_ids), states.src, states.missing[0])
    return ImportedStates(data=data, features=features, aux_layers=aux, samples=len(states.indices),
                          missing=tuple(states.missing))


def write_feature_rows(
    rows: Iterable[torch.Tensor],
    input_ids: Sequence[Sequence[int]],
    out_dir: str | Path,
    *,
    target_name: str,
    hidden_size: int,
    aux_layers: Sequence[int],
    dtype: str = "bfloat16",
    shard_tokens: int = 1 << 20,
) -> Path:
    """A feature cache in `feature_cache.py`'s layout from features computed elsewhere: the k-th of `rows` is
    example k's [len(input_ids[k]), D]. Its fingerprint is the recipe's for `input_ids` and `target_name`, so a run
    on the same data with the same aux layers reads it instead of running the target."""
    if dtype not in DTYPES:
        raise ValueError(f"feature dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "index.json").unlink(missing_ok=True)  # an earlier cache's index would point into rewritten shards
    width = feature_width(hidden_size, aux_layers)
    examples: list[list[int]] = []
    shards = ShardWriter(out, shard_tokens=shard_tokens)
    for k, row in enumerate(rows):
        n = len(input_ids[k])
        if tuple(row.shape) != (n, width):
            raise ValueError(f"example {k} has features of shape {list(row.shape)}, expected [{n}, {width}]")
        examples.append(shards.add(row.to(DTYPES[dtype])))
    shards.close()
    if len(examples) != len(input_ids):
        raise ValueError(f"{len(examples)} feature rows for {len(input_ids)} examples")
    # The index goes last: a cache without it is incomplete and gets rebuilt.
    write_json(out / "index.json", {"hidden_size": hidden_size, "aux_layers": [int(i) for i in aux_layers],
                                     "dtype": dtype, "fingerprint": fingerprint(input_ids, target_name),
                                     "examples": examples})
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m specheads.train.speculators_states",
        description="Import hidden states speculators generated with vLLM (prepare-data + generate-offline-data) as "
                    "data and an offline feature cache for a training run; prints the run's command.")
    parser.add_argument("src", help="speculators' preprocessed dataset (the --output of prepare-data)")
    parser.add_argument("settings", nargs="*", metavar="[CONFIG.yaml] key=value",
                        help="the training run's config and overrides (recipe, target, seed, data.*, feature_dtype)")
    parser.add_argument("--output", required=True, help="folder for data.jsonl and features/")
    parser.add_argument("--hidden-states", help="folder of the hs_<i>.safetensors files (default: SRC/hidden_states)")
    parser.add_argument("--target-layer-ids", type=int, nargs="+",
                        help="the --target-layer-ids vLLM was launched with (default: 2, L//2, L-3)")
    parser.add_argument("--target", help="the target (overrides target= of the config)")
    args = parser.parse_intermixed_args(argv)
    config, overrides = ((args.settings[0], args.settings[1:]) if args.settings and "=" not in args.settings[0]
                         else (None, list(args.settings)))
    if args.target:
        overrides.append(f"target={args.target}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        cfg = load_train_config(config, overrides)
        done = import_speculators_states(args.src, args.output, cfg, hidden_states_dir=args.hidden_states,
                                         target_layer_ids=args.target_layer_ids)
    except ValueError as err:
        print(f"speculators_states: error: {err}", file=sys.stderr)
        return 2
    print(f"imported {done.samples} rows ({len(done.missing)} without hidden states left out); train with:\n"
          + " ".join(["python -m specheads.train", *([config] if config else []), *overrides,
                      *done.train_overrides()]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
