"""A recipe trained on the target's own answers (`regenerate:`): answered once, cached, read by later runs; through
llama-server, the answers are the fp32 target's greedy ones."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import specheads.train.regenerated_data as regenerated_data
from specheads.target import load_target
from specheads.train.__main__ import main as train_main
from specheads.train.config import load_train_config
from specheads.train.data import load_conversations
from specheads.train.regenerated_data import (
    MIN_ANSWER_TOKENS,
    LlamaServerAnswerer,
    RegenerateConfig,
    with_regenerated,
)
from tests.conftest import base_args


def home(monkeypatch, tmp_path) -> None:
    """Answers cached in a temporary folder (the rest of the cache, llama.cpp's build among it, stays shared)."""
    monkeypatch.setattr(regenerated_data, "specheads_home", lambda: tmp_path / "home")


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_recipe_trains_on_the_targets_answers_regenerated_once_and_cached(tiny_run_inputs, tmp_path, monkeypatch):
    home(monkeypatch, tmp_path)
    regen = ["regenerate.mode=alone", "regenerate.via=target", "regenerate.max_new_tokens=8",
             "regenerate.batch_size=16", "max_steps=2", "save_every=2", "measure_prompts=0"]
    assert train_main(base_args(tiny_run_inputs, tmp_path / "a", *regen)) == 0
    first = metrics(tmp_path / "a")[0]
    assert first["regenerate/answered"] == first["regenerate/kept"] == 48 and first["regenerate/cached"] == 0
    folder = Path(first["regenerate/folder"])
    assert folder.parent == tmp_path / "home" / "regenerated" and (folder / "meta.json").is_file()
    assert first["regenerate/conversations"] == 48 and first["regenerate/seconds"] > 0
    # each conversation: its first user turn and the target's greedy answer to it, nothing of the source's answers
    target, data = tiny_run_inputs
    model, tokenizer = load_target(str(target))
    source = load_conversations(str(data))[0]["messages"]
    rows = [json.loads(line)["messages"] for line in (folder / "conversations.jsonl").read_text().splitlines()]
    assert [m["role"] for m in rows[0]] == ["user", "assistant"] and rows[0][0] == source[0][0]
    ids = tokenizer(tokenizer.apply_chat_template(rows[0][:1], add_generation_prompt=True, tokenize=False),
                    add_special_tokens=False)["input_ids"]
    greedy = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=[2],
                            pad_token_id=2)
    assert tokenizer.decode(greedy[0, len(ids):], skip_special_tokens=True).strip() == rows[0][1]["content"]
    assert rows[0][1]["content"] != source[0][1]["content"]
    # another seed reads the cache; mixed trains on both the source's answers and the target's
    assert train_main(base_args(tiny_run_inputs, tmp_path / "b", *regen, "seed=1")) == 0
    again = metrics(tmp_path / "b")[0]
    assert (again["regenerate/answered"], again["regenerate/cached"], again["regenerate/folder"]) == (
        0, 48, str(folder))
    assert train_main(base_args(tiny_run_inputs, tmp_path / "c", *regen, "regenerate.mode=mixed")) == 0
    assert metrics(tmp_path / "c")[0]["regenerate/conversations"] == 96


def test_prompts_leaving_no_room_for_an_answer_are_not_asked_and_bad_settings_are_named(tiny_run_inputs, tmp_path,
                                                                                          monkeypatch):
    home(monkeypatch, tmp_path)
    target, data = tiny_run_inputs
    model, tokenizer = load_target(str(target))
    conversations = load_conversations(str(data))[0]
    # a rendered first prompt here: <s> + 6 words + </s> + <s>, 9 tokens
    four = conversations.select(range(4))
    for max_length, kept in ((9 + MIN_ANSWER_TOKENS, 4), (9 + MIN_ANSWER_TOKENS - 1, 0)):
        cfg = RegenerateConfig(mode="mixed", via="target", max_new_tokens=4)
        done = with_regenerated(four, cfg, target=str(target), source=str(data), slice_={"n": 4}, model=model,
                                tokenizer=tokenizer, max_length=max_length)
        assert done.report.kept == kept and len(done.conversations) == 4 + kept  # mixed: the source's kept
    with pytest.raises(ValueError, match=r"regenerate.mode=alone kept no conversation: of 4, 0 had a prompt leaving "
                                         r"16 tokens of data.max_length=24 for an answer"):
        with_regenerated(four, RegenerateConfig(mode="alone", via="target", max_new_tokens=4), target=str(target),
                         source=str(data), slice_={"n": 4}, model=model, tokenizer=tokenizer, max_length=24)
    # nothing left to ask (a resumed regeneration): llama-server is not even looked for
    assert list(LlamaServerAnswerer("/no/such/target", slots=2, max_new_tokens=4, ctx_size=64).answer([])) == []
    with pytest.raises(ValueError, match="regenerate.mode must be one of none, alone, mixed"):
        load_train_config(None, ["recipe=eagle", "regenerate.mode=both"])
    with pytest.raises(ValueError, match="regenerate.via must be llamacpp, target or a server's http"):
        load_train_config(None, ["recipe=eagle", "regenerate.via=vllm"])


@pytest.mark.slow
def test_llamacpp_answers_as_the_fp32_target_does(tmp_path, monkeypatch):
    """The default via: llama-server on the default target's F32 GGUF answers three ShareGPT conversations as the
    fp32 HF target does greedily (token for token, or parting first at a near-tie of the fp32 logits)."""
    from specheads.inference.bench.divergence import fp32_margin

    home(monkeypatch, tmp_path)
    model, tokenizer = load_target("default", dtype="float32")
    conversations = load_conversations("sharegpt", max_conversations=3, skip_conversations=4000)[0]
    answers = {}
    for via in ("llamacpp", "target"):
        cfg = RegenerateConfig(mode="alone", via=via, max_new_tokens=24, slots=3)
        done = with_regenerated(conversations, cfg, target="default", source="sharegpt", slice_={"test": 3},
                                model=model, tokenizer=tokenizer, max_length=512)
        assert done.report.answered == 3
        answers[via] = [m[-1]["content"] for m in done.conversations["messages"]]
    for rows, theirs, ours in zip(conversations["messages"], answers["llamacpp"], answers["target"]):
        if theirs == ours:
            continue
        prompt = tokenizer(tokenizer.apply_chat_template(rows[:1], add_generation_prompt=True, tokenize=False),
                           add_special_tokens=False)["input_ids"]
        a, b = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (ours, theirs))
        first = next(i for i, (x, y) in enumerate(zip(a + [-1], b + [-2])) if x != y)
        margin = fp32_margin(model, prompt, a, b, first)
        assert margin is not None and margin < 1e-3, (first, margin, ours, theirs)
