"""A tiny random Llama target with the default target's tokenizer (llama.cpp's converter recognises that one; our
tests' word-level tokenizer it does not), and EAGLE-3 heads for it: what the llama.cpp tests convert and serve."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.target import resolve_target
from tests.drafters import perturbed

LAYERS = 8
AUX = (2, 4, 5)  # EAGLE-3's default for 8 layers is (2, 4, 5): three distinct target layer inputs
DRAFT_VOCAB = tuple(range(0, 6000))  # the draft LM head's rows: the tokenizer's first 6000 ids, common text


def smol_tiny_target(folder: Path, seed: int = 0) -> LlamaForCausalLM:
    """Saved into `folder` with the default target's tokenizer files (49152 tokens)."""
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=1,
                         eos_token_id=2, pad_token_id=2, tie_word_embeddings=False, initializer_range=0.2)
    model = LlamaForCausalLM(config).eval().requires_grad_(False)
    model.save_pretrained(folder)
    copy_tokenizer(folder)
    return model


def copy_tokenizer(folder: Path) -> None:
    """The default target's tokenizer files into `folder` (a saved model of its 49152-token vocabulary)."""
    source = Path(resolve_target("default"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (source / name).is_file():
            shutil.copy2(source / name, folder / name)


def eagle3_heads(target: torch.nn.Module, **config):
    from specheads.heads.eagle3 import Eagle3Config, Eagle3Head

    torch.manual_seed(0)
    cfg = Eagle3Config(**{"hidden_size": 64, "vocab_size": 49152, "aux_layers": AUX, "draft_vocab": DRAFT_VOCAB,
                          **config})
    return perturbed(Eagle3Head(cfg, target), scale=0.02).eval()


def save_heads(folder: Path, heads, target: torch.nn.Module, target_dir: Path) -> Path:
    save_drafter(folder, heads, TargetInfo.from_model(target, str(target_dir)))
    return folder


def self_distilled_data(model: torch.nn.Module, folder: Path, path: Path, conversations: int = 64,
                        new_tokens: int = 48, seed: int = 0) -> Path:
    """A ShareGPT JSONL whose answers are the tiny target's own greedy continuations of short word prompts: text its
    drafter can learn to predict (what training on a target's own outputs gives a real drafter)."""
    import json
    import random

    from transformers import AutoTokenizer

    from specheads.inference import Engine
    from specheads.inference.proposers import AutoregressiveProposer
    from specheads.target import render_chat

    tokenizer = AutoTokenizer.from_pretrained(folder)
    words = ["the", "cat", "code", "list", "write", "a", "function", "story", "about", "number", "two", "sort",
             "python", "file", "read", "data", "plot", "tree", "red", "blue", "sum", "first", "last", "why"]
    rng = random.Random(seed)
    engine = Engine(model, AutoregressiveProposer())
    rows = []
    for _ in range(conversations):
        prompt = " ".join(rng.choice(words) for _ in range(rng.randrange(4, 9)))
        answer = engine.generate(render_chat(tokenizer, [prompt]), max_new_tokens=new_tokens).output_ids
        rows.append({"conversations": [{"from": "human", "value": prompt},
                                       {"from": "gpt", "value": tokenizer.decode(answer, skip_special_tokens=True)}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path
