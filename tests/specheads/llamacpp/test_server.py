"""llama.cpp itself decoding with what we export: a real `llama-server` (built from the package index once, cached)
on 127.0.0.1, a tiny random Llama target converted to F32 GGUF by llama.cpp's converter, and EAGLE-3 heads exported
`--to gguf`. Checked: llama.cpp with our draft gives llama.cpp's greedy text without it (its own exactness) and
reports its draft statistics; its plain greedy text is our `ar`'s on the same weights, or parts from it only where
the fp32 target itself nearly ties; and the bench runs llama.cpp beside our methods in one interleaved run."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoTokenizer

from specheads.formats.export import export
from specheads.inference import Engine
from specheads.inference.bench.divergence import fp32_margin
from specheads.inference.proposers import AutoregressiveProposer
from specheads.llamacpp.build import llama_server
from specheads.llamacpp.convert import convert_hf_to_gguf
from specheads.llamacpp.server import LlamaServer
from specheads.target import render_chat
from tests.specheads.llamacpp.tiny import eagle3_heads, save_heads, smol_tiny_target

QUESTIONS = ["Write a function that adds two numbers.", "What is the capital of France?",
             "Tell me a story about a cat.", "List three colors and explain why the sky is blue."]
NEW_TOKENS = 40
# fp32 logits of one forward, summed in another order by another library: a few ulps of logits of order 10
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp")
    binary = llama_server()  # built once per version and CPU, then cached (scripts/setup.sh builds it first)
    target = smol_tiny_target(root / "target")
    model = convert_hf_to_gguf(root / "target", root / "target.gguf", outtype="f32")
    heads = save_heads(root / "heads", eagle3_heads(target), target, root / "target")
    draft = export(heads, "gguf", root / "draft", target=str(root / "target"))
    tokenizer = AutoTokenizer.from_pretrained(root / "target")
    prompts = [render_chat(tokenizer, [q]) for q in QUESTIONS]
    return {"binary": binary, "target": target, "model": model, "heads": heads, "root": root,
            "draft": draft.folder / "eagle3-f32.gguf", "prompts": prompts}


def test_llamacpp_with_our_draft_decodes_as_llamacpp_without_it(setup):
    with LlamaServer(setup["model"], binary=setup["binary"]) as plain, \
            LlamaServer(setup["model"], binary=setup["binary"], draft=setup["draft"], spec_type="draft-eagle3",
                        draft_max=3) as drafted:
        for prompt in setup["prompts"]:
            a = plain.complete(prompt, max_new_tokens=NEW_TOKENS)
            b = drafted.complete(prompt, max_new_tokens=NEW_TOKENS)
            assert b.tokens == a.tokens
            assert a.drafted == 0 and b.drafted > 0  # the draft ran: llama.cpp loaded and used our file
            assert b.steps == len(b.tokens) - b.accepted and b.accepted <= b.drafted
            assert b.stop == a.stop


def test_llamacpps_own_ngram_drafting_decodes_as_llamacpp_without_it(setup):
    # a training-free drafter of llama.cpp's own (the bench's llamacpp+ngram-simple): no draft model, same output
    with LlamaServer(setup["model"], binary=setup["binary"]) as plain, \
            LlamaServer(setup["model"], binary=setup["binary"], spec_type="ngram-simple", draft_max=4) as drafted:
        for prompt in setup["prompts"][:2]:
            assert drafted.complete(prompt, max_new_tokens=NEW_TOKENS).tokens == \
                plain.complete(prompt, max_new_tokens=NEW_TOKENS).tokens
    with pytest.raises(ValueError, match="spec_type=draft-eagle3 drafts with a model: pass its GGUF as draft="):
        LlamaServer(setup["model"], spec_type="draft-eagle3")


def test_llamacpp_greedy_is_ours_on_the_same_weights_up_to_near_ties(setup):
    ar = Engine(setup["target"], AutoregressiveProposer())
    with LlamaServer(setup["model"], binary=setup["binary"], cache_type="f32") as server:
        for prompt in setup["prompts"]:
            theirs = server.complete(prompt, max_new_tokens=NEW_TOKENS).tokens
            ours = ar.generate(prompt, max_new_tokens=NEW_TOKENS).output_ids
            assert len(theirs) == len(ours) == NEW_TOKENS  # the random target never says its end of turn
            first = next((i for i, (x, y) in enumerate(zip(ours, theirs)) if x != y), None)
            if first is not None:  # llama.cpp's kernels sum in another order: only a near-tie may flip
                margin = fp32_margin(setup["target"], prompt, ours, theirs, first)
                assert margin is not None and margin < NEAR_TIE, (first, margin)


def test_a_server_that_cannot_load_its_model_is_reported_with_its_log(setup, tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF not really")
    with pytest.raises(RuntimeError, match="llama-server exited .* while starting"):
        with LlamaServer(bad, binary=setup["binary"]):
            pass
    with pytest.raises(ValueError, match="needs both draft= .* and spec_type="):
        LlamaServer(setup["model"], draft=setup["draft"])


def test_the_bench_runs_llamacpp_beside_our_methods(setup, tmp_path):
    from specheads.inference.cli import main as cli_main

    questions = tmp_path / "q.jsonl"
    questions.write_text("".join(json.dumps({"question_id": i, "category": "c", "turns": [q]}) + "\n"
                                 for i, q in enumerate(QUESTIONS[:2])))
    out = tmp_path / "bench"  # settings given: nothing measured (tests/specheads/llamacpp/test_draft_settings.py)
    target = str(setup["root"] / "target")
    drafted_row = f"llamacpp+eagle3:{setup['heads']}+draft_max=3"
    rc = cli_main(["bench", "--target", target, "--questions", str(questions), "--max-new-tokens", "24",
                   "--methods", f"ar,llamacpp,{drafted_row}", "--output", str(out), "--no-plots", "--dtype", "float32"])
    assert rc in (0, None)
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    by = {(r["method"], r["question_id"]): r for r in rows}
    for q in range(2):
        plain, drafted = by[("llamacpp", q)], by[(drafted_row, q)]
        assert drafted["output_ids"] == plain["output_ids"]  # llama.cpp's own exactness, through the bench
        assert drafted["stats"]["drafted"] > 0 and plain["stats"]["drafted"] == 0
        assert plain["stats"]["new_tokens"] == len(plain["output_ids"]) > 0 and plain["stats"]["wall_s"] > 0
    summary = json.loads((out / "summary.json").read_text())
    methods = [s["method"] for s in summary if s["category"] == "all"]
    assert methods == ["ar", "llamacpp", drafted_row]
    summary_md = (out / "summary.md").read_text()
    assert f"- {drafted_row}: 2/2 outputs equal to llamacpp's" in summary_md
    assert json.loads((out / "config.json").read_text())["llamacpp_exact"] == {drafted_row: "2/2"}


@pytest.mark.slow
def test_the_default_target_in_llamacpp_with_eagle3_heads_for_it(tmp_path):
    """The real default target: its F32 GGUF (converted once, cached) in llama.cpp decodes as our `ar` and as
    llama.cpp with EAGLE-3 heads for it; the shipped Q4_1 file loads and drafts too."""
    from specheads.heads.checkpoint import TargetInfo, save_drafter
    from specheads.heads.eagle3 import Eagle3Config, Eagle3Head
    from specheads.llamacpp.target_gguf import target_gguf
    from specheads.target import load_target
    from tests.drafters import perturbed

    target, tokenizer = load_target("default", dtype="float32")
    cfg = Eagle3Config(hidden_size=576, vocab_size=49152, aux_layers=(2, 15, 27), draft_vocab=tuple(range(8000)))
    torch.manual_seed(0)
    save_drafter(tmp_path / "heads", perturbed(Eagle3Head(cfg, target), scale=0.01).eval(),
                 TargetInfo.from_model(target, "default"))
    draft = export(tmp_path / "heads", "gguf", tmp_path / "draft", target="default")
    prompt = render_chat(tokenizer, ["Write a Python function that reverses a string."])
    ours = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=32).output_ids
    f32 = target_gguf("default", "f32")
    with LlamaServer(f32, cache_type="f32") as plain, \
            LlamaServer(f32, draft=draft.folder / "eagle3-f32.gguf", spec_type="draft-eagle3", cache_type="f32") as lc:
        theirs = plain.complete(prompt, max_new_tokens=32)
        drafted = lc.complete(prompt, max_new_tokens=32)
    assert theirs.tokens[:len(ours)] == ours[:len(theirs.tokens)]  # equal up to where one stops
    assert drafted.tokens == theirs.tokens and drafted.drafted > 0
    with LlamaServer(target_gguf("default", "q4_1"), draft=draft.folder / "eagle3-f32.gguf",
                     spec_type="draft-eagle3") as q4:
        assert q4.complete(prompt, max_new_tokens=8).drafted > 0
