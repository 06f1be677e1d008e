"""`specheads generate` / `bench` end to end on a tiny saved target, and its one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from specheads.inference.cli import COMMANDS, main
from tests.cli_help import help_without_torch

QUESTIONS = [
    {"question_id": 1, "category": "writing", "turns": ["w5 w6 w7 w8 w5 w6", "w9 w10"]},
    {"question_id": 2, "category": "coding", "turns": ["w20 w21 w22 w20 w21", "w11"]},
]


@pytest.fixture
def questions_file(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    return path


def run_cli(args, capsys):
    code = main(args)
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("method,extra", [("ar", []), ("ngram", []), ("draft", ["--draft", "early-exit:2"])])
def test_generate_questions_writes_jsonl(tiny_model_dir, questions_file, tmp_path, capsys, method, extra):
    out_path = tmp_path / "out.jsonl"
    code, _, err = run_cli(["generate", "--target", str(tiny_model_dir), "--method", method, *extra,
                            "--questions", str(questions_file), "--max-new-tokens", "12", "--output", str(out_path)],
                           capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out_path.read_text().splitlines()]
    assert [r["question_id"] for r in rows] == [1, 2]
    for r in rows:
        assert set(r) == {"question_id", "sample", "output_ids", "text", "stats"} and r["sample"] == 0
        assert {"new_tokens", "steps", "drafted", "accepted", "tau", "accept_per_position", "wall_s",
                "tokens_per_s", "ttft_s"} <= set(r["stats"])
        assert r["stats"]["new_tokens"] == len(r["output_ids"]) > 0


def test_same_greedy_output_for_every_method(tiny_model_dir, questions_file, tmp_path, capsys):
    outputs = {}
    for method, extra in [("ar", []), ("ngram", []), ("suffix", []), ("draft", ["--draft", "early-exit:1"])]:
        out_path = tmp_path / f"{method}.jsonl"
        assert main(["generate", "--target", str(tiny_model_dir), "--method", method, *extra, "--questions",
                     str(questions_file), "--turn", "2", "--max-new-tokens", "10", "--output", str(out_path)]) == 0
        outputs[method] = [json.loads(line)["output_ids"] for line in out_path.read_text().splitlines()]
    assert outputs["ar"] == outputs["ngram"] == outputs["suffix"] == outputs["draft"]


def test_prompt_streams_text_and_prints_stats(tiny_model_dir, capsys):
    code, out, err = run_cli(["generate", "--target", str(tiny_model_dir), "--prompt", "w5 w6 w7",
                              "--max-new-tokens", "8", "--temperature", "0.8", "--seed", "1"], capsys)
    assert code == 0
    assert out.strip().startswith("w")
    stats = json.loads(err.strip().splitlines()[-1])
    assert stats["new_tokens"] >= 1


@pytest.mark.parametrize("args,message", [
    (["--method", "medusa9"], "unknown method 'medusa9'"),
    (["--temperature", "-1"], "temperature must be >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--top-p", "1.5"], "top_p must be in (0, 1]"),
    (["--device", "tpu"], "unknown device 'tpu'"),
    (["--method", "draft"], "needs --draft"),
    (["--method", "draft", "--draft", "early-exit:x"], "early-exit:8"),
    (["--method", "eagle", "--heads", "runs/none", "--lookup", "-1"], "--lookup must be >= 0"),
    (["--method", "ngram", "--lookup", "2"], "--lookup does not apply to --method ngram"),
    (["--method", "eagle", "--heads", "./runs/nowhere"], "heads folder ./runs/nowhere does not exist"),
    (["--num-samples", "3"], "--num-samples N > 1 needs --temperature > 0"),
    (["--num-samples", "0"], "--num-samples must be >= 1"),
])
def test_bad_arguments_give_one_clear_line(tiny_model_dir, capsys, monkeypatch, args, message):
    import specheads.target

    def no_loading(*a, **k):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr(specheads.target, "load_target", no_loading)
    code, _, err = run_cli(["generate", "--target", str(tiny_model_dir), "--prompt", "w5", "--max-new-tokens", "4",
                            *args], capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert message in lines[-1] and lines[-1].startswith("specheads generate: error:")


def test_bad_questions_file_names_the_line(tiny_model_dir, tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps(QUESTIONS[0]) + "\n{not json\n")
    code, _, err = run_cli(["generate", "--target", str(tiny_model_dir), "--questions", str(bad),
                            "--max-new-tokens", "4"], capsys)
    assert code == 2 and "bad.jsonl:2" in err
    code, _, err = run_cli(["generate", "--target", str(tiny_model_dir), "--questions", str(tmp_path / "none.jsonl"),
                            "--max-new-tokens", "4"], capsys)
    assert code == 2 and "does not exist" in err


def test_draft_with_another_vocabulary_is_refused(tiny_model_dir, tmp_path, capsys):
    from tests.conftest import tiny_model, tiny_tokenizer

    other = tmp_path / "other-vocab"
    tiny_model("llama", vocab=80).save_pretrained(other)
    tiny_tokenizer(80).save_pretrained(other)
    code, _, err = run_cli(["generate", "--target", str(tiny_model_dir), "--method", "draft", "--draft", str(other),
                            "--prompt", "w5", "--max-new-tokens", "4"], capsys)
    assert code == 2 and "vocabulary has 80 tokens but the target's has 96" in err


def test_prompt_longer_than_context_is_an_error_not_a_truncation(tiny_model_dir, capsys):
    long_prompt = " ".join(["w5"] * 300)  # tiny target holds 256 positions
    code, _, err = run_cli(["generate", "--target", str(tiny_model_dir), "--prompt", long_prompt,
                            "--max-new-tokens", "4"], capsys)
    assert code == 2 and "context holds 256" in err


def test_bench_compares_methods_in_one_run(tiny_model_dir, questions_file, tmp_path, capsys):
    out_dir = tmp_path / "bench"
    code, out, err = run_cli(["bench", "--target", str(tiny_model_dir), "--methods", "ar,hf,ngram,draft:early-exit:2",
                              "--questions", str(questions_file), "--max-new-tokens", "10", "--warmup", "0",
                              "--output", str(out_dir)], capsys)
    assert code == 0, err
    assert "| ar |" in out and "| hf |" in out and "| draft:early-exit:2 |" in out
    assert "2/2" in out  # every greedy method reproduced ar on both questions
    assert "mismatch" not in err
    rows = [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 2 * 4
    summary = json.loads((out_dir / "summary.json").read_text())
    ngram = next(s for s in summary if s["method"] == "ngram")
    taus = [r["stats"]["tau"] for r in rows if r["method"] == "ngram"]
    assert ngram["tau"] == pytest.approx(sum(taus) / len(taus), abs=1e-3)


STRUCTURED = Path(__file__).resolve().parents[3] / "data" / "structured.jsonl"


def test_the_structured_question_set_is_balanced():
    from specheads.questions import load_questions

    questions = load_questions(STRUCTURED)
    assert len({q.question_id for q in questions}) == len(questions) == 12
    assert {c: sum(q.category == c for q in questions) for c in ("json", "code", "table")} == \
        {"json": 4, "code": 4, "table": 4}


def test_bench_diagnose_writes_where_drafts_were_rejected(tiny_model_dir, tmp_path, capsys):
    out_dir = tmp_path / "bench"
    code, out, err = run_cli(["bench", "--target", str(tiny_model_dir), "--methods", "ar,ngram,draft:early-exit:2",
                              "--questions", str(STRUCTURED), "--per-category", "1", "--max-new-tokens", "16",
                              "--warmup", "1", "--diagnose", "--output", str(out_dir)], capsys)
    assert code == 0, err
    assert ("## Where drafts are rejected" in out
            and "## Where drafts are rejected" in (out_dir / "summary.md").read_text())
    diagnosis = json.loads((out_dir / "diagnosis.json").read_text())
    assert set(diagnosis) == {"ar", "ngram", "draft:early-exit:2"}
    rows = [json.loads(line) for line in (out_dir / "results.jsonl").read_text().splitlines()]
    for method, d in diagnosis.items():
        drafting = sum(r["stats"]["draft_steps"] for r in rows if r["method"] == method)  # the warm-up not counted
        assert d["steps"] == drafting == sum(row["steps"] for row in d["rows"]), method
        assert sum(d["by_position"].values()) == d["steps"]
    assert diagnosis["ar"]["steps"] == 0 and diagnosis["draft:early-exit:2"]["steps"] > 0
    categories = {row["category"] for row in diagnosis["draft:early-exit:2"]["rows"]}
    assert categories <= {"json", "code", "table"} and categories
    assert (out_dir / "diagnosis.png").stat().st_size > 0


def test_console_script_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "specheads.inference.cli", "generate", "--prompt", "x",
                           "--max-new-tokens", "4", "--method", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown method 'nope'" in proc.stderr


def test_specheads_train_forwards_to_the_recipe():
    proc = subprocess.run([sys.executable, "-m", "specheads.inference.cli", "train", "max_step=3"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "did you mean 'max_steps'" in proc.stderr


CLI_DIR = Path(__file__).resolve().parents[3] / "inference" / "cli"


@pytest.mark.parametrize("command", [None, *(name for name in COMMANDS if name != "train")])
def test_every_help_answers_without_importing_torch(command):
    done = help_without_torch(sys.executable, ["--help"] if command is None else [command, "--help"])
    assert done["code"] == 0 and not done["torch"] and not done["transformers"], done
    if command is None:
        for name, cmd in COMMANDS.items():
            assert name in done["help"] and cmd.HELP[:40] in " ".join(done["help"].split())
    else:
        assert done["help"].startswith(f"usage: specheads {command}"), done["help"][:200]


TRAIN_HELP = """
import contextlib, io, json, sys
from specheads.train.__main__ import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    code = main(["--help"])
print(json.dumps({"code": code, "help": out.getvalue(), "torch": "torch" in sys.modules}))
"""


def test_train_help_answers_without_importing_torch_and_recipes_are_listed_on_request():
    proc = subprocess.run([sys.executable, "-c", TRAIN_HELP], capture_output=True, text=True)
    done = json.loads(proc.stdout.strip().splitlines()[-1])
    assert done["code"] == 0 and not done["torch"] and "--recipes" in done["help"], done
    from specheads.train.objective import OBJECTIVES

    listed = subprocess.run([sys.executable, "-m", "specheads.train", "--recipes"], capture_output=True, text=True)
    assert listed.returncode == 0, listed.stderr
    assert [line.split(":")[0] for line in listed.stdout.splitlines()] == sorted(OBJECTIVES.names())


def _flags_declared(path: Path) -> list[str]:
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "add_argument":
            found += [a.value for a in node.args if isinstance(a, ast.Constant) and str(a.value).startswith("-")]
    return found


def test_every_flag_is_declared_in_one_place():
    from collections import Counter

    files = sorted(CLI_DIR.glob("*.py"))
    assert {f.stem for f in files} >= {"__init__", "args", "generate", "bench", "serve", "calibrate", "loadtest",
                                       "export", "train"}
    sites = Counter(flag for f in files for flag in _flags_declared(f))
    assert {"--device", "--temperature", "--questions", "--per-category", "--target", "--output"} <= set(sites)
    assert [flag for flag, n in sites.items() if n > 1] == []


def test_main_builds_the_same_arguments_as_the_full_parser():
    import argparse

    from specheads.inference.cli import COMMANDS, _parser, build_parser

    def subcommands(parser):
        (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        return sub.choices

    full = subcommands(build_parser())
    assert list(full) == list(COMMANDS)
    for name in COMMANDS:
        lazy = subcommands(_parser([name]))
        assert [(a.option_strings, a.dest, a.default, a.help) for a in lazy[name]._actions] == \
            [(a.option_strings, a.dest, a.default, a.help) for a in full[name]._actions], name
        others = [n for n in COMMANDS if n != name and n != "train"]
        assert all(len(lazy[n]._actions) == 1 for n in others)  # --help only: not built
    assert {"--device", "--dtype", "--weight-layout", "--fp32-head", "--adapter", "--temperature", "--seed"} <= \
        {s for a in full["bench"]._actions for s in a.option_strings}


def test_train_after_another_argument_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["-v", "train"])
    assert stop.value.code == 2 and "put train first" in capsys.readouterr().err


def test_inference_commands_make_openmp_threads_sleep_unless_the_user_chose(monkeypatch, capsys):
    import os

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "PASSIVE"
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    assert os.environ["OMP_WAIT_POLICY"] == "ACTIVE"


def test_commands_that_run_llamacpp_here_keep_openmps_own_wait(monkeypatch):
    # llama.cpp's kernels meet at an OpenMP barrier after every operation: sleeping threads would slow every step
    import os

    for argv in (["generate", "--backend", "llamacpp", "--help"], ["bench", "--methods", "ngram+backend=llamacpp",
                                                                     "--help"]):
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
        with pytest.raises(SystemExit):
            main(argv)
        assert "OMP_WAIT_POLICY" not in os.environ, argv


@pytest.mark.parametrize("command,args,message", [
    ("generate", ["--gguf", "q4_1"], "--gguf names the target's GGUF for --backend llamacpp"),
    ("generate", ["--backend", "llamacpp", "--step", "hf"], "--step and --compile choose our PyTorch forward"),
    ("generate", ["--backend", "llamacpp", "--gguf", "q5"], "--gguf 'q5' is neither a precision"),
])
def test_bad_backend_arguments_give_one_clear_line(tiny_model_dir, capsys, command, args, message):
    code, _, err = run_cli([command, "--target", str(tiny_model_dir), "--prompt", "w5", "--max-new-tokens", "4",
                            *args], capsys)
    assert code == 2 and message in err.strip().splitlines()[-1], err
