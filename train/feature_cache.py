"""Offline features: the target's hidden states cached to safetensors shards, reused across epochs.

Online training runs the frozen target inside every step; offline training runs it once per
conversation and reads features back from disk (memory-mapped), which pays off from the second
epoch on and frees the accelerator from the target during training. Both produce the same batches.

Layout: `DIR/index.json` ({"hidden_size", "aux_layers", "dtype", "examples": [[shard, offset, length], ...],
"fingerprint"}) and `DIR/shard_00000.safetensors` ... each holding one tensor `features` [tokens, D]
with D = (len(aux_layers) + 1) * hidden_size (see `features.py` for the row layout).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specheads.features import feature_width
from specheads.train.data import collate
from specheads.train.features import target_features

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def fingerprint(input_ids: Sequence[Sequence[int]], target_name: str) -> str:
    h = hashlib.sha1(target_name.encode())
    for ids in input_ids:
        h.update(json.dumps(ids).encode())
    return h.hexdigest()


def write_feature_cache(
    target: torch.nn.Module,
    input_ids: Sequence[Sequence[int]],
    out_dir: str | Path,
    *,
    target_name: str,
    dtype: str = "bfloat16",
    aux_layers: Sequence[int] = (),
    shard_tokens: int = 1 << 20,
    batch_tokens: int = 4096,
) -> Path:
    """Compute and store features for every example. A complete cache for the same data is reused
    when it holds the same aux layers, or when only the last layer is wanted (any cache has it).

    Examples of similar length run together, up to `batch_tokens` padded tokens per forward: one
    conversation per forward leaves much of a CPU's matrix throughput unused (and autocast casts
    every weight again for each forward): batched, caching takes about 0.74 of the time on a 2-core
    CPU (scripts/bench_feature_cache.py)."""
    if dtype not in DTYPES:
        raise ValueError(f"feature dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    out = Path(out_dir)
    fp = fingerprint(input_ids, target_name)
    index_path = out / "index.json"
    aux_layers = [int(i) for i in aux_layers]
    if index_path.is_file():
        index = json.loads(index_path.read_text())
        if index.get("fingerprint") == fp and (not aux_layers or index.get("aux_layers", []) == aux_layers):
            log.info("reusing the feature cache in %s", out)
            return out
    out.mkdir(parents=True, exist_ok=True)
    hidden = target.config.get_text_config().hidden_size
    width = feature_width(hidden, aux_layers)
    total = sum(len(ids) for ids in input_ids)
    size = total * width * torch.tensor([], dtype=DTYPES[dtype]).element_size()
    log.info("feature cache: %d tokens x %d x %s = %.2f GB in %s", total, width, dtype, size / 1e9, out)
    device = next(target.parameters()).device
    examples: list[list[int]] = [[]] * len(input_ids)  # in input order, whatever order they are computed in
    pending: list[torch.Tensor] = []
    pending_tokens, shard = 0, 0

    def flush() -> None:
        nonlocal pending, pending_tokens, shard
        if pending:
            tmp = out / f"shard_{shard:05d}.safetensors.tmp"
            save_file({"features": torch.cat(pending).contiguous()}, str(tmp))
            os.replace(tmp, out / f"shard_{shard:05d}.safetensors")
            shard += 1
        pending, pending_tokens = [], 0

    bar = tqdm(total=len(input_ids), desc="caching features", unit="conv")
    for rows in length_batches([len(ids) for ids in input_ids], batch_tokens):
        batch = collate([{"input_ids": input_ids[i], "loss_mask": [0] * len(input_ids[i])} for i in rows], 0)
        feats = target_features(target, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                aux_layers).to("cpu", DTYPES[dtype])  # [B, T, D]
        for r, i in enumerate(rows):
            n = len(input_ids[i])
            examples[i] = [shard, pending_tokens, n]
            pending.append(feats[r, :n])
            pending_tokens += n
            if pending_tokens >= shard_tokens:
                flush()
        bar.update(len(rows))
    bar.close()
    flush()
    # The index goes last: a cache without it is incomplete and gets rebuilt.
    tmp = out / "index.json.tmp"
    tmp.write_text(json.dumps({"hidden_size": hidden, "aux_layers": aux_layers, "dtype": dtype, "fingerprint": fp,
                               "examples": examples}))
    os.replace(tmp, index_path)
    return out


def length_batches(lengths: Sequence[int], batch_tokens: int) -> list[list[int]]:
    """Indices grouped by length (longest first), each group's rows x longest length <= batch_tokens (a longer
    example alone): little padding, and the slowest batch first so the progress bar's estimate is an upper one."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[groups[-1][0]] <= batch_tokens:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


class FeatureCache:
    """Reads one example's features [T, D] from the memory-mapped shards."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        index_path = self.path / "index.json"
        if not index_path.is_file():
            raise ValueError(f"no feature cache in {self.path} (index.json missing); run with features=offline to "
                             "build it")
        index = json.loads(index_path.read_text())
        self.examples: list[list[int]] = index["examples"]
        self.hidden_size: int = index["hidden_size"]
        self.aux_layers: list[int] = index.get("aux_layers", [])
        self.width = feature_width(self.hidden_size, self.aux_layers)
        self._files: dict[int, Any] = {}

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, i: int) -> torch.Tensor:
        shard, offset, length = self.examples[i]
        if shard not in self._files:
            self._files[shard] = safe_open(str(self.path / f"shard_{shard:05d}.safetensors"), framework="pt")
        return self._files[shard].get_slice("features")[offset : offset + length]


def collate_with_features(examples: Sequence[Mapping[str, Any]], pad_id: int,
                          cache: FeatureCache) -> dict[str, torch.Tensor]:
    """`collate` plus `features` [B, T, D] (fp32, zeros on padding) read from the cache by example `row` index."""
    batch = collate(examples, pad_id)
    b, t = batch["input_ids"].shape
    feats = torch.zeros(b, t, cache.width)
    for r, e in enumerate(examples):
        f = cache[int(e["row"])]
        feats[r, : f.shape[0]] = f.float()
    batch["features"] = feats
    return batch
