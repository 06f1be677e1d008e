"""Self-distillation: the target's own answers replace assistant turns; shards resume."""

from __future__ import annotations

import json

import torch

from specheads.train.data import load_conversations
from specheads.train.regenerate import TargetAnswerer, main, regenerate


def write_conversations(path, n: int = 5) -> None:
    rows = [{"conversations": [{"from": "human", "value": f"w{5 + i} w{6 + i} w7"}, {"from": "gpt", "value": "w50 w51"},
                               {"from": "human", "value": "w9 w10"}, {"from": "gpt", "value": "w60"}]}
            for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_regenerated_turns_are_the_targets_greedy_answers(tiny_model_dir, tmp_path):
    from specheads.target import load_target

    data = tmp_path / "conv.jsonl"
    write_conversations(data)
    out = tmp_path / "regen"
    assert main(["--target", str(tiny_model_dir), "--source", str(data), "--output", str(out), "--max-new-tokens", "6",
                 "--batch-size", "2", "--shard-size", "2"]) == 0
    rows = [json.loads(line) for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert (len(rows) == 5
            and sorted(p.name for p in out.glob("shard_*.jsonl")) == [f"shard_0000{k}.jsonl" for k in range(3)])
    model, tok = load_target(str(tiny_model_dir))
    first = rows[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant"]
    assert first[0]["content"] == "w5 w6 w7" and first[1]["content"] != "w50 w51"
    # The first answer is exactly what greedy decoding of the target gives for the first user turn.
    ids = tok(tok.apply_chat_template(first[:1], add_generation_prompt=True, tokenize=False),
              add_special_tokens=False)["input_ids"]
    greedy = model.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False, eos_token_id=[2], pad_token_id=2)
    assert tok.decode(greedy[0, len(ids):], skip_special_tokens=True).strip() == first[1]["content"]
    # The output is valid training data.
    ds, report = load_conversations(str(out / "conversations.jsonl"))
    assert report.kept == 5


def test_rerun_skips_finished_shards(tiny_model_dir, tmp_path):
    from specheads.target import load_target

    data = tmp_path / "conv.jsonl"
    write_conversations(data, n=4)
    model, tok = load_target(str(tiny_model_dir))
    convs = load_conversations(str(data))[0]["messages"]
    out = tmp_path / "regen"
    answerer = TargetAnswerer(model, tok, batch_size=2, max_new_tokens=4, stop_ids=[2])
    first = regenerate(convs, out, answerer, shard_size=2)
    assert (first.answered, first.resumed, first.kept) == (4, 0, 4)
    kept = (out / "shard_00000.jsonl").stat().st_mtime_ns
    whole = (out / "conversations.jsonl").read_text()
    # as if the job died in the second shard after answering its first conversation, mid-way through the next line
    lines = (out / "shard_00001.jsonl").read_text().splitlines()
    (out / "shard_00001.jsonl").unlink()
    (out / "shard_00001.partial.jsonl").write_text(json.dumps({"i": 0, "messages": json.loads(lines[0])["messages"]})
                                                   + "\n" + '{"i": 1, "mess')
    again = regenerate(convs, out, answerer, shard_size=2)
    assert (again.answered, again.resumed, again.kept) == (1, 3, 4)  # only the unfinished conversation asked again
    assert (out / "shard_00000.jsonl").stat().st_mtime_ns == kept
    assert (out / "conversations.jsonl").read_text() == whole and not list(out.glob("*.partial.jsonl"))


def test_max_turns_keeps_only_the_first_exchanges(tiny_model_dir, tmp_path):
    data = tmp_path / "conv.jsonl"
    write_conversations(data, n=3)
    out = tmp_path / "regen"
    assert main(["--target", str(tiny_model_dir), "--source", str(data), "--output", str(out), "--max-new-tokens", "4",
                 "--max-turns", "1", "--dtype", "float32"]) == 0
    rows = [json.loads(line)["messages"] for line in (out / "conversations.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and all([m["role"] for m in r] == ["user", "assistant"] for r in rows)
    assert main(["--target", str(tiny_model_dir), "--source", str(data), "--output", str(tmp_path / "x"),
                 "--max-turns", "0"]) == 2


class Counted:
    """The real answerer, its calls and the conversations each asked counted."""

    def __init__(self, answerer) -> None:
        self.answerer, self.asked = answerer, []

    def answer(self, conversations):
        self.asked.append(len(conversations))
        yield from self.answerer.answer(conversations)


def test_every_shard_is_asked_in_one_stream_and_a_shard_answered_whole_before_a_kill_is_kept(tiny_model_dir,
                                                                                              tmp_path):
    from specheads.target import load_target

    data = tmp_path / "conv.jsonl"
    write_conversations(data, n=5)
    model, tok = load_target(str(tiny_model_dir))
    convs = load_conversations(str(data))[0]["messages"]
    out = tmp_path / "regen"
    answerer = Counted(TargetAnswerer(model, tok, batch_size=4, max_new_tokens=4, stop_ids=[2]))
    first = regenerate(convs, out, answerer, shard_size=2)
    # one stream over three shards: the answerer's batches span shard boundaries, its slots never drain at one
    assert answerer.asked == [5] and (first.answered, first.kept) == (5, 5) and first.tokens > 0
    whole = (out / "conversations.jsonl").read_text()
    # killed after the second shard's last answer reached its journal, before the shard was written
    rows = [json.loads(line)["messages"] for line in (out / "shard_00001.jsonl").read_text().splitlines()]
    (out / "shard_00001.jsonl").unlink()
    (out / "shard_00001.partial.jsonl").write_text("".join(json.dumps({"i": i, "messages": m}) + "\n"
                                                           for i, m in enumerate(rows)))
    again = regenerate(convs, out, answerer, shard_size=2)
    assert answerer.asked == [5, 0] and (again.answered, again.resumed) == (0, 5)
    assert (out / "conversations.jsonl").read_text() == whole and not list(out.glob("*.partial.jsonl"))
