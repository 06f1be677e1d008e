"""Offline features: the target's hidden states cached to safetensors shards, reused across epochs.

Online training runs the frozen target inside every step; offline training runs it once per
conversation and reads features back from disk (memory-mapped), which pays off from the second
epoch on and frees the accelerator from the target during training. Both produce the same batches.

Layout: `DIR/index.json` ({"hidden_size", "aux_layers", "dtype", "examples": [[shard, offset, length], ...],
"fingerprint"}) and `DIR/shard_00000.safetensors` ... each holding one tensor `features` [tokens, D]
with D = (len(aux_layers) + 1) * hidden_size (see `features.py` for the row layout). On disk a token takes
D x the dtype's bytes: 4.6 kB for SmolLM2 (H = 576) with three aux layers in bf16, 32 kB for an 8B Llama
(H = 4096) with three aux layers in bf16, half that for a kind that reads the last layer only.

Several processes write one cache together: process p of n computes examples p, p + n, ... into its own shards
(`shard_p{p}_00000.safetensors`) and part index (`index.part{p}.json`), and `join_feature_cache` makes the
index of all once every part exists (the directory must be one all processes see).
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
    part: tuple[int, int] = (0, 1),
    lockstep: bool = False,
) -> Path:
    """Compute and store features for every example. A complete cache for the same data is reused
    when it holds the same aux layers, or when only the last layer is wanted (any cache has it).

    Examples of similar length run together, up to `batch_tokens` padded tokens per forward: one
    conversation per forward leaves much of a CPU's matrix throughput unused (and autocast casts
    every weight again for each forward): batched, caching takes about 0.74 of the time on a 2-core
    CPU (scripts/lab/bench_feature_cache.py).

    `part` = (p, n): this process computes examples p, p + n, ... and writes a part index; with n > 1 the cache is
    complete once `join_feature_cache` has joined the n parts. `lockstep`: every part runs as many target forwards
    as the longest part (a target sharded over the processes gathers each layer collectively), and a part left by
    an earlier run is computed again (another part may not have been left)."""
    if dtype not in DTYPES:
        raise ValueError(f"feature dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    rank, parts = part
    if not 0 <= rank < parts:
        raise ValueError(f"feature cache part {rank} of {parts} does not exist")
    out = Path(out_dir)
    fp = fingerprint(input_ids, target_name)
    index_path = out / "index.json" if parts == 1 else out / f"index.part{rank}.json"
    aux_layers = [int(i) for i in aux_layers]
    for found in (out / "index.json",) if lockstep else (out / "index.json", index_path):
        if found.is_file():
            index = json.loads(found.read_text())
            same_part = found.name == "index.json" or index.get("part") == [rank, parts]  # a part of this split
            if index.get("fingerprint") == fp and same_part and (
                    not aux_layers or index.get("aux_layers", []) == aux_layers):
                log.info("reusing the feature cache in %s", found)
                return out
    prefix = "shard_" if parts == 1 else f"shard_p{rank}_"
    mine = range(rank, len(input_ids), parts)
    out.mkdir(parents=True, exist_ok=True)
    hidden = target.config.get_text_config().hidden_size
    width = feature_width(hidden, aux_layers)
    total = sum(len(input_ids[i]) for i in mine)
    size = total * width * torch.tensor([], dtype=DTYPES[dtype]).element_size()
    log.info("feature cache: %d tokens x %d x %s = %.2f GB in %s", total, width, dtype, size / 1e9, out)
    device = next(target.parameters()).device
    examples: list[list] = [[]] * len(input_ids)  # in input order, whatever order they are computed in
    shards = ShardWriter(out, prefix, shard_tokens, named=parts > 1)

    bar = tqdm(total=len(mine), desc="caching features" if parts == 1 else f"caching features (part {rank})",
               unit="conv")
    groups = length_batches([len(input_ids[i]) for i in mine], batch_tokens)
    if lockstep:  # the other parts' forward counts, known here without asking: every part's examples are
        longest = max(len(length_batches([len(input_ids[i]) for i in range(p, len(input_ids), parts)], batch_tokens))
                      for p in range(parts))
        for _ in range(longest - len(groups)):  # forwards whose output is dropped, so every layer's gather pairs up
            one = torch.ones(1, 1, dtype=torch.long, device=device)
            target_features(target, one, one, aux_layers)
    for group in groups:
        rows = [mine[g] for g in group]
        batch = collate([{"input_ids": input_ids[i], "loss_mask": [0] * len(input_ids[i])} for i in rows], 0)
        feats = target_features(target, batch["input_ids"].to(device), batch["attention_mask"].to(device),
                                aux_layers).to("cpu", DTYPES[dtype])  # [B, T, D]
        for r, i in enumerate(rows):
            examples[i] = shards.add(feats[r, : len(input_ids[i])])
        bar.update(len(rows))
    bar.close()
    shards.close()
    # The index goes last: a cache without it is incomplete and gets rebuilt.
    write_json(index_path, {"hidden_size": hidden, "aux_layers": aux_layers, "dtype": dtype, "fingerprint": fp,
                             "examples": examples, **({"part": [rank, parts]} if parts > 1 else {})})
    return out


def join_feature_cache(out_dir: str | Path, parts: int) -> Path:
    """The index of a cache `parts` processes wrote (`write_feature_cache(part=...)`), from their part indices."""
    out = Path(out_dir)
    if parts == 1 or (out / "index.json").is_file() and not (out / "index.part0.json").is_file():
        return out  # one writer, or joined before
    indices = [json.loads((out / f"index.part{p}.json").read_text()) for p in range(parts)]
    if len({i["fingerprint"] for i in indices}) != 1:
        raise ValueError(f"the parts of the feature cache in {out} were written for different data; remove the "
                         "directory (or set another feature_cache_dir) and run again")
    joined = {k: v for k, v in indices[0].items() if k != "part"}
    joined["examples"] = [next(i["examples"][e] for i in indices if i["examples"][e])
                          for e in range(len(indices[0]["examples"]))]
    write_json(out / "index.json", joined)
    for p in range(parts):
        (out / f"index.part{p}.json").unlink()
    return out


class ShardWriter:
    """Feature rows appended to safetensors shards of about `shard_tokens` tokens each, every shard written
    atomically once full (`prefix` + number); `add` returns where a row lies: [shard, offset, length], the shard by
    number, or by name where several writers share the directory (`named`)."""

    def __init__(self, out: Path, prefix: str = "shard_", shard_tokens: int = 1 << 20, named: bool = False) -> None:
        self.out, self.prefix, self.shard_tokens, self.named = out, prefix, shard_tokens, named
        self.pending: list[torch.Tensor] = []
        self.pending_tokens, self.shard = 0, 0

    def add(self, row: torch.Tensor) -> list:  # row [n, D]
        where = [f"{self.prefix}{self.shard:05d}" if self.named else self.shard, self.pending_tokens, row.shape[0]]
        self.pending.append(row)
        self.pending_tokens += row.shape[0]
        if self.pending_tokens >= self.shard_tokens:
            self.close()
        return where

    def close(self) -> None:
        """Write the shard in progress (if any rows are pending)."""
        if self.pending:
            name = f"{self.prefix}{self.shard:05d}.safetensors"
            save_file({"features": torch.cat(self.pending).contiguous()}, str(self.out / (name + ".tmp")))
            os.replace(self.out / (name + ".tmp"), self.out / name)
            self.shard += 1
        self.pending, self.pending_tokens = [], 0


def write_json(path: Path, value: Any) -> None:
    """`value` as JSON at `path`, atomically: a reader sees the old file or the new one, never part of one."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value))
    os.replace(tmp, path)


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
        if shard not in self._files:  # a number (one writer) or a part's shard name (several)
            name = f"shard_{shard:05d}" if isinstance(shard, int) else shard
            self._files[shard] = safe_open(str(self.path / f"{name}.safetensors"), framework="pt")
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
