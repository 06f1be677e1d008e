"""Training on the target's own answers: the `regenerate:` section of a recipe.

At decode time the target reads its own greedy output, not the data's original authors', so a drafter trained on the
target's answers learns the text it will be asked to guess (EAGLE's, Medusa-2's and the peers' trainers regenerate
for this reason). With `regenerate.mode`:

- `none` (the default): the source's answers;
- `alone`: each conversation's first user turn with the target's greedy answer, and nothing else;
- `mixed`: both, each conversation twice (one prompt: the held-out split keeps both copies on one side).

The answers come from `regenerate.via`: `llamacpp`, `llama-server` on the target's F32 GGUF with `regenerate.slots`
conversations in flight (2.4x HF `generate` in batches of 16 on a 2-core CPU, the same answers:
`scripts/lab/bench_regenerate.py`); `target`, the HF target in the training process, batched (a GPU's choice); or the
URL of an OpenAI-compatible server already serving the target (`train/endpoint.py`).

A conversation whose rendered prompt leaves fewer than `MIN_ANSWER_TOKENS` of `data.max_length` is not asked: the
training row would cut its answer away. The answers are cached once per target, data slice and settings under
`$SPECHEADS_HOME/regenerated/`, with `meta.json` saying what they are; a killed run resumes where it stopped
(`train/regenerate.py`'s shards and journals), and later runs (other seeds, other recipes) read them at once.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import datasets
from filelock import FileLock
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specheads.cached import specheads_home, stamp
from specheads.checked import Checked
from specheads.conversations import sharegpt_path
from specheads.target import resolve_target, stop_token_ids
from specheads.train.data import MESSAGES_FEATURES, SHAREGPT_SOURCE
from specheads.train.endpoint import Answered, Endpoint, EndpointAnswerer
from specheads.train.regenerate import Answerer, RegenerateReport, TargetAnswerer, regenerate

log = logging.getLogger(__name__)

MODES = ("none", "alone", "mixed")
MIN_ANSWER_TOKENS = 16  # a prompt leaving fewer answer tokens in data.max_length is not asked
META = "meta.json"  # written last: a folder holding it is complete


@dataclass(frozen=True)
class RegenerateConfig(Checked):
    """The `regenerate:` section: the training conversations answered again by the target itself, greedily."""

    mode: str = "none"  # "none": the source's answers; "alone": the target's only; "mixed": both
    via: str = "llamacpp"  # "llamacpp" (llama-server, target's F32 GGUF), "target" (in process), or a server's URL
    max_new_tokens: int = 128  # tokens per answer
    slots: int = 8  # conversations in flight (llama-server's slots, or a server's concurrency)
    batch_size: int = 16  # conversations per generate call (via: target)

    def _check(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"regenerate.mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.via not in ("llamacpp", "target") and not self.via.startswith(("http://", "https://")):
            raise ValueError(f"regenerate.via must be llamacpp, target or a server's http(s) URL, got {self.via!r}")
        for key in ("max_new_tokens", "slots", "batch_size"):
            if getattr(self, key) < 1:
                raise ValueError(f"regenerate.{key} must be >= 1, got {getattr(self, key)}")

    @property
    def enabled(self) -> bool:
        return self.mode != "none"


@dataclass(frozen=True)
class Regenerated:
    conversations: datasets.Dataset  # what the recipe trains on (`messages`), per `mode`
    report: RegenerateReport  # this call's work (nothing answered when the cache held every answer)
    folder: Path  # the cached answers


def with_regenerated(conversations: datasets.Dataset, cfg: RegenerateConfig, *, target: str, source: str,
                     slice_: dict, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                     max_length: int) -> Regenerated:
    """`conversations` (the recipe's data slice, `messages`) with the target's answers, per `cfg.mode`, answered
    now or read from the cache. `slice_` names the slice (source, skip, count) in the cache key."""
    if "messages" not in conversations.column_names:
        raise ValueError(f"regenerate.mode={cfg.mode} answers conversations, and {source} holds pre-tokenized rows; "
                         "pass a source of conversations, or regenerate.mode=none")
    asked = [m for m in conversations["messages"] if _prompt_fits(tokenizer, m, max_length)]
    folder, key = cache_folder(cfg, target=target, source=source, slice_=slice_, asked=len(asked), model=model)
    folder.mkdir(parents=True, exist_ok=True)
    with FileLock(str(folder) + ".lock"):  # one process answers; the others find its cache
        if (folder / META).is_file():
            report = RegenerateReport(joined=folder / "conversations.jsonl", answered=0, resumed=len(asked),
                                      kept=json.loads((folder / META).read_text())["kept"])
        else:
            log.info("regenerating %d conversations' first answers via %s into %s (%d not asked: their prompts "
                     "leave under %d tokens of data.max_length)", len(asked), cfg.via, folder,
                     len(conversations) - len(asked), MIN_ANSWER_TOKENS)
            report = _answer(asked, folder, cfg, target=target, model=model, tokenizer=tokenizer,
                             max_length=max_length)
            (folder / META).write_text(json.dumps({**key, "kept": report.kept, "config": asdict(cfg),
                                                   "seconds": report.seconds, "tokens": report.tokens}, indent=1))
    rows = [json.loads(line)["messages"] for line in report.joined.read_text(encoding="utf-8").splitlines()
            if line.strip()]
    if not rows and cfg.mode == "alone":
        raise ValueError(f"regenerate.mode=alone kept no conversation: of {len(conversations)}, {len(asked)} had a "
                         f"prompt leaving {MIN_ANSWER_TOKENS} tokens of data.max_length={max_length} for an answer, "
                         "and none was answered; raise data.max_length or use regenerate.mode=mixed")
    answered = datasets.Dataset.from_dict({"messages": rows}, features=MESSAGES_FEATURES)
    if cfg.mode == "mixed":
        answered = datasets.concatenate_datasets([conversations, answered])
    return Regenerated(answered, report, folder)


def cache_folder(cfg: RegenerateConfig, *, target: str, source: str, slice_: dict, asked: int,
                 model: PreTrainedModel) -> tuple[Path, dict]:
    """Where the answers to a slice are cached, and the key (what decides them) that names the folder."""
    key = {"target": stamp(resolve_target(target)),
           "source": stamp(sharegpt_path() if source.strip().lower() == SHAREGPT_SOURCE else source),
           "slice": slice_, "asked": asked, "via": _via_key(cfg.via, model), "max_new_tokens": cfg.max_new_tokens,
           "turns": 1, "temperature": 0.0}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return specheads_home() / "regenerated" / f"{Path(str(resolve_target(target))).name}-{digest}", key


def _answer(conversations: list[list[dict]], folder: Path, cfg: RegenerateConfig, *, target: str,
            model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, max_length: int) -> RegenerateReport:
    answerer: Answerer
    if cfg.via == "target":
        answerer = TargetAnswerer(model, tokenizer, batch_size=cfg.batch_size, max_new_tokens=cfg.max_new_tokens,
                                  max_prompt_tokens=max_length, stop_ids=stop_token_ids(tokenizer, model))
    elif cfg.via == "llamacpp":
        answerer = LlamaServerAnswerer(target, slots=cfg.slots, max_new_tokens=cfg.max_new_tokens,
                                       ctx_size=max_length + cfg.max_new_tokens)
    else:
        answerer = EndpointAnswerer(Endpoint(cfg.via, concurrency=cfg.slots), max_new_tokens=cfg.max_new_tokens)
    try:
        return regenerate(conversations, folder, answerer, max_turns=1)
    finally:
        if isinstance(answerer, EndpointAnswerer):
            answerer.close()


class LlamaServerAnswerer:
    """An `Answerer`: `llama-server` on the target's F32 GGUF with an f32 cache (the fp32 target's greedy answers,
    equal to HF's up to ties within rounding), `slots` conversations at once; started only when there is something
    to ask, so a run whose answers are all cached starts nothing."""

    def __init__(self, target: str, *, slots: int, max_new_tokens: int, ctx_size: int) -> None:
        self.target, self.slots, self.max_new_tokens, self.ctx_size = target, slots, max_new_tokens, ctx_size

    def answer(self, conversations: list[list[dict]]) -> Iterator[Answered]:
        if not conversations:
            return
        from specheads.llamacpp.server import LlamaServer
        from specheads.llamacpp.target_gguf import target_gguf

        with LlamaServer(target_gguf(self.target, "f32"), cache_type="f32", slots=self.slots,
                         ctx_size=self.ctx_size) as server:
            answerer = EndpointAnswerer(Endpoint(server.url, concurrency=self.slots),
                                        max_new_tokens=self.max_new_tokens)
            try:
                yield from answerer.answer(conversations)
            finally:
                answerer.close()


def _prompt_fits(tokenizer: PreTrainedTokenizerBase, messages: list[dict], max_length: int) -> bool:
    """Whether the first user turn's rendered prompt leaves `MIN_ANSWER_TOKENS` of `max_length` for its answer."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), len(messages))
    text = tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True, tokenize=False)
    return len(tokenizer(text, add_special_tokens=False)["input_ids"]) + MIN_ANSWER_TOKENS <= max_length


def _via_key(via: str, model: PreTrainedModel) -> str:
    """What decides the answers' bits: llama.cpp's F32 file, the in-process target's precision, or the server."""
    return {"llamacpp": "llamacpp-f32", "target": f"target-{model.dtype}-{model.device.type}"}.get(via, via)
