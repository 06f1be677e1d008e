"""The engine on llama.cpp's kernels (`llamacpp_backend.py`, libllama built from the pinned release): a tiny random
Llama target converted to an F32 GGUF by llama.cpp's converter, decoded through the same loop as our own forward.

Checked: a tree's nodes see exactly their ancestors (each node's logits are those of llama.cpp's own one-token steps
along its path, within the rounding of another summation order; the control, every node on one sequence, is far
off); every proposer's greedy output is llama.cpp's plain greedy output; rows decoded together give what each gives
alone; sampling keeps the target's law; hidden states are the HF model's; and the binding is checked against the
library at build time."""

from __future__ import annotations

import pytest
import torch

import specheads.inference.engine.llamacpp_backend as backend_mod
import specheads.inference.proposers.verify_cost as verify_cost_mod
from specheads.inference import Engine
from specheads.inference.engine.llamacpp_backend import LlamaCppBackend
from specheads.inference.engine.tree import DraftTree
from specheads.inference.methods import METHODS, make_proposer
from specheads.inference.proposers import AutoregressiveProposer
from specheads.inference.proposers.draft_model import DraftModelProposer
from specheads.inference.proposers.lookahead import LookaheadProposer
from specheads.inference.proposers.ngram import NgramProposer
from specheads.inference.proposers.suffix import SuffixProposer
from specheads.inference.proposers.verify_cost import measure_backend_verify_cost
from specheads.llamacpp import tree_target
from specheads.llamacpp.convert import convert_hf_to_gguf
from tests.conftest import perturbed_copy
from tests.drafters import (
    COUNTING_PROMPT,
    DRAFTERS,
    bigram_target,
    check_engine_keeps_the_law,
    proposer_for,
    save_case,
)
from tests.specheads.llamacpp.tiny import copy_tokenizer, smol_tiny_target

NEW = 40
# F32 logits of a batch and of one-token steps sum their products in another order: a few ulps of logits of order 10
ROUNDING = 1e-4
PROMPTS = [[1, 500, 600, 700, 800, 900, 500, 600, 700], [1, 5, 6, 7, 8, 5, 6, 7, 8, 5, 6], [1, 42]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("llamacpp-backend")
    tree_target.tree_target_library()  # built once per version and CPU, then cached (scripts/setup.sh builds it)
    target = smol_tiny_target(root / "target")
    gguf = convert_hf_to_gguf(root / "target", root / "target.gguf", outtype="f32")
    return {"root": root, "target": target, "gguf": gguf}


def backend(tiny, **kwargs) -> LlamaCppBackend:
    return LlamaCppBackend(tiny["gguf"], context=kwargs.pop("context", 1024), **kwargs)


def plain_steps(b: LlamaCppBackend, tokens: list[int]) -> torch.Tensor:
    """llama.cpp's logits after each of `tokens` [T] fed one token per decode: [T, V]."""
    row = b.add_row(len(tokens) + 1)
    out = [b.prefill(row, torch.tensor(tokens[:1]), hidden=False).logits[0, 0]]
    b.commit(row, torch.tensor([0]))
    for tok in tokens[1:]:
        out.append(b.verify(row, [DraftTree.root_only(tok)], hidden=False).logits[0, 0])
        b.commit(row, torch.tensor([0]))
    b.reset()
    return torch.stack(out)


def greedy(tiny, proposer, prompt: list[int], **kwargs):
    return Engine(tiny["target"], proposer, backend=backend(tiny, **kwargs)).generate(prompt, max_new_tokens=NEW)


def near_tie_or_equal(tiny, ours: list[int], plain: list[int], prompt: list[int]) -> None:
    """`ours` is `plain`, or parts from it first where llama.cpp's plain step nearly ties between the two tokens."""
    first = next((i for i, (x, y) in enumerate(zip(ours, plain)) if x != y), None)
    if first is None:
        assert len(ours) == len(plain)
        return
    logits = plain_steps(backend(tiny), prompt + plain[:first])[-1]
    margin = float(logits[plain[first]] - logits[ours[first]])
    assert 0 <= margin < ROUNDING * logits.abs().max(), (first, margin)


def test_tree_nodes_see_exactly_their_ancestors(tiny, monkeypatch):
    prompt = PROMPTS[0]
    # root; two children; a grandchild under each; a third level under the second: three leaves, shared prefixes
    tree = DraftTree(tokens=torch.tensor([17, 11, 12, 13, 14, 15]), parents=torch.tensor([-1, 0, 0, 1, 2, 4]))

    def verify_tree() -> torch.Tensor:
        b = backend(tiny)
        row = b.add_row(64)
        b.prefill(row, torch.tensor(prompt), hidden=False)
        b.commit(row, torch.tensor([0]))
        return b.verify(row, [tree], hidden=False).logits[0]

    logits = verify_tree()
    scale = float(logits.abs().max())
    for node in range(tree.size):
        path = tree.path_to(node)
        reference = plain_steps(backend(tiny), prompt + tree.tokens[path].tolist())[-1]
        assert (logits[node] - reference).abs().max() < ROUNDING * scale, node
    # the control: every node on the main sequence sees its siblings, and its logits part from the path's
    monkeypatch.setattr(backend_mod.LlamaCppBackend, "_encode",
                        lambda self, row, t: ((self._main(row),), [self._main(row)] * t.input_size,
                                              [[self._main(row)]] * t.input_size))
    broken = verify_tree()
    reference = plain_steps(backend(tiny), prompt + tree.tokens[tree.path_to(2)].tolist())[-1]
    assert (broken[2] - reference).abs().max() > 100 * ROUNDING * scale


def test_a_committed_path_is_what_the_cache_holds(tiny):
    # after a branch is accepted, the next step continues from it alone: the rejected sibling left no trace
    prompt = PROMPTS[1]
    b = backend(tiny)
    row = b.add_row(64)
    b.prefill(row, torch.tensor(prompt), hidden=False)
    b.commit(row, torch.tensor([0]))
    tree = DraftTree(tokens=torch.tensor([17, 11, 12, 13]), parents=torch.tensor([-1, 0, 0, 2]))
    b.verify(row, [tree], hidden=False)
    b.commit(row, torch.tensor([0, 2, 3]))
    after = b.verify(row, [DraftTree.root_only(99)], hidden=False).logits[0, 0]
    assert b.lengths == [len(prompt) + 3]
    reference = plain_steps(backend(tiny), prompt + [17, 12, 13, 99])[-1]
    assert (after - reference).abs().max() < ROUNDING * float(reference.abs().max())


@pytest.fixture(scope="module")
def counting(tmp_path_factory):
    """A target that mostly counts (x -> x + 1): its text repeats the prompt's runs, so every training-free
    proposer finds drafts, and sampling from it accepts drafts often."""
    root = tmp_path_factory.mktemp("llamacpp-counting")
    target = bigram_target(vocab=49152)
    target.save_pretrained(root / "target")
    copy_tokenizer(root / "target")
    return {"root": root, "target": target,
            "gguf": convert_hf_to_gguf(root / "target", root / "target.gguf", outtype="f32")}


@pytest.mark.parametrize("name", ["ngram", "suffix", "lookahead", "draft-model"])
def test_training_free_proposers_decode_as_llamacpp_plain_greedy(counting, name):
    proposer = {"ngram": NgramProposer, "suffix": SuffixProposer, "lookahead": LookaheadProposer,
                "draft-model": lambda: DraftModelProposer(perturbed_copy(counting["target"], 0.02))}[name]()
    plain = greedy(counting, AutoregressiveProposer(), COUNTING_PROMPT)
    res = greedy(counting, proposer, COUNTING_PROMPT)
    assert res.stats.accepted > 0, name
    near_tie_or_equal(counting, res.output_ids, plain.output_ids, COUNTING_PROMPT)


@pytest.mark.parametrize("kind", ["eagle3", "peagle", "dflash", "medusa", "eagle"])
def test_heads_decode_as_llamacpp_plain_greedy(tiny, kind, tmp_path):
    target = tiny["target"]
    save_case(kind, target, tmp_path)
    prompt = PROMPTS[0]
    plain = greedy(tiny, AutoregressiveProposer(), prompt)
    for values in DRAFTERS[kind].options[:2]:  # a tree of the heads alone, and with prompt lookup grafted on
        res = greedy(tiny, proposer_for(kind, target, tmp_path, values), prompt)
        assert res.stats.drafted > 0, (kind, values)
        near_tie_or_equal(tiny, res.output_ids, plain.output_ids, prompt)


def test_rows_decode_together_as_each_alone(tiny):
    alone = [greedy(tiny, NgramProposer(), p).output_ids for p in PROMPTS]
    engine = Engine(tiny["target"], NgramProposer(), backend=backend(tiny, max_rows=2), max_rows=2)
    seqs = [engine.add(p, max_new_tokens=NEW) for p in PROMPTS]  # the third joins when the first row frees
    while engine.num_running or engine.num_waiting:
        engine.step()
    assert [s.result().output_ids for s in seqs] == alone


def test_hidden_states_are_the_hf_models(tiny):
    target, prompt = tiny["target"], PROMPTS[0]
    b = backend(tiny)
    b.read_layers((0, 2, 5, -1))
    row = b.add_row(64)
    hidden = b.prefill(row, torch.tensor(prompt), hidden=True).hidden_states
    reference = target(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    assert len(hidden) == len(reference)
    for i, (ours, theirs) in enumerate(zip(hidden, reference)):
        if i in (0, 2, 5, len(reference) - 1):
            assert (ours - theirs).abs().max() < ROUNDING * theirs.abs().max(), i
        else:
            assert ours is None, i


def test_sampling_keeps_the_targets_law(counting):
    engine = Engine(counting["target"], NgramProposer(), backend=backend(counting, max_rows=4), max_rows=4)
    check_engine_keeps_the_law(engine, counting["target"], label="llamacpp ngram")


def test_what_llamacpp_cannot_serve_is_refused_by_name(tiny):
    with pytest.raises(ValueError, match="no GGUF file at"):
        LlamaCppBackend(tiny["root"] / "missing.gguf")
    b = backend(tiny)
    with pytest.raises(ValueError, match="without naming their layers"):
        b.read_layers(None)
    with pytest.raises(ValueError, match="must be in \\[0, 8\\]"):
        b.read_layers((9,))
    b = backend(tiny, max_rows=64, context=64 * 128)  # 4 sequence ids a row
    row = b.add_row(64)
    b.prefill(row, torch.tensor(PROMPTS[0]), hidden=False)
    b.commit(row, torch.tensor([0]))
    bushy = DraftTree(tokens=torch.arange(10, 16), parents=torch.tensor([-1, 0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match="a tree of 5 leaves needs as many llama.cpp sequence ids, and a row has 4"):
        b.verify(row, [bushy], hidden=False)
    with pytest.raises(ValueError, match="at most 128 rows"):
        backend(tiny, max_rows=200)
    with pytest.raises(ValueError, match="the llamacpp backend runs its own"):
        Engine(tiny["target"], AutoregressiveProposer(), backend=backend(tiny), step="lean")


def test_a_binding_that_disagrees_with_the_library_fails_its_build(tiny, tmp_path, monkeypatch):
    # the declared type of one function changed: the build that checks it stops, naming the function
    signatures = dict(tree_target.SIGNATURES)
    signatures["tt_decode"] = ("int32_t", ("tt_target *", "int32_t", "const int32_t *"))
    monkeypatch.setattr(tree_target, "SIGNATURES", signatures)
    libraries = tree_target.llama_server().parent / tree_target.LIBRARIES
    with pytest.raises(RuntimeError, match="tt_decode: the binding .* and tree_target.cpp disagree"):
        tree_target._link(tree_target.VERSION, libraries, tmp_path, tree_target.quiet)


def test_the_node_budget_weighs_trees_by_llamacpps_own_verify_cost(tiny, monkeypatch):
    # measured for real on a copy of the backend: one positive time per size, a tree never cheaper than a step
    cost = measure_backend_verify_cost(backend(tiny), sizes=(2, 8), reps=1, context=16)
    assert cost.nodes == (1, 2, 8) and min(cost.seconds) > 0 and cost.relative(8) >= 1.0
    # the engine tells the budget which forward verifies its trees: the curve it reads is the backend's, cached
    # under the backend's own key (never the PyTorch forward's of the same model)
    measured = []
    monkeypatch.setattr(verify_cost_mod, "measure_backend_verify_cost",
                        lambda source, **kw: measured.append(source) or cost)
    proposer = make_proposer("ngram", tiny["target"], METHODS.get("ngram").make_options({}), None)
    b = backend(tiny)
    Engine(tiny["target"], proposer, backend=b).generate(PROMPTS[1], max_new_tokens=8)
    assert proposer.budget.costs.at(1) == cost and measured and measured[0] is b
    assert any(p.name.startswith(f"llamacpp-{b.cost_key()}") for p in verify_cost_mod.default_cache_dir().iterdir())


def test_the_gguf_header_is_read_without_the_tensors(tiny):
    assert backend_mod.gguf_architecture(tiny["gguf"]) == "llama"
    assert backend_mod.gguf_precision(tiny["gguf"]) == "f32"
    with pytest.raises(ValueError, match="is not a GGUF file"):
        backend_mod.gguf_header(tiny["root"] / "target" / "config.json", ("general.architecture",))


def test_layer_inputs_are_asked_only_of_graphs_that_keep_them(tiny):
    # the list is the pinned release's: every model graph of its source that sets a layer's input tensor
    source = tree_target.source_tree() / "src" / "models"
    keeping = {p.stem for p in source.glob("*.cpp") if "t_layer_inp" in p.read_text()}
    assert keeping == backend_mod.LAYER_INPUT_ARCHITECTURES
    b = backend(tiny)
    b.architecture = "gpt2"  # a graph that keeps none: llama.cpp would stop at an assertion
    b.read_layers((-1,))  # the final norm's output every graph gives
    with pytest.raises(ValueError, match="llama.cpp's gpt2 graph keeps no layer inputs"):
        b.read_layers((2, -1))


def test_generate_on_llamacpp_from_the_command_line(tiny, tmp_path, capsys):
    # `specheads generate --backend llamacpp --gguf FILE`: the same answer as the backend decoding plainly
    import json

    from transformers import AutoTokenizer

    from specheads.inference.cli import main
    from specheads.questions import load_questions
    from specheads.target import render_chat

    args = ["generate", "--target", str(tiny["root"] / "target"), "--backend", "llamacpp", "--gguf",
            str(tiny["gguf"]), "--method", "ngram", "--questions", "sharegpt-heldout", "--limit", "1",
            "--max-new-tokens", "12", "--output", str(tmp_path / "answers.jsonl")]
    assert main(args) == 0, capsys.readouterr().err
    row = json.loads((tmp_path / "answers.jsonl").read_text().splitlines()[0])
    tokenizer = AutoTokenizer.from_pretrained(tiny["root"] / "target")
    prompt = render_chat(tokenizer, [load_questions("sharegpt-heldout", 1)[0].turns[0]])
    engine = Engine(tiny["target"], AutoregressiveProposer(), backend=backend(tiny))
    assert row["output_ids"] == engine.generate(prompt, max_new_tokens=12).output_ids


def test_calibrate_and_serve_adaptively_on_llamacpp(tiny):
    # the calibration times the llama.cpp backend's own steps, and only a server on that backend takes the profile
    from specheads.inference.serve.calibrate import calibrate
    from specheads.inference.serve.launch import serving_engine

    prompts = [PROMPTS[0], PROMPTS[1]]
    profile = calibrate(tiny["target"], NgramProposer(), prompts, method="ngram", batch_sizes=(1, 2), steps=2,
                        rounds=1, backend_for=lambda rows: backend(tiny, max_rows=rows))
    assert profile.machine_key == f"llamacpp-{backend(tiny).cost_key()}" and "llama.cpp on target.gguf" in \
        profile.machine
    assert [c.batch for c in profile.costs] == [1, 2] and all(c.plain_step_s > 0 for c in profile.costs)
    engine = serving_engine(tiny["target"], NgramProposer(), label="ngram", max_batch=2, mode="adaptive",
                            profile=profile, backend=backend(tiny, max_rows=2))
    assert engine.backend.name == "llamacpp"
    with pytest.raises(ValueError, match="calibrated for another target"):
        serving_engine(tiny["target"], NgramProposer(), label="ngram", max_batch=2, mode="adaptive", profile=profile)


def test_bushy_trees_are_pruned_to_a_rows_sequence_ids(tiny):
    # 64 rows leave 4 ids a row: the engine keeps the first nodes with 4 leaves, and decodes as plain llama.cpp
    bushy = DraftTree(tokens=torch.arange(10, 17), parents=torch.tensor([-1, 0, 0, 0, 0, 0, 1]))
    # the fifth child of the root would be a fifth leaf; node 6 extends node 1's path, which costs none
    assert bushy.within_leaves(4).parents.tolist() == [-1, 0, 0, 0, 0, 1]
    assert bushy.within_leaves(9) is bushy
    chain_then_fan = DraftTree(tokens=torch.arange(10, 16), parents=torch.tensor([-1, 0, 1, 1, 1, 1]))
    assert chain_then_fan.within_leaves(2).parents.tolist() == [-1, 0, 1, 1]  # a child of a leaf costs none
    b = backend(tiny, max_rows=64, context=64 * 128)
    engine = Engine(tiny["target"], LookaheadProposer(), backend=b, max_rows=64)
    plain = greedy(tiny, AutoregressiveProposer(), PROMPTS[1])
    assert engine.generate(PROMPTS[1], max_new_tokens=NEW).output_ids == plain.output_ids
