"""Self-distillation data: the target rewrites every assistant turn of a conversation set.

    python -m specheads.train.regenerate --target default --source sharegpt --max-conversations 2000 \\
        --output data/regen-smollm2 [--max-new-tokens 256 --batch-size 16 --temperature 0 --shard-size 128 \\
        --max-turns 1 --dtype bfloat16]

Each assistant turn is replaced by the target's own answer to the conversation so far (user turns
kept, earlier assistant turns already regenerated), so a drafter trained on the result learns the
target's distribution rather than the original authors'. Work is split into shards of
`--shard-size` conversations, each written atomically as `shard_00000.jsonl`; a rerun skips
finished shards, so an interrupted job resumes where it stopped. When all shards exist they are
joined into `conversations.jsonl` (OpenAI `messages` format), usable as `data.source=`.

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
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel, PreTrainedTokenizerBase

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
) -> list[list[dict]]:
    """Regenerate all assistant turns of a batch, turn by turn (turn i of every conversation in one generate call).

    1. Keep system/user turns; walk assistant turns in order.
    2. For every conversation that has an i-th assistant turn, render the history so far with the
       chat template (left-padded batch) and let the target answer.
    3. Stop a conversation early when its prompt would exceed max_prompt_tokens (the rest is dropped).
    """
    out: list[list[dict]] = [[] for _ in conversations]
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
            text = tokenizer.decode(gen[row, width:], skip_special_tokens=True).strip()
            out[c].append({"role": "assistant", "content": text})
            cursors[c] += 1
        alive = owners
    return [o for o in out if any(m["role"] == "assistant" for m in o)]


def regenerate(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    conversations: list[list[dict]],
    output: Path,
    *,
    shard_size: int = 128,
    batch_size: int = 16,
    max_new_tokens: int = 256,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_prompt_tokens: int = 1536,
    max_turns: int | None = None,
    stop_ids: list[int] | None = None,
) -> Path:
    """Regenerate `conversations` into shards under `output`; returns the joined conversations.jsonl.

    `max_turns` keeps only the first that many assistant turns of each conversation (and what precedes them).
    """
    if shard_size < 1 or batch_size < 1:
        raise ValueError("--shard-size and --batch-size must be >= 1")
    if max_turns is not None:
        if max_turns < 1:
            raise ValueError(f"--max-turns must be >= 1, got {max_turns}")
        conversations = [_first_turns(c, max_turns) for c in conversations]
    output.mkdir(parents=True, exist_ok=True)
    stop_ids = stop_ids or [tokenizer.eos_token_id]
    shards = [conversations[i : i + shard_size] for i in range(0, len(conversations), shard_size)]
    done = sum((output / f"shard_{k:05d}.jsonl").is_file() for k in range(len(shards)))
    if done:
        log.info("resuming: %d of %d shards already written", done, len(shards))
    bar = tqdm(total=len(conversations), desc="regenerate", unit="conv", initial=done * shard_size)
    for k, shard in enumerate(shards):
        path = output / f"shard_{k:05d}.jsonl"
        if path.is_file():
            continue
        rows = []
        # Similar prompt lengths per batch: less left padding. Sorting within the shard keeps shards deterministic.
        shard = sorted(shard, key=lambda c: sum(len(m["content"]) for m in c))
        for i in range(0, len(shard), batch_size):
            batch = shard[i : i + batch_size]
            rows += regenerate_batch(model, tokenizer, batch, max_new_tokens=max_new_tokens, temperature=temperature,
                                     top_p=top_p, max_prompt_tokens=max_prompt_tokens, stop_ids=stop_ids)
            bar.update(len(batch))
        tmp = path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(json.dumps({"messages": r}, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        os.replace(tmp, path)  # a shard exists only once complete
    bar.close()
    joined = output / "conversations.jsonl"
    tmp = joined.with_suffix(".jsonl.tmp")
    with tmp.open("w", encoding="utf-8") as f:
        for k in range(len(shards)):
            f.write((output / f"shard_{k:05d}.jsonl").read_text(encoding="utf-8"))
    os.replace(tmp, joined)
    return joined


def _first_turns(messages: list[dict], turns: int) -> list[dict]:
    out, seen = [], 0
    for m in messages:
        if m["role"] == "assistant":
            if seen == turns:
                break
            seen += 1
        out.append(m)
    while out and out[-1]["role"] != "assistant":  # a user turn with no answer kept teaches nothing
        out.pop()
    return out


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
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from specheads.target import load_target, stop_token_ids
    from specheads.train.data import load_conversations

    try:
        if args.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {args.temperature}")
        ds, report = load_conversations(args.source, max_conversations=args.max_conversations)
        model, tokenizer = load_target(args.target, device=args.device, dtype=args.dtype)
        joined = regenerate(model, tokenizer, ds["messages"], args.output, shard_size=args.shard_size,
                            batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                            temperature=args.temperature, top_p=args.top_p, max_turns=args.max_turns,
                            stop_ids=stop_token_ids(tokenizer, model))
    except ValueError as err:
        print(f"regenerate: error: {err}", file=sys.stderr)
        return 2
    print(f"regenerated conversations: {joined}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
