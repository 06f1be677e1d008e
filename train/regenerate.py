"""Self-distillation data: the target rewrites every assistant turn of a conversation set.

    python -m specheads.train.regenerate --target default --source sharegpt --max-conversations 2000 \\
        --output data/regen-smollm2 [--max-new-tokens 256 --batch-size 16 --temperature 0 --shard-size 128 \\
        --max-turns 1 --dtype bfloat16]
    python -m specheads.train.regenerate --endpoint http://host:8000/v1 --source sharegpt \\
        --output data/regen-70b [--model NAME --api-key KEY --concurrency 32]

Each assistant turn is replaced by the target's own answer to the conversation so far (user turns
kept, earlier assistant turns already regenerated), so a drafter trained on the result learns the
target's distribution rather than the original authors'. The target answers in this process, or, with
`--endpoint`, on any OpenAI-compatible server (vLLM, SGLang, `specheads serve`; `train/endpoint.py`), which is
how a target too large for this machine regenerates its data.

Work is split into shards of `--shard-size` conversations. Each answered conversation is appended at once to its
shard's journal (`shard_00000.partial.jsonl`), and a finished shard is written atomically as `shard_00000.jsonl`
(in input order), its journal then removed: a rerun of the same command after a kill asks for nothing already
answered and loses nothing answered. When all shards exist they are joined into `conversations.jsonl` (OpenAI
`messages` format), usable as `data.source=`.

Speed on CPU: batches are formed from conversations of similar prompt length (left padding
is wasted work), `--max-turns 1` keeps only each conversation's first exchange (the MT-bench
first-turn setting, and most of the signal per token generated), and `--dtype bfloat16` runs
the target's GEMMs in bf16, which is much faster on CPUs with native bf16 (the answers are
then the bf16 target's, a close approximation of its fp32 self).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specheads.train.endpoint import Answered, Endpoint, EndpointAnswerer

log = logging.getLogger(__name__)


def _prompt_ids(tokenizer: PreTrainedTokenizerBase, messages: list[dict]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


@torch.inference_mode()
def regenerate_batch(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict]],
    *,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    max_prompt_tokens: int,
    stop_ids: list[int],
) -> list[tuple[list[dict] | None, int]]:
    """Regenerate all assistant turns of a batch, turn by turn (turn i of every conversation in one generate call).

    1. Keep system/user turns; walk assistant turns in order.
    2. For every conversation that has an i-th assistant turn, render the history so far with the
       chat template (left-padded batch) and let the target answer.
    3. Stop a conversation early when its prompt would exceed max_prompt_tokens (the rest is dropped).
    Returns one entry per conversation: the regenerated one (None where no assistant turn was answered) and the
    tokens generated for it (padding left out).
    """
    out: list[list[dict]] = [[] for _ in conversations]
    generated = [0] * len(conversations)
    cursors = [0] * len(conversations)
    alive = list(range(len(conversations)))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_ids[0]
    while alive:
        prompts, owners = [], []
        for c in alive:
            msgs = conversations[c]
            while cursors[c] < len(msgs) and msgs[cursors[c]]["role"] != "assistant":
                out[c].append(msgs[cursors[c]])
                cursors[c] += 1
            if cursors[c] >= len(msgs):
                continue
            ids = _prompt_ids(tokenizer, out[c])
            if len(ids) > max_prompt_tokens:
                continue
            prompts.append(ids)
            owners.append(c)
        if not prompts:
            break
        width = max(len(p) for p in prompts)
        device = next(model.parameters()).device
        input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=device)
        attention = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        sampling = (dict(do_sample=False) if temperature == 0
                    else dict(do_sample=True, temperature=temperature, top_p=top_p))
        gen = model.generate(input_ids=input_ids, attention_mask=attention, max_new_tokens=max_new_tokens,
                             eos_token_id=stop_ids, pad_token_id=pad, **sampling)
        for row, c in enumerate(owners):
            generated[c] += int((gen[row, width:] != pad).sum())
            text = tokenizer.decode(gen[row, width:], skip_special_tokens=True).strip()
            out[c].append({"role": "assistant", "content": text})
            cursors[c] += 1
        alive = owners
    return [(_answered_part(o), n) for o, n in zip(out, generated)]


def _answered_part(messages: list[dict]) -> list[dict] | None:
    """The conversation up to its last answered assistant turn; None when it has none."""
    out = list(messages)
    while out and out[-1]["role"] != "assistant":  # a user turn with no answer teaches nothing
        out.pop()
    return out or None


class Answerer(Protocol):
    """What answers conversations for `regenerate`: the target in this process or a server."""

    def answer(self, conversations: list[list[dict]]) -> Iterator[Answered]:
        """Each conversation regenerated, yielded as it completes (in any order)."""
        ...


class TargetAnswerer:
    """The target in this process, in batches of conversations of similar length."""

    def __init__(self, model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, batch_size: int = 16,
                 max_new_tokens: int = 256, temperature: float = 0.0, top_p: float = 1.0,
                 max_prompt_tokens: int = 1536, stop_ids: list[int] | None = None) -> None:
        if batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {batch_size}")
        self.model, self.tokenizer, self.batch_size = model, tokenizer, batch_size
        self.settings = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             max_prompt_tokens=max_prompt_tokens, stop_ids=stop_ids or [tokenizer.eos_token_id])

    def answer(self, conversations: list[list[dict]]) -> Iterator[Answered]:
        # Similar prompt lengths per batch: less left padding.
        order = sorted(range(len(conversations)), key=lambda i: sum(len(m["content"]) for m in conversations[i]))
        for start in range(0, len(order), self.batch_size):
            rows = order[start: start + self.batch_size]
            done = regenerate_batch(self.model, self.tokenizer, [conversations[i] for i in rows], **self.settings)
            for i, (messages, tokens) in zip(rows, done):
                yield Answered(i, messages, tokens)


@dataclass(frozen=True)
class RegenerateReport:
    joined: Path  # conversations.jsonl
    answered: int  # conversations answered by this call
    resumed: int  # conversations found answered (finished shards and journals) and not asked again
    kept: int  # conversations in the output (those with at least one answered turn)
    tokens: int = 0  # tokens generated by this call
    seconds: float = 0.0  # this call's wall time


def regenerate(conversations: list[list[dict]], output: Path, answerer: Answerer, *, shard_size: int = 128,
               max_turns: int | None = None) -> RegenerateReport:
    """Regenerate `conversations` into shards under `output` (resuming what an earlier call left there).

    `max_turns` keeps only the first that many assistant turns of each conversation (and what precedes them).
    Every unanswered conversation goes to the answerer in one stream, so its slots stay full across shards (asking
    shard by shard left them draining at every shard's end); a shard is written as soon as its last answer is in.
    """
    if shard_size < 1:
        raise ValueError(f"--shard-size must be >= 1, got {shard_size}")
    if max_turns is not None:
        if max_turns < 1:
            raise ValueError(f"--max-turns must be >= 1, got {max_turns}")
        conversations = [_first_turns(c, max_turns) for c in conversations]
    output.mkdir(parents=True, exist_ok=True)
    shards = [conversations[i: i + shard_size] for i in range(0, len(conversations), shard_size)]
    journals = {k: _read_journal(_journal_path(output, k)) for k in range(len(shards))
                if not _shard_path(output, k).is_file()}
    resumed = len(conversations) - sum(len(shards[k]) - len(j) for k, j in journals.items())
    if resumed:
        log.info("resuming: %d of %d conversations already answered", resumed, len(conversations))
    for k, found in journals.items():  # shards answered in full before a kill wrote their journal only
        if len(found) == len(shards[k]):
            _finish_shard(output, k, shards[k], found)
    todo = [(k, i) for k, found in journals.items() if len(found) < len(shards[k])
            for i in range(len(shards[k])) if i not in found]
    bar = tqdm(total=len(conversations), desc="regenerate", unit="conv", initial=resumed)
    answered, tokens, start = 0, 0, time.perf_counter()
    files = {}  # shard -> its open journal
    try:
        for done in answerer.answer([shards[k][i] for k, i in todo]):
            k, i = todo[done.index]
            found = journals[k]
            found[i] = done.messages
            if k not in files:
                files[k] = _journal_path(output, k).open("a", encoding="utf-8")
            # one line per conversation, flushed at once: a kill loses at most the answers in flight
            files[k].write(json.dumps({"i": i, "messages": done.messages}, ensure_ascii=False) + "\n")
            files[k].flush()
            if len(found) == len(shards[k]):
                files.pop(k).close()
                _finish_shard(output, k, shards[k], found)
            answered, tokens = answered + 1, tokens + done.tokens
            bar.set_postfix_str(f"{tokens / max(time.perf_counter() - start, 1e-9):.0f} tok/s", refresh=False)
            bar.update(1)
    finally:
        for journal in files.values():
            journal.close()
        bar.close()
    seconds = time.perf_counter() - start
    joined = output / "conversations.jsonl"
    tmp = joined.with_suffix(".jsonl.tmp")
    kept = 0
    with tmp.open("w", encoding="utf-8") as f:
        for k in range(len(shards)):
            text = _shard_path(output, k).read_text(encoding="utf-8")
            kept += text.count("\n")
            f.write(text)
    os.replace(tmp, joined)
    return RegenerateReport(joined=joined, answered=answered, resumed=resumed, kept=kept, tokens=tokens,
                            seconds=seconds)


def _shard_path(output: Path, k: int) -> Path:
    return output / f"shard_{k:05d}.jsonl"


def _journal_path(output: Path, k: int) -> Path:
    return output / f"shard_{k:05d}.partial.jsonl"


def _finish_shard(output: Path, k: int, shard: list, found: dict[int, list[dict] | None]) -> None:
    """Shard `k` written whole, in input order, from its answers; its journal is then spent."""
    rows = [found[i] for i in range(len(shard)) if found[i] is not None]
    path = _shard_path(output, k)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps({"messages": r}, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    os.replace(tmp, path)  # a shard exists only once complete
    _journal_path(output, k).unlink(missing_ok=True)


def _read_journal(path: Path) -> dict[int, list[dict] | None]:
    """The conversations a shard's journal holds answered; a line cut by a kill is dropped (asked again)."""
    found: dict[int, list[dict] | None] = {}
    if not path.is_file():
        return found
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            found[int(row["i"])] = row["messages"]
        except (ValueError, KeyError, TypeError):
            log.warning("%s: dropping an unfinished line (its conversation is asked again)", path)
    return found


def _first_turns(messages: list[dict], turns: int) -> list[dict]:
    out, seen = [], 0
    for m in messages:
        if m["role"] == "assistant":
            if seen == turns:
                break
            seen += 1
        out.append(m)
    return _answered_part(out) or []


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specheads.train.regenerate", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="default")
    p.add_argument("--source", default="sharegpt", help="sharegpt or a local .json/.jsonl/.parquet file")
    p.add_argument("--max-conversations", type=int)
    p.add_argument("--output", type=Path, required=True)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--shard-size", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--max-turns", type=int, help="regenerate only the first N assistant turns of each conversation")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto", help="auto (the checkpoint's), float32, bfloat16, float16")
    served = p.add_argument_group("a served target (instead of --target)")
    served.add_argument("--endpoint", help="an OpenAI-compatible server's URL (vLLM, SGLang, specheads serve)")
    served.add_argument("--model", help="the served model's name (default: the first /v1/models lists)")
    served.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="default: $OPENAI_API_KEY")
    served.add_argument("--concurrency", type=int, default=16, help="conversations in flight")
    served.add_argument("--retries", type=int, default=5, help="further tries after a connection error, 429 or 5xx")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specheads.target import load_target, stop_token_ids
    from specheads.train.data import load_conversations

    answerer: Answerer | None = None
    try:
        if args.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
        ds, _ = load_conversations(args.source, max_conversations=args.max_conversations)
        if args.endpoint:
            answerer = EndpointAnswerer(Endpoint(args.endpoint, model=args.model, api_key=args.api_key,
                                                 concurrency=args.concurrency, retries=args.retries),
                                        max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                        top_p=args.top_p)
        else:
            model, tokenizer = load_target(args.target, device=args.device, dtype=args.dtype)
            answerer = TargetAnswerer(model, tokenizer, batch_size=args.batch_size,
                                      max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                                      top_p=args.top_p, stop_ids=stop_token_ids(tokenizer, model))
        done = regenerate(ds["messages"], args.output, answerer, shard_size=args.shard_size,
                          max_turns=args.max_turns)
    except ValueError as err:  # EndpointError included
        print(f"regenerate: error: {err}", file=sys.stderr)
        return 2
    finally:
        if isinstance(answerer, EndpointAnswerer):
            answerer.close()
    print(f"regenerated conversations: {done.joined} ({done.kept} kept; {done.answered} answered now, "
          f"{done.resumed} found answered)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
