"""How `--methods` names llama.cpp: parsed and checked before any model loads, each mistake named with the fix.
(The runner itself, a real llama-server, is tested in tests/specheads/llamacpp/test_server.py.)"""

from __future__ import annotations

import json

import pytest

from specheads.inference.bench.llamacpp_spec import (
    LlamaCppOptions,
    is_llamacpp,
    parse_llamacpp,
    plain_of,
)
from specheads.inference.bench.method_spec import parse_methods


@pytest.fixture
def heads(tmp_path):
    folder = tmp_path / "run" / "final"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"kind": "peagle", "config": {}}))
    return folder


def test_every_form_parses(heads, tmp_path):
    assert parse_llamacpp("llamacpp") == LlamaCppOptions()
    assert parse_llamacpp("llamacpp@q4_1") == LlamaCppOptions(precision="q4_1")
    measured = parse_llamacpp(f"llamacpp+peagle:{heads}")  # no settings: measured for these files here
    assert measured == LlamaCppOptions("peagle", str(heads)) and measured.measured
    assert parse_llamacpp(f"llamacpp+peagle:{heads.parent}@bf16+draft_max=1") == LlamaCppOptions(
        "peagle", str(heads.parent), "bf16", 1)  # a run folder: its final/ heads
    given = parse_llamacpp(f"llamacpp+peagle:{heads}+draft_max=2+p_min=0.6")
    assert (given.draft_max, given.p_min, given.measured) == (2, 0.6, False)
    assert parse_llamacpp(f"llamacpp+peagle:{heads}+p_min=0.6+draft_max=2") == given  # in either order
    quick = parse_llamacpp(f"llamacpp+peagle:{heads}@q4_1+measure=quick")  # measured, with the smaller plan
    assert (quick.measure, quick.measured, quick.precision) == ("quick", True, "q4_1") and measured.measure == "full"
    gguf = tmp_path / "d.gguf"
    gguf.write_bytes(b"")
    assert parse_llamacpp(f"llamacpp+eagle3:{gguf}").heads == str(gguf)  # a file: the kind is the user's word
    specs = parse_methods(f"ar,llamacpp,llamacpp+peagle:{heads}+draft_max=1")
    assert [s.method for s in specs] == ["ar", "llamacpp", "llamacpp"] and specs[2].arg == str(heads)
    assert is_llamacpp("llamacpp@f32") and not is_llamacpp("llamacppx")


@pytest.mark.parametrize(("spec", "message"), [
    ("llamacpp@q5_k", "precision 'q5_k' is not one of f32, bf16, q8_0, q4_1"),
    ("llamacpp+draft_max=2", r"\+draft_max= needs a drafter: llamacpp\+KIND:DIR\+draft_max=2"),
    ("llamacpp+p_min=0.5", r"\+p_min= needs a drafter: llamacpp\+KIND:DIR\+p_min=0.5"),
    ("llamacpp+ngram-mod+p_min=0.5", "cuts a drafter model's chain; llama.cpp's ngram-mod has no probabilities"),
    ("llamacpp+ngram-mod+p_min=1.5", r"\+p_min= is the drafter's probability .* in \[0, 1\]"),
    ("llamacpp+ngram-mod+draft_max=0", r"\+draft_max= is the most tokens llama.cpp drafts per step, an integer"),
    ("llamacpp+peagle", r"write llamacpp, llamacpp@PRECISION, llamacpp\+KIND:DIR"),
    ("llamacpp+ngram-mod+measure=quick", r"measures a drafter model.s settings; give llama.cpp.s ngram-mod"),
    ("llamacpp+peagle:/no/such/run", "/no/such/run does not exist; pass a training run, a heads folder or a .gguf"),
])
def test_mistakes_are_named(spec, message):
    with pytest.raises(ValueError, match=message):
        parse_llamacpp(spec)


def test_a_measurement_is_one_of_the_plans_and_never_beside_given_settings(heads):
    with pytest.raises(ValueError, match=r"\+measure= is how much .* one of full, quick"):
        parse_llamacpp(f"llamacpp+peagle:{heads}+measure=slow")
    with pytest.raises(ValueError, match=r"\+measure= measures the drafting settings, \+draft_max=/\+p_min= give"):
        parse_llamacpp(f"llamacpp+peagle:{heads}+draft_max=2+measure=quick")
    with pytest.raises(ValueError, match=r"\+draft_max= is the most tokens"):
        parse_llamacpp(f"llamacpp+peagle:{heads}+draft_max=two")


def test_the_kind_must_be_the_heads_own(heads):
    with pytest.raises(ValueError, match=f"holds peagle heads, not eagle3; write llamacpp\\+peagle:{heads}"):
        parse_llamacpp(f"llamacpp+eagle3:{heads}")
    with pytest.raises(ValueError, match="is listed twice"):
        parse_methods("llamacpp,llamacpp")


def test_each_drafting_method_names_its_plain_reference():
    assert plain_of("llamacpp+peagle:/gone/run@q4_1+draft_max=1") == "llamacpp@q4_1"
    assert plain_of("llamacpp+eagle3:/gone/run") == "llamacpp"
    assert plain_of("llamacpp+eagle3:/gone/run@bf16+draft_max=2+p_min=0.5") == "llamacpp@bf16"
    assert plain_of("llamacpp+peagle:/gone/run@q4_1+measure=quick") == "llamacpp@q4_1"
    assert plain_of("llamacpp@bf16") is None and plain_of("ar") is None and plain_of("peagle:/x") is None


def test_engine_methods_on_llamacpps_kernels_parse_and_name_their_plain_reference(heads):
    spec = parse_methods(f"ngram+backend=llamacpp+gguf=q4_1,peagle:{heads}+lookup=0+backend=llamacpp")
    assert [(s.method, s.backend, s.gguf) for s in spec] == [("ngram", "llamacpp", "q4_1"),
                                                               ("peagle", "llamacpp", None)]
    assert spec[1].options.lookup == 0 and spec[1].arg == str(heads)
    assert parse_methods("ngram")[0].backend == "torch"
    assert plain_of("ngram+backend=llamacpp+gguf=q4_1") == "llamacpp@q4_1"
    assert plain_of(f"peagle:{heads}+backend=llamacpp") == "llamacpp"
    for bad, message in [("ngram+backend=vllm", "takes torch or llamacpp"),
                         ("ngram+gguf=q4_1", "goes with \\+backend=llamacpp"),
                         ("ngram+backend=llamacpp+gguf=q5", "takes f32, bf16, q8_0, q4_1"),
                         ("ngram+backend=llamacpp+compile=1", "compiles our PyTorch forward")]:
        with pytest.raises(ValueError, match=message):
            parse_methods(bad)


def test_llamacpps_own_training_free_drafting_parses():
    assert parse_llamacpp("llamacpp+ngram-mod") == LlamaCppOptions(kind="ngram-mod")
    assert parse_llamacpp("llamacpp+ngram-simple@q4_1+draft_max=8") == LlamaCppOptions(
        kind="ngram-simple", precision="q4_1", draft_max=8)
    assert plain_of("llamacpp+ngram-cache@q4_1") == "llamacpp@q4_1"
    with pytest.raises(ValueError, match="MODE: one of llama.cpp's own ngram-simple, ngram-mod"):
        parse_llamacpp("llamacpp+ngram-fancy")
