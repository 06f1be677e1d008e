"""Chat data: loading and normalising three formats, the streaming JSON decoder, chat-template masks, batching."""

from __future__ import annotations

import hashlib
import json
import logging
import time

import datasets
import pytest
import torch

from specheads.conversations import is_held_out, opening_prompt
from specheads.questions import load_questions
from specheads.train import data
from specheads.train.data import (
    JsonListStream,
    LoadReport,
    collate,
    load_conversations,
    pad_token_id,
    split_by_conversation,
    tokenize_conversation,
    tokenize_dataset,
)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = ["system", "user", "assistant", "nl", "think"] + [f"w{i}" for i in range(40)]


def chatml_tokenizer(template: str = CHATML):
    """A word-level tokenizer with ChatML special tokens and a chat template (no downloads)."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, **{w: i + 3 for i, w in enumerate(WORDS)}}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken("<|im_start|>", special=True), AddedToken("<|im_end|>", special=True)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, unk_token="<unk>", bos_token="<|im_start|>",
                                  eos_token="<|im_end|>")
    tok.chat_template = template
    return tok


def msgs(*pairs: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": r, "content": c} for r, c in pairs]


def masked_runs(out: dict, tok) -> list[str]:
    """Decode each contiguous run of loss tokens."""
    runs, current = [], []
    for token, m in zip(out["input_ids"], out["loss_mask"]):
        if m:
            current.append(token)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    return [tok.decode(r) for r in runs]


# ------------------------------------------------------------------------------------------- loading


def sharegpt_records() -> list[dict]:
    return [
        # role aliases, a system prompt, merged consecutive turns, an empty turn
        {"id": "a", "conversations": [
            {"from": "system", "value": "be brief"},
            {"from": "human", "value": "hi"}, {"from": "user", "value": "there"},
            {"from": "gpt", "value": ""}, {"from": "chatgpt", "value": "hello"},
            {"from": "human", "value": "q2"}, {"from": "bard", "value": "a2"}, {"from": "bing", "value": "a3"}]},
        # a leading assistant turn is dropped
        {"id": "b", "conversations": [{"from": "gpt", "value": "unprompted"}, {"from": "human", "value": "q"},
                                      {"from": "model", "value": "a"}]},
        {"id": "c", "conversations": [{"from": "human", "value": "only a question"}]},  # no assistant
        {"id": "d", "conversations": [{"from": "tool", "value": "x"}, {"from": "gpt", "value": "y"}]},  # bad role
    ]


@pytest.mark.parametrize("suffix", [".json", ".jsonl"])
def test_sharegpt_file_normalised(tmp_path, suffix):
    path = tmp_path / f"chats{suffix}"
    records = sharegpt_records()
    path.write_text(json.dumps(records) if suffix == ".json" else "\n".join(json.dumps(r) for r in records))
    ds, report = load_conversations(str(path))
    assert ds.column_names == ["messages"]
    assert report == LoadReport(read=4, kept=2, skipped_no_assistant=1, skipped_bad_role=1, truncated_file=False,
                                held_out=0)
    assert ds[0]["messages"] == msgs(("system", "be brief"), ("user", "hi\n\nthere"), ("assistant", "hello"),
                                     ("user", "q2"), ("assistant", "a2\n\na3"))
    assert ds[1]["messages"] == msgs(("user", "q"), ("assistant", "a"))


def test_openai_jsonl_and_max_conversations(tmp_path):
    path = tmp_path / "openai.jsonl"
    rows = [{"messages": msgs(("system", f"s{i}"), ("user", f"u{i}"), ("assistant", f"a{i}"))} for i in range(5)]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    ds, report = load_conversations(str(path), max_conversations=3)
    assert (report.read, report.kept) == (3, 3)
    assert [m[1]["content"] for m in ds["messages"]] == ["u0", "u1", "u2"]
    shuffled, _ = load_conversations(str(path), max_conversations=3, seed=1)
    assert sorted(m[1]["content"] for m in shuffled["messages"]) == ["u0", "u1", "u2"]
    later, report = load_conversations(str(path), max_conversations=2, skip_conversations=2)  # the next ones
    assert [m[1]["content"] for m in later["messages"]] == ["u2", "u3"] and report.kept == 2
    with pytest.raises(ValueError, match="5 passed over by skip_conversations"):
        load_conversations(str(path), skip_conversations=5)


def test_alpaca_parquet(tmp_path):
    path = tmp_path / "alpaca.parquet"
    datasets.Dataset.from_list([
        {"instruction": "translate", "input": "bonjour", "output": "hello"},
        {"instruction": "say hi", "input": "", "output": "hi"},
        {"instruction": "say nothing", "input": "", "output": ""},
    ]).to_parquet(str(path))
    ds, report = load_conversations(str(path))
    assert ds[0]["messages"] == msgs(("user", "translate\n\nbonjour"), ("assistant", "hello"))
    assert ds[1]["messages"] == msgs(("user", "say hi"), ("assistant", "hi"))
    assert (report.kept, report.skipped_no_assistant) == (2, 1)


def test_load_errors(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x", "label": 1}))
    with pytest.raises(ValueError, match=r"found: label, text.*ShareGPT.*OpenAI.*Alpaca"):
        load_conversations(str(bad))
    with pytest.raises(ValueError, match="does not exist"):
        load_conversations(str(tmp_path / "missing.json"))
    other = tmp_path / "chats.csv"
    other.write_text("a,b\n")
    with pytest.raises(ValueError, match="unsupported suffix"):
        load_conversations(str(other))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps([{"conversations": [{"from": "human", "value": "no reply"}]}]))
    with pytest.raises(ValueError, match="no usable conversations in .*after filtering"):
        load_conversations(str(empty))
    with pytest.raises(ValueError, match="max_conversations"):
        load_conversations(str(empty), max_conversations=0)


def test_stream_stops_cleanly_at_cut(tmp_path):
    records = [{"id": i, "text": f"caf\u00e9 \"quoted\" \\ {i}" * 3, "n": [1.5, True, None]} for i in range(20)]
    full = json.dumps(records, indent=1, ensure_ascii=False)
    complete = tmp_path / "complete.json"
    complete.write_text(full, encoding="utf-8")
    stream = JsonListStream(complete, chunk_chars=7)  # tiny chunks: records straddle many reads
    assert list(stream) == records and (stream.count, stream.truncated) == (20, False)
    # Cut inside a string, inside an escape, right after a comma, and between the brackets.
    for cut_at in (full.index("quoted", len(full) // 2), full.rindex("\\\\") + 1, full.rindex("},") + 2, 1):
        cut = tmp_path / "cut.json"
        cut.write_text(full[:cut_at], encoding="utf-8")
        stream = JsonListStream(cut, chunk_chars=13)
        got = list(stream)
        assert stream.truncated and got == records[: len(got)] and stream.count == len(got)
    broken = tmp_path / "broken.json"
    broken.write_text('[{"a": 1}, {"a": 2 "b": 3}, ' + json.dumps(records))
    with pytest.raises(ValueError, match="invalid JSON"):
        list(JsonListStream(broken))


def test_sharegpt_package_first_50_is_fast():
    start = time.perf_counter()
    ds, report = load_conversations("sharegpt", max_conversations=50)
    assert time.perf_counter() - start < 2.0  # stops after ~50 records, never reads the 125 MB file
    assert len(ds) == 50 and report.kept == 50 and not report.truncated_file
    for messages in ds["messages"]:
        roles = [m["role"] for m in messages if m["role"] != "system"]
        assert roles[0] == "user" and "assistant" in roles
        assert all(a != b for a, b in zip(roles, roles[1:]))
        assert all(m["content"].strip() for m in messages)


def test_the_held_out_rule_is_a_fixed_hash_of_the_stripped_opening_prompt():
    """The reservation must not drift between versions or runs: recompute it here from its definition."""
    for prompt, verdict in (("What is the capital of France? (2)", True), ("What is the capital of France?", False)):
        digest = hashlib.sha256(prompt.encode("utf-8")).hexdigest()
        assert (int(digest[:8], 16) % 32 == 0) is verdict
        assert is_held_out(prompt) is verdict and is_held_out(f"  {prompt}\n") is verdict


def test_a_local_file_keeps_the_conversations_the_bundled_source_holds_out(tmp_path):
    prompt = "What is the capital of France? (2)"
    assert is_held_out(prompt)
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": msgs(("user", prompt), ("assistant", "Paris"))}) + "\n")
    ds, report = load_conversations(str(path))
    assert (report.kept, report.held_out) == (1, 0) and opening_prompt(ds[0]["messages"]) == prompt


def test_training_on_the_bundled_source_never_reads_the_held_out_questions():
    # 3000 conversations read past the last record the question set takes (its ids are record indices).
    ds, report = load_conversations("sharegpt", max_conversations=3000)
    assert report.kept == 3000 and report.held_out > 0
    questions = load_questions("sharegpt-heldout")
    assert max(int(str(q.question_id).removeprefix("sharegpt-")) for q in questions) < report.read
    opening = {opening_prompt(messages).strip() for messages in ds["messages"]}
    assert not opening & {q.turns[0] for q in questions}


# ---------------------------------------------------------------------------------------- tokenizing


def test_mask_covers_exactly_assistant_content_and_end_token():
    tok = chatml_tokenizer()
    conv = msgs(("system", "w1"), ("user", "w2 w3"), ("assistant", "w4 w5"), ("user", "w6"), ("assistant", "w7"))
    out = tokenize_conversation(tok, conv, max_length=100)
    tokens = tok.convert_ids_to_tokens(out["input_ids"])
    assert tokens == ["<|im_start|>", "system", "w1", "<|im_end|>", "<|im_start|>", "user", "w2", "w3", "<|im_end|>",
                      "<|im_start|>", "assistant", "w4", "w5", "<|im_end|>", "<|im_start|>", "user", "w6",
                      "<|im_end|>", "<|im_start|>", "assistant", "w7", "<|im_end|>"]
    assert [t for t, m in zip(tokens, out["loss_mask"]) if m] == ["w4", "w5", "<|im_end|>", "w7", "<|im_end|>"]
    assert out["truncated"] is False
    # A trailing user turn carries no loss, so the sequence ends after the last reply.
    assert tokenize_conversation(tok, conv + msgs(("user", "w8")), 100) == out


def test_template_text_after_end_of_turn_is_not_masked():
    tok = chatml_tokenizer(CHATML.replace("<|im_end|>\n", "<|im_end|> nl "))
    out = tokenize_conversation(tok, msgs(("user", "w1"), ("assistant", "w2")), max_length=100)
    tokens = tok.convert_ids_to_tokens(out["input_ids"])
    assert tokens[-3:] == ["w2", "<|im_end|>", "nl"] and out["loss_mask"][-3:] == [1, 1, 0]


def test_prefix_mismatch_falls_back_with_one_warning(monkeypatch, caplog):
    # The generation prompt differs from how a finished reply is rendered, so prefixes do not line up.
    tok = chatml_tokenizer(CHATML.replace("<|im_start|>assistant\n{% endif %}",
                                          "<|im_start|>assistant think\n{% endif %}"))
    monkeypatch.setattr(data, "_warned_prefix_mismatch", False)
    conv = msgs(("user", "w1"), ("assistant", "w2 w3"), ("user", "w4"), ("assistant", "w5"))
    with caplog.at_level(logging.WARNING, logger=data.__name__):
        out = tokenize_conversation(tok, conv, max_length=100)
    assert sum("not a token prefix" in r.message for r in caplog.records) == 1
    tokens = tok.convert_ids_to_tokens(out["input_ids"])
    assert [t for t, m in zip(tokens, out["loss_mask"]) if m] == ["w2", "w3", "<|im_end|>", "w5", "<|im_end|>"]


def test_truncation_is_flagged():
    tok = chatml_tokenizer()
    conv = msgs(("user", "w1"), ("assistant", "w2 w3 w4"), ("user", "w5"), ("assistant", "w6"))
    full = tokenize_conversation(tok, conv, max_length=1000)
    for limit in (6, 9, len(full["input_ids"]) - 1):
        out = tokenize_conversation(tok, conv, max_length=limit)
        assert out["truncated"] and len(out["input_ids"]) == limit
        assert out["input_ids"] == full["input_ids"][:limit] and out["loss_mask"] == full["loss_mask"][:limit]
    assert not tokenize_conversation(tok, conv, max_length=len(full["input_ids"]))["truncated"]
    with pytest.raises(ValueError, match="max_length"):
        tokenize_conversation(tok, conv, max_length=0)


def test_tokenize_dataset_drops_loss_free_rows_and_splits_without_overlap():
    tok = chatml_tokenizer()
    rows = [{"messages": msgs(("user", f"w{i} w{i}"), ("assistant", f"w{i + 1}"))} for i in range(30)]
    rows.append({"messages": msgs(("user", " ".join(["w1"] * 20)), ("assistant", "w2"))})  # prompt fills max_length
    rows.append(rows[0])  # a repeated conversation must stay on one side of the split
    ds = datasets.Dataset.from_list(rows, features=data.MESSAGES_FEATURES)
    tokenized = tokenize_dataset(ds, tok, max_length=12)
    assert set(tokenized.column_names) == {"input_ids", "loss_mask", "num_tokens", "truncated"}
    assert len(tokenized) == 31 and all(any(m) for m in tokenized["loss_mask"])
    assert list(tokenized["num_tokens"]) == [len(ids) for ids in tokenized["input_ids"]]
    for split_me in (ds, tokenized):
        train, evaluation = split_by_conversation(split_me, eval_fraction=0.2, seed=0)
        assert len(train) + len(evaluation) == len(split_me) and 4 <= len(evaluation) <= 10
        key = "messages" if "messages" in split_me.column_names else "input_ids"
        seen = {json.dumps(r[key]) for r in train}
        assert not any(json.dumps(r[key]) in seen for r in evaluation)
        again = split_by_conversation(split_me, eval_fraction=0.2, seed=0)[1]
        assert list(again[key]) == list(evaluation[key])
    with pytest.raises(ValueError, match="eval_fraction"):
        split_by_conversation(ds, eval_fraction=1.0, seed=0)


def test_collate_right_pads():
    examples = [{"input_ids": [5, 6, 7], "loss_mask": [0, 1, 1]}, {"input_ids": [8], "loss_mask": [1]}]
    batch = collate(examples, pad_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert all(t.dtype == torch.long for t in batch.values())
    tok = chatml_tokenizer()
    assert pad_token_id(tok) == tok.eos_token_id  # no pad token: falls back to eos


@pytest.mark.slow
def test_real_target_mask_decodes_to_assistant_texts():
    from transformers import AutoTokenizer

    from specheads.target import resolve_target

    tok = AutoTokenizer.from_pretrained(resolve_target("default"))
    ds, _ = load_conversations("sharegpt", max_conversations=20)
    for messages in ds["messages"]:
        out = tokenize_conversation(tok, messages, max_length=1_000_000)
        replies = [m["content"] + "<|im_end|>" for m in messages if m["role"] == "assistant"]
        assert masked_runs(out, tok) == replies
