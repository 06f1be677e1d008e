"""llama.cpp's drafting settings chosen by measurement: real `llama-server`s on a tiny target converted to GGUF with
EAGLE-3 heads exported at two precisions; the choice is the fastest candidate or no drafting, cached, reported by
the bench and written into the export's README."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import specheads.llamacpp.draft_settings as ds
from specheads.formats.export import export
from specheads.llamacpp.build import llama_server
from specheads.llamacpp.convert import convert_hf_to_gguf
from specheads.llamacpp.draft_settings import DraftChoice, DraftSettings, Tried, choose
from specheads.llamacpp.server import LlamaServer
from tests.specheads.llamacpp.tiny import eagle3_heads, save_heads, smol_tiny_target

GRID = ((1, 0.0), (2, 0.5))


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("draft-settings")
    binary = llama_server()
    target = smol_tiny_target(root / "target")
    model = convert_hf_to_gguf(root / "target", root / "target.gguf", outtype="f32")
    heads = save_heads(root / "heads", eagle3_heads(target), target, root / "target")
    drafts = {p: export(heads, "gguf", root / f"draft-{p}", target=str(root / "target"), precision=p).folder
              / f"eagle3-{p}.gguf" for p in ("f32", "q8_0")}
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    return {"binary": binary, "model": model, "heads": heads, "drafts": drafts, "tokenizer": tokenizer,
            "root": root}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """Choices kept in a temporary folder (never the user's), calibration prompts from the file's start."""
    monkeypatch.setattr(ds, "llamacpp_home", lambda version=ds.VERSION: tmp_path / "llamacpp")
    monkeypatch.setattr(ds, "CALIBRATION_SKIP", 0)
    return tmp_path / "llamacpp"


def tried(n_max: int, speedup: float, p_min: float = 0.0) -> Tried:
    return Tried(DraftSettings(n_max, p_min), speedup, tau=1.5, acceptance=0.4)


def test_the_fastest_setting_is_chosen_only_where_it_beats_plain_decoding():
    settings, speedup, why = choose([tried(1, 1.10), tried(2, 1.25, 0.5), tried(4, 0.90)])
    assert settings == DraftSettings(2, 0.5) and speedup == 1.25 and "fastest of 3 settings" in why
    assert settings.server_args() == "--spec-draft-n-max 2 --spec-draft-p-min 0.5"
    settings, speedup, why = choose([tried(1, 0.97), tried(2, 1.01)])  # within MIN_GAIN of plain: not worth it
    assert settings == DraftSettings(0) and speedup == 1.0 and settings.server_args() == ""
    assert why.startswith("drafting did not pay: the best of 2 settings measured, n_max=2 p_min=0 f32, ran 1.01x")
    choice = DraftChoice(DraftSettings(2, 0.5, "q8_0"), 1.25, "why", (tried(1, 1.1),), "cpu", "t.gguf", "now")
    assert DraftChoice.from_json(json.loads(json.dumps(choice.to_json()))) == choice


def test_a_server_takes_the_probability_cut():
    server = LlamaServer(Path(__file__), draft=Path(__file__), spec_type="draft-eagle3", draft_max=2, p_min=0.75,
                         binary=Path(__file__))  # its command alone: nothing starts before `with`
    command = server.command()
    assert command[command.index("--spec-draft-p-min") + 1] == "0.75"
    assert command[command.index("--spec-draft-n-max") + 1] == "2"
    with pytest.raises(ValueError, match=r"p_min is a probability in \[0, 1\], got 1.5"):
        LlamaServer(Path(__file__), p_min=1.5)


def test_settings_are_measured_on_real_servers_chosen_and_cached(setup, cache):
    prompts = ds.calibration_prompts(setup["tokenizer"], n=2, max_tokens=96)
    assert len(prompts) == 2 and all(8 <= len(p) <= 96 for p in prompts)
    asked = []

    def calibration(n):
        asked.append(n)
        return prompts

    drafter = ds.drafter_id(setup["heads"])
    choice = ds.draft_settings(setup["model"], setup["drafts"], calibration, drafter=drafter, threads=2,
                               cache_type="f32", grid=GRID, max_new_tokens=8, rounds=1, binary=setup["binary"])
    # the grid on the F32 drafter, then its best again beside the Q8_0 drafter (the F32 one measured afresh)
    measured = [(t.settings.n_max, t.settings.p_min, t.settings.precision) for t in choice.tried]
    assert [m[2] for m in measured] == ["f32"] * len(GRID) + ["q8_0"]
    assert {m[:2] for m in measured[:-1]} == set(GRID) and measured[-1][:2] == measured[-2][:2]
    assert all(t.speedup > 0 and t.tau >= 1.0 and 0.0 <= t.acceptance <= 1.0 for t in choice.tried)
    assert (choice.settings, choice.speedup, choice.why) == choose(choice.tried)
    assert choice.target == "target.gguf" and "threads" in choice.machine
    again = ds.draft_settings(setup["model"], setup["drafts"], calibration, drafter=drafter, threads=2)
    assert again == choice and asked == [6]  # read from the cache: no prompts asked for, nothing measured
    # a quick request takes the full choice cached; measured anew, it runs its grid on the Q8_0 drafter alone
    assert ds.draft_settings(setup["model"], setup["drafts"], calibration, drafter=drafter, threads=2,
                             measurement="quick") == choice and asked == [6]
    quick = ds.draft_settings(setup["model"], setup["drafts"], calibration, drafter=drafter, threads=2,
                              cache_type="f32", measurement="quick", remeasure=True, grid=GRID[:1], max_new_tokens=8,
                              binary=setup["binary"])
    assert asked == [6, 4] and quick.measurement == "quick"
    assert [(t.settings.n_max, t.settings.p_min, t.settings.precision) for t in quick.tried] == [(*GRID[0], "q8_0")]
    assert ds.cache_path(setup["model"], drafter, 2, measurement="quick").is_file()
    with pytest.raises(ValueError, match="measurement 'slow' is not one of full, quick"):
        ds.draft_settings(setup["model"], setup["drafts"], calibration, drafter=drafter, measurement="slow")
    # the export's README names what was measured for these heads here, with the command that serves it
    done = export(setup["heads"], "gguf", setup["root"] / "readme", target=str(setup["root"] / "target"))
    readme = (done.folder / "README.md").read_text()
    assert "## Drafting settings measured for these heads" in readme and choice.why in readme
    expected = (f"-md eagle3-{choice.settings.precision}.gguf --spec-type draft-eagle3 {choice.settings.server_args()}"
                if choice.settings.n_max else "llama-server -m TARGET.gguf   # no draft")
    assert expected in readme


def test_the_bench_measures_a_drafting_row_without_settings_and_reports_the_choice(setup, cache, monkeypatch,
                                                                                    tmp_path, capsys):
    from specheads.inference.cli import main as cli_main

    monkeypatch.setitem(ds.MEASUREMENTS, "full", ds.Measurement(GRID[:1], ("f32",)))
    monkeypatch.setenv("SPECHEADS_LLAMA_SERVER", str(setup["binary"]))
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 0, "category": "c", "turns": ["Tell me about cats."]}) + "\n")
    out = tmp_path / "bench"
    rows = f"llamacpp,llamacpp+eagle3:{setup['heads']}"
    assert cli_main(["bench", "--target", str(setup["root"] / "target"), "--questions", str(questions),
                     "--max-new-tokens", "12", "--methods", rows, "--output", str(out), "--no-plots",
                     "--dtype", "float32"]) in (0, None)
    # the minutes of measurement show progress, prompt by prompt
    assert "llama.cpp drafting settings: 1 setting and plain, round 1 of 2, prompt 1 of 6" in capsys.readouterr().err
    settings = json.loads((out / "config.json").read_text())["llamacpp_settings"]
    assert list(settings) == [f"llamacpp+eagle3:{setup['heads']}"]
    chosen = ds.cached_choices(ds.drafter_id(setup["heads"]))
    assert len(chosen) == 1 and chosen[0].why in settings[f"llamacpp+eagle3:{setup['heads']}"]
    assert "## llama.cpp's drafting settings, measured on this machine" in (out / "summary.md").read_text()
