"""`specheads bench` on a tiny saved target: every training-free method, the exactness check, per-category
rows, plots, two turns, measured τ for training, W&B offline, Ctrl-C, and one-line errors."""

from __future__ import annotations

import json
import logging
import re
import statistics

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import AutoConfig

import specheads.inference.bench.runner as bench
import specheads.inference.engine.engine as engine_mod
import specheads.target
from specheads.draft_models import vocab_size
from specheads.gemm_layout import PlannedLinear, packing_available, set_linear_layout
from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.heads.medusa import MedusaConfig, MedusaHeads
from specheads.inference.bench.method_spec import parse_methods
from specheads.inference.bench.runner import Record, build_runners, measure, run_bench, summarize
from specheads.inference.cli import main
from specheads.inference.engine.engine import Engine
from specheads.inference.engine.sampling import SamplingParams
from specheads.inference.engine.stats import GenerationStats
from specheads.inference.engine.verifier import VerifyResult
from specheads.inference.methods import METHODS
from specheads.inference.proposers.draft_model import DraftConfig, DraftModelProposer
from specheads.questions import Question
from specheads.target import render_chat
from specheads.token_classes import TOKEN_CLASSES
from tests.conftest import repetitive_prompt, tiny_model, tiny_tokenizer

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6", "w9 w10"]},
    {"question_id": 2, "category": "coding", "turns": ["w20 w21 w22 w20 w21", "w11"]},
    {"question_id": "q3", "category": "coding", "turns": ["w30 w31 w32 w30 w31 w30", "w12 w13"]},
]
PLOTS = ("speedup_by_category.png", "tau_histogram.png", "accept_per_position.png")


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


@pytest.fixture
def accept_first_draft(monkeypatch):
    """A broken verifier: where the target rejects every child of the root, it keeps the first draft token anyway."""
    real = engine_mod.verify

    def broken(tree, target_logits, sampling, generator=None):
        res = real(tree, target_logits, sampling, generator)
        if tree.size > 1 and res.num_accepted == 0:
            assert int(tree.parents[1]) == 0
            return VerifyResult(path=torch.tensor([0, 1]),
                                tokens=torch.stack([tree.tokens[1], target_logits[1].argmax().to(tree.tokens.device)]))
        return res

    monkeypatch.setattr(engine_mod, "verify", broken)


def run_cli(args, capsys):
    code = main(["bench", *args])
    out, err = capsys.readouterr()
    return code, out, err


def read_rows(out_dir):
    return [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]


def test_training_free_methods_run_and_report(tiny_model_dir, questions_file, tmp_path, capsys):
    methods = ["ar", "hf", "hf-pld", "ngram", "draft:early-exit:1", f"draft:{tiny_model_dir}",
               f"hf-assisted:{tiny_model_dir}"]
    out_dir = tmp_path / "bench"
    code, out, err = run_cli(["--target", str(tiny_model_dir), "--methods", ",".join(methods), "--questions",
                              str(questions_file), "--turns", "2", "--max-new-tokens", "10", "--warmup", "1",
                              "--output", str(out_dir)], capsys)
    assert code == 0, err
    rows = read_rows(out_dir)
    assert {(r["question_id"], r["turn"], r["method"]) for r in rows} == {
        (q["question_id"], t, m) for q in QUESTIONS for t in (1, 2) for m in methods}
    assert len(rows) == 3 * 2 * len(methods)
    # Greedy: every method, HF baselines included, reproduces ar token for token.
    assert all(r["matches_ar"] is True and r["first_mismatch"] is None for r in rows)
    assert "mismatch" not in err

    summary = json.loads((out_dir / "summary.json").read_text())
    overall = {s["method"]: s for s in summary if s["category"] == "all"}
    assert list(overall) == methods and summary[: len(methods)] == list(overall.values())
    for m, s in overall.items():
        mine = [r for r in rows if r["method"] == m]
        assert s["generations"] == 6 and s["exact_matches"] == "6/6"
        if m.startswith("hf"):
            assert s["tau"] is None and s["acceptance_rate"] is None and s["accept_per_position"] is None
            assert all(r["stats"]["tau"] is None for r in mine)
            assert 0 < s["ttft_s"] < max(r["stats"]["wall_s"] for r in mine)  # measured by a streamer
            assert s["draft_ms_per_step"] is None and all(r["stats"]["draft_s"] is None for r in mine)
        else:
            assert s["tau"] == pytest.approx(statistics.mean(r["stats"]["tau"] for r in mine), abs=1e-3)
            # Time in the proposer per target forward, within each generation's wall time.
            assert all(0 <= r["stats"]["draft_s"] < r["stats"]["wall_s"] for r in mine)
            steps = sum(r["stats"]["steps"] for r in mine)
            assert s["draft_ms_per_step"] == pytest.approx(1000 * sum(r["stats"]["draft_s"] for r in mine) / steps,
                                                           rel=1e-2, abs=1e-3)
        ar_tps = {(r["question_id"], r["turn"]): r["stats"]["tokens_per_s"] for r in rows if r["method"] == "ar"}
        ratios = [r["stats"]["tokens_per_s"] / ar_tps[r["question_id"], r["turn"]] for r in mine]
        assert s["speedup_vs_ar"] == pytest.approx(statistics.median(ratios), rel=1e-2)
    assert overall["ar"]["tau"] == 1.0 and overall["ar"]["speedup_vs_ar"] == 1.0
    # The target drafting for itself: every draft token accepted, several tokens per forward.
    self_draft = overall[f"draft:{tiny_model_dir}"]
    assert self_draft["acceptance_rate"] == 1.0 and self_draft["tau"] > 2 and self_draft["accept_per_position"][0] > 0.3
    assert self_draft["draft_ms_per_step"] > overall["ar"]["draft_ms_per_step"]  # four draft forwards vs none

    per_cat = {(s["category"], s["method"]): s for s in summary if s["category"] != "all"}
    assert set(per_cat) == {(c, m) for c in ("writing", "coding") for m in methods}
    assert all(per_cat["writing", m]["generations"] == 2 and per_cat["coding", m]["generations"] == 4 for m in methods)
    md = (out_dir / "summary.md").read_text()
    assert "## Overall" in md and "## Per category" in md and "| coding | ngram |" in md
    assert "| hf | " in out and "| writing | ar |" in out
    for name in PLOTS:
        data = (out_dir / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5000, name
    config = json.loads((out_dir / "config.json").read_text())
    assert config["turns"] == 2
    # where it ran: fp32 on CPU multiplies on measured kernels, the lean forward's fused gate/up product among them
    machine, c = config["machine"], AutoConfig.from_pretrained(tiny_model_dir)
    assert machine["weight_layout"] == "measured" and machine["threads"] == torch.get_num_threads()
    assert f"{2 * c.intermediate_size}x{c.hidden_size}" in {line.split(":")[0] for line in machine["kernels"]}
    assert "## Machine" in md and "products by measured kernel" in err
    cost = machine["verify_cost"]  # ngram's node budget read this machine's curve: the run says which
    assert cost["nodes"][0] == 1 and cost["relative"][0] == 1.0 and cost["one_step_ms"] > 0 and cost["measured"]
    assert "Verify cost the node budget read" in md


def test_hf_static_parses_and_takes_no_argument():
    spec = parse_methods("ar,hf-static")[1]
    assert (spec.name, spec.method, spec.arg, spec.options) == ("hf-static", "hf-static", None, None)
    for bad in ("hf-static:x", "hf-static+lookup=0"):
        with pytest.raises(ValueError, match=re.escape(f"method hf-static takes no argument, got {bad!r}; "
                                                       "write hf-static")):
            parse_methods(f"ar,{bad}")


def test_hf_static_compiles_once_and_decodes_as_plain_generate(tiny_model_dir, questions_file, tmp_path, capsys,
                                                               caplog):
    """Static cache + torch.compile on CPU: the warm-up compiles the decode step once, the six prompts (three
    questions, two turns, of several lengths) reuse that graph, and every answer equals plain `generate`'s."""
    caplog.set_level(logging.INFO, logger=bench.__name__)
    torch._dynamo.reset()  # a test before this one in the same process may have compiled the same step
    graphs = counters["stats"]["unique_graphs"]
    out_dir = tmp_path / "bench"
    code, out, err = run_cli(["--target", str(tiny_model_dir), "--methods", "ar,hf,hf-static", "--questions",
                              str(questions_file), "--turns", "2", "--max-new-tokens", "10", "--warmup", "1",
                              "--output", str(out_dir), "--no-plots"], capsys)
    assert code == 0, err
    assert counters["stats"]["unique_graphs"] - graphs == 1  # compiled (on CPU), and only once
    messages = [r.getMessage() for r in caplog.records if r.name == bench.__name__]
    assert len(messages) == 1 and re.fullmatch(r"hf-static: the first generate took \d+\.\d s, compiling the decode "
                                                r"step for a static cache of 256 positions", messages[0]), messages

    rows = read_rows(out_dir)
    outputs = {(r["question_id"], r["turn"], r["method"]): r for r in rows}
    assert len({r["prompt_tokens"] for r in rows if r["method"] == "hf-static"}) >= 3  # prompts of several lengths
    for q in QUESTIONS:
        for turn in (1, 2):
            static, plain = outputs[q["question_id"], turn, "hf-static"], outputs[q["question_id"], turn, "hf"]
            assert static["output_ids"] == plain["output_ids"] and len(static["output_ids"]) > 0
            assert static["matches_ar"] is True and static["stats"]["tau"] is None
    overall = {s["method"]: s for s in json.loads((out_dir / "summary.json").read_text()) if s["category"] == "all"}
    static = overall["hf-static"]
    assert static["exact_matches"] == "6/6" and static["tau"] is None and static["acceptance_rate"] is None
    assert static["speedup_vs_ar"] > 0 and static["speedup_vs_hf"] > 0 and static["ttft_s"] > 0
    assert "| hf-static | " in out


def test_summary_aggregates_by_the_glossary():
    def rec(qid, cat, method, tps, steps=0, accepted_at_least=(), drafted=0, tau=True):
        accepted = sum(accepted_at_least)  # a step that accepted k tokens counts in the first k entries
        stats = GenerationStats(new_tokens=int(tps), steps=steps, drafted=drafted, accepted=accepted,
                                accepted_at_least=list(accepted_at_least), wall_s=1.0, ttft_s=0.1 if tau else 0.0)
        return Record(qid, cat, 1, method, [1], [5] * int(tps), stats, measures_tau=tau)

    records = [rec(1, "a", "ar", 10, steps=10), rec(1, "a", "x", 30, steps=10, accepted_at_least=[8, 4], drafted=20),
               rec(2, "b", "ar", 20, steps=20), rec(2, "b", "x", 20, steps=5, accepted_at_least=[5, 5, 5], drafted=15),
               rec(1, "a", "hf", 10, tau=False), rec(2, "b", "hf", 40, tau=False)]
    overall = {s.method: s for s in summarize(records, greedy=False)}
    x = overall["x"]
    assert x.tau == pytest.approx(statistics.mean([(12 + 10) / 10, (15 + 5) / 5]))  # per-generation mean
    assert x.acceptance_rate == pytest.approx(27 / 35)
    assert x.accept_per_position == pytest.approx([13 / 15, 9 / 15, 5 / 15])  # pooled over all steps
    assert x.speedup_vs_ar == pytest.approx(statistics.median([3.0, 1.0]))
    assert x.speedup_vs_hf == pytest.approx(statistics.median([3.0, 0.5]))
    assert x.tokens_per_s == pytest.approx(25.0) and x.ttft_s == pytest.approx(0.1)
    assert overall["hf"].tau is None and overall["hf"].ttft_s is None and overall["ar"].acceptance_rate is None
    cats = {(s.category, s.method): s for s in summarize(records, greedy=False, by_category=True)}
    assert set(cats) == {(c, m) for c in "ab" for m in ("ar", "x", "hf")}
    assert cats["a", "x"].tau == pytest.approx(2.2) and cats["a", "x"].speedup_vs_ar == pytest.approx(3.0)


def test_greedy_mismatch_is_reported_with_its_first_position(tiny_model_dir, questions_file, tmp_path, capsys,
                                                            accept_first_draft):
    out_dir = tmp_path / "bench"
    code, out, err = run_cli(["--target", str(tiny_model_dir), "--methods", "ar,draft:early-exit:1", "--questions",
                              str(questions_file), "--max-new-tokens", "16", "--warmup", "0", "--output", str(out_dir),
                              "--no-plots"], capsys)
    assert code == 0, err
    assert (out_dir / "summary.md").is_file() and not list(out_dir.glob("*.png"))  # --no-plots: tables only
    rows = read_rows(out_dir)
    ar = {r["question_id"]: r["output_ids"] for r in rows if r["method"] == "ar"}
    drafted = [r for r in rows if r["method"] == "draft:early-exit:1"]
    assert all(r["matches_ar"] for r in rows if r["method"] == "ar")
    wrong = [r for r in drafted if not r["matches_ar"]]
    assert wrong, "the broken verifier went unnoticed"
    for r in drafted:
        expected = next((i for i, (a, b) in enumerate(zip(r["output_ids"], ar[r["question_id"]])) if a != b), None)
        assert r["first_mismatch"] == expected
    for r in wrong:
        assert f"question {r['question_id']} turn 1 differs from ar at output token {r['first_mismatch']}" in err
        both_go_on = r["first_mismatch"] < min(len(r["output_ids"]), len(ar[r["question_id"]]))
        assert (r["margin_fp32"] is not None and r["margin_fp32"] >= 0) == both_go_on  # fp32 run: its own model
    assert "## Greedy mismatches against ar" in (out_dir / "summary.md").read_text()
    assert "the largest fp32 logit margin between the two tokens" in (out_dir / "summary.md").read_text()
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary[1]["exact_matches"] == f"{len(drafted) - len(wrong)}/{len(drafted)}"


def test_two_turns_keep_each_methods_own_history(accept_first_draft):
    target, tok = tiny_model("llama"), tiny_tokenizer()
    runners = build_runners(target, parse_methods("ar,draft:early-exit:1,hf"), load_draft=None)
    questions = [Question(q["question_id"], q["category"], tuple(q["turns"])) for q in QUESTIONS]
    records = list(run_bench(runners, tok, questions, max_new_tokens=12, sampling=SamplingParams(),
                             stop_token_ids=[2], turns=2, warmup=0))
    assert len(records) == 3 * 3 * 2
    got = {(r.question_id, r.method, r.turn): r for r in records}
    second_prompts = {}
    for q in questions:
        for m in runners:
            first, second = got[q.question_id, m, 1], got[q.question_id, m, 2]
            assert first.prompt_ids == render_chat(tok, q.turns[:1])
            own_answer = tok.decode(first.output_ids, skip_special_tokens=True)
            assert second.prompt_ids == render_chat(tok, q.turns, [own_answer])
            words = [t for t in first.output_ids if t not in tok.all_special_ids]
            assert any(second.prompt_ids[i : i + len(words)] == words for i in range(len(second.prompt_ids)))
            second_prompts[q.question_id, m] = second.prompt_ids
    # The broken verifier makes the drafter's first answers differ, so its second-turn prompts must too.
    assert any(second_prompts[q.question_id, "draft:early-exit:1"] != second_prompts[q.question_id, "ar"]
               for q in questions)
    assert all(second_prompts[q.question_id, "hf"] == second_prompts[q.question_id, "ar"] for q in questions)


def test_measure_reports_the_engines_tau():
    target = tiny_model("llama")
    prompts = [repetitive_prompt(seed=s) for s in (1, 2, 3)]

    def proposer():
        return DraftModelProposer(target, DraftConfig(depth=3), target_vocab_size=vocab_size(target))

    summary = measure(target, proposer(), prompts, max_new_tokens=20)
    direct = [Engine(target, proposer()).generate(p, max_new_tokens=20).stats.tau for p in prompts]
    assert summary.generations == 3 and summary.new_tokens == 60
    assert summary.tau == pytest.approx(statistics.mean(direct)) and summary.tau > 2
    assert summary.acceptance_rate == 1.0 and len(summary.accept_per_position) == 3


def test_ctrl_c_reports_what_finished(tiny_model_dir, questions_file, tmp_path, capsys, monkeypatch):
    real = bench._HFGenerate.generate
    calls = []

    def interrupted_on_second(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(self, *args, **kwargs)

    monkeypatch.setattr(bench._HFGenerate, "generate", interrupted_on_second)
    out_dir = tmp_path / "bench"
    code, _, err = run_cli(["--target", str(tiny_model_dir), "--methods", "ar,hf", "--questions", str(questions_file),
                            "--max-new-tokens", "6", "--warmup", "0", "--output", str(out_dir)], capsys)
    assert code == 130 and "reporting the 3 generations that finished" in err
    overall = {s["method"]: s for s in json.loads((out_dir / "summary.json").read_text()) if s["category"] == "all"}
    assert overall["ar"]["generations"] == 2 and overall["hf"]["generations"] == 1
    assert len(read_rows(out_dir)) == 3 and json.loads((out_dir / "config.json").read_text())["interrupted"] is True
    assert all((out_dir / name).stat().st_size > 0 for name in PLOTS)


def test_wandb_offline_writes_a_run(tiny_model_dir, questions_file, tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path), "WANDB_CONSOLE": "off",
                       "WANDB_SILENT": "true"}.items():
        monkeypatch.setenv(key, value)
    code, _, err = run_cli(["--target", str(tiny_model_dir), "--methods", "ar,ngram",
                            "--questions", str(questions_file),
                            "--limit", "2", "--max-new-tokens", "6", "--warmup", "0", "--report-to", "wandb",
                            "--diagnose"], capsys)
    assert code == 0, err
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and f"W&B run: {runs[0]}" in err
    assert next(runs[0].glob("run-*.wandb")).stat().st_size > 0
    table = json.loads(next(runs[0].glob("files/media/table/bench/summary_*.table.json")).read_text())
    assert "tau" in table["columns"] and {row[1] for row in table["data"]} == {"ar", "ngram"}
    assert len(list(runs[0].glob("files/media/images/bench/plot_*.png"))) == 4  # with the diagnosis
    stopped = json.loads(next(runs[0].glob("files/media/table/bench/diagnosis_stopped_on_*.table.json")).read_text())
    assert "structural" in stopped["columns"] and {row[0] for row in stopped["data"]} == {"ar", "ngram"}
    rows = json.loads(next(runs[0].glob("files/media/table/bench/diagnosis_rows_*.table.json")).read_text())
    ngram_steps = next(row[1] for row in stopped["data"] if row[0] == "ngram")
    assert sum(row[4] for row in rows["data"] if row[0] == "ngram") == ngram_steps
    acceptance = json.loads(next(runs[0].glob("files/media/table/bench/diagnosis_acceptance_*.table.json")).read_text())
    assert (acceptance["columns"][1:] == list(TOKEN_CLASSES)
            and {row[0] for row in acceptance["data"]} == {"ar", "ngram"})


def test_heads_of_another_target_fail_as_one_line(tiny_model_dir, questions_file, tmp_path, capsys):
    other = tiny_model("llama", hidden=32)
    heads = MedusaHeads(MedusaConfig.for_target(other, num_heads=2), other.get_output_embeddings())
    save_drafter(tmp_path / "heads", heads, TargetInfo.from_model(other, "other-tiny"))
    code, _, err = run_cli(["--target", str(tiny_model_dir), "--methods", f"ar,medusa:{tmp_path / 'heads'}",
                            "--questions", str(questions_file), "--max-new-tokens", "4"], capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("specheads bench: error:") and "were trained for target other-tiny" in last


@pytest.mark.parametrize("args,message", [
    (["--limit", "0"], "--limit must be >= 1 (or omitted for all questions), got 0"),
    (["--methods", "ar,nope"], f"unknown method 'nope' in --methods; valid: {', '.join(METHODS.names())}, hf, "
                               "hf-assisted, hf-pld, hf-static"),
    (["--methods", "ar,hf-static:x"], "method hf-static takes no argument, got 'hf-static:x'; write hf-static"),
    (["--methods", "ar,hf-assisted"], "method hf-assisted needs a path: hf-assisted:PATH"),
    (["--methods", "ar,ar"], "listed twice"),
    (["--methods", "ngram:3"], "method ngram takes no argument"),
    (["--output", "{file}/out"], "output dir {file}/out is not writable"),
    (["--questions", "{bad}"], "bad.jsonl:2: not valid JSON"),
])
def test_bad_input_fails_before_loading_a_model(tiny_model_dir, questions_file, tmp_path, capsys, monkeypatch,
                                                 args, message):
    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    monkeypatch.setattr(specheads.target, "load_target", no_loading)
    (tmp_path / "file").write_text("x")
    (tmp_path / "bad.jsonl").write_text(json.dumps(QUESTIONS[0]) + "\n{oops\n")
    subs = {"file": tmp_path / "file", "bad": tmp_path / "bad.jsonl"}
    args = [a.format(**subs) for a in args]
    base = {"--target": str(tiny_model_dir), "--questions": str(questions_file), "--max-new-tokens": "4"}
    base.update(dict(zip(args[::2], args[1::2])))
    code, _, err = run_cli([x for kv in base.items() for x in kv], capsys)
    assert code == 2
    last = err.strip().splitlines()[-1]
    assert last.startswith("specheads bench: error:") and message.format(**subs) in last


@pytest.mark.usefixtures("heads_folders")
def test_every_registered_heads_method_is_a_bench_method():
    for name, method in METHODS.items():
        if method.arg == "heads":
            spec = parse_methods(f"ar,{name}:runs/x/final")[1]
            assert (spec.method, spec.arg) == (name, "runs/x/final")
    with pytest.raises(ValueError, match=r"unknown method 'eagle4' in --methods; valid: ar"):
        parse_methods("ar,eagle4:runs/x/final")


@pytest.fixture
def heads_folders(tmp_path, monkeypatch):
    """Heads folders that exist, relative to the working directory (options check them before any model loads)."""
    monkeypatch.chdir(tmp_path)
    for folder in ("runs/a@b/final", "runs/m/final", "runs/x/final"):
        (tmp_path / folder).mkdir(parents=True)


@pytest.mark.usefixtures("heads_folders")
def test_heads_take_a_named_tree_after_an_at_sign():
    specs = parse_methods("ar,eagle:runs/a@b/final@eagle2,eagle:runs/a@b/final,medusa:runs/m/final@medusa-32")
    assert [(s.name, s.arg, s.tree) for s in specs[1:]] == [
        ("eagle:runs/a@b/final@eagle2", "runs/a@b/final", "eagle2"),
        ("eagle:runs/a@b/final", "runs/a@b/final", None),
        ("medusa:runs/m/final@medusa-32", "runs/m/final", "medusa-32"),
    ]


@pytest.mark.parametrize("spec,message", [
    ("eagle:runs/x@huge", "unknown tree 'huge'; use one of: cpu, wide, eagle2"),
    ("eagle:runs/x@", "write eagle:DIR@TREE, e.g. eagle:runs/x/final@eagle2"),
])
@pytest.mark.usefixtures("heads_folders")
def test_a_bad_tree_name_is_refused_when_parsing(spec, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_methods(spec)


def test_a_missing_heads_folder_is_refused_when_parsing(tmp_path):
    with pytest.raises(ValueError, match="heads folder .*nowhere does not exist; pass the final/ folder"):
        parse_methods(f"ar,eagle:{tmp_path / 'nowhere'}")


class _SeedRecorder:
    measures_tau = True

    def __init__(self) -> None:
        self.seeds: list[int | None] = []

    def generate(self, prompt, *, max_new_tokens, sampling, stop_token_ids):
        self.seeds.append(sampling.seed)
        return [5], GenerationStats(new_tokens=1, steps=1, wall_s=0.01)


def test_every_method_draws_with_each_questions_own_seed():
    runners = {"a": _SeedRecorder(), "b": _SeedRecorder()}
    questions = [Question(qid, "c", ("w5 w6", "w7")) for qid in (1, 2, "q3")]
    list(run_bench(runners, tiny_tokenizer(), questions, max_new_tokens=1, warmup=0, turns=2,
                   sampling=SamplingParams(temperature=1.0, seed=7), stop_token_ids=[]))
    a, b = runners["a"].seeds, runners["b"].seeds
    assert a == b  # methods compare on equal randomness
    assert len(set(a)) == 6  # 3 questions x 2 turns, each its own stream
    again = _SeedRecorder()
    list(run_bench({"a": again}, tiny_tokenizer(), questions[1:], max_new_tokens=1, warmup=0, turns=2,
                   sampling=SamplingParams(temperature=1.0, seed=7), stop_token_ids=[]))
    assert again.seeds == a[2:]  # a question's stream does not depend on the others asked


def test_the_warm_up_is_short_and_discarded_and_every_question_then_gets_the_full_budget():
    class Lengths(_SeedRecorder):
        def generate(self, prompt, *, max_new_tokens, sampling, stop_token_ids):
            self.seeds.append(max_new_tokens)
            return [5], GenerationStats(new_tokens=1, steps=1, wall_s=0.01)

    runner = Lengths()
    questions = [Question(qid, "c", ("w5 w6",)) for qid in (1, 2)]
    records = list(run_bench({"a": runner}, tiny_tokenizer(), questions, max_new_tokens=100, warmup=1,
                             sampling=SamplingParams(), stop_token_ids=[]))
    assert runner.seeds == [bench.WARMUP_NEW_TOKENS, 100, 100] and bench.WARMUP_NEW_TOKENS < 100
    assert [r.question_id for r in records] == [1, 2]


def test_a_budget_ends_the_run_between_questions_with_every_method_on_the_same_ones():
    runners = {"a": _SeedRecorder(), "b": _SeedRecorder()}
    questions = [Question(qid, "c", ("w5 w6",)) for qid in (1, 2, 3)]
    asked = []

    def more() -> bool:  # asked before the second and third questions: the budget runs out after the second
        asked.append(1)
        return len(asked) < 2

    records = list(run_bench(runners, tiny_tokenizer(), questions, max_new_tokens=1, warmup=0, more=more,
                             sampling=SamplingParams(), stop_token_ids=[]))
    assert [(r.question_id, r.method) for r in records] == [(1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert len(asked) == 2


def test_max_minutes_answers_a_balanced_prefix_and_says_so(tiny_model_dir, questions_file, tmp_path, capsys):
    out_dir = tmp_path / "bench"
    # a budget spent during the warm-up: the first question (writing) is still answered by every method, no other
    code, out, _ = run_cli(["--target", str(tiny_model_dir), "--methods", "ar,ngram", "--questions",
                            str(questions_file), "--max-new-tokens", "4", "--max-minutes", "1e-9", "--output",
                            str(out_dir), "--no-plots"], capsys)
    assert code == 0
    said = "Questions answered by every method: 1 of 3 (none begun after 1e-09 minutes)"
    assert said in out and said in (out_dir / "summary.md").read_text()
    assert [(r["question_id"], r["method"]) for r in read_rows(out_dir)] == [(1, "ar"), (1, "ngram")]
    config = json.loads((out_dir / "config.json").read_text())
    assert config["max_minutes"] == 1e-9 and config["questions_answered"] == 1 and config["num_questions"] == 3
    code, _, err = run_cli(["--target", str(tiny_model_dir), "--questions", str(questions_file), "--max-new-tokens",
                            "4", "--max-minutes", "0"], capsys)
    assert code == 2 and "--max-minutes must be > 0" in err


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_hf_static_runs_on_a_packed_target(dtype):
    # torch.compile cannot trace oneDNN's packed weights: the runner must hand it plain layers, and leave them packed
    if not packing_available(dtype):
        pytest.skip(f"oneDNN packs no {dtype} weights on this CPU")
    model = set_linear_layout(tiny_model().to(dtype), "packed")
    runner = bench._HFStaticGenerate(model)
    runner.reserve(40)
    new, stats = runner.generate(list(range(3, 20)), max_new_tokens=8, sampling=SamplingParams(), stop_token_ids=[])
    assert len(new) == 8 and stats.new_tokens == 8
    assert isinstance(model.model.layers[0].mlp.up_proj, PlannedLinear)


def test_a_method_runs_compiled_or_not_whatever_the_runs_flag():
    specs = parse_methods("ar,ar+compile=1,ngram+compile=0+width=2")
    assert [s.compile for s in specs] == [None, True, False]
    assert specs[2].options.width == 2 and specs[2].settings == (("width", "2"),)
    runners = build_runners(tiny_model("llama"), specs, load_draft=None, compile=True)
    assert [runners[s.name].engine.lean.compiled for s in specs] == [True, True, False]
    for bad, message in (("ar+compile=yes", r"\+compile= takes 1 \(on\) or 0 \(off\), got 'yes'"),
                         ("hf+compile=1", "method hf takes no argument")):
        with pytest.raises(ValueError, match=message):
            parse_methods(f"ar,{bad}")
