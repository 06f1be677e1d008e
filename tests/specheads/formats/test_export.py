"""Exports and imports: every registered format roundtrips to identical drafts, every export is checked
against its loader's names, bad input is refused by name, and --push-to-hub talks to a Hub on 127.0.0.1."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.formats import EXPORTERS
from specheads.formats.export import export
from specheads.formats.load import load_heads
from specheads.heads.checkpoint import TargetInfo, save_drafter
from specheads.hub import push_folder
from specheads.inference.cli import main as cli_main
from tests.conftest import repetitive_prompt, start_proposer, tiny_model
from tests.drafters import DRAFTERS, proposer_for
from tests.specheads.formats.hub_stub import TOKEN, HubStub

# Every format we also read back; llama.cpp's GGUF is written for llama.cpp alone, which checks it
# (tests/specheads/formats/test_gguf.py)
FORMATS = [(e.format, e.kind) for _, e in EXPORTERS.items() if e.format != "gguf"]


@pytest.fixture
def target_dir(tmp_path):
    target = tiny_model("llama")
    target.save_pretrained(tmp_path / "target")
    return target, tmp_path / "target"


def eagle1_layout(target):
    """EAGLE heads as EAGLE's own code lays them out: no aux layers, no input norm before the first layer."""
    from specheads.heads.eagle import EagleConfig, EagleHead
    from tests.drafters import perturbed

    torch.manual_seed(0)
    cfg = EagleConfig(hidden_size=64, vocab_size=96, first_layer_norm=False, draft_vocab=tuple(range(3, 80)))
    return perturbed(EagleHead(cfg, target)).eval()


EXPORTABLE = {("sglang", "eagle"): eagle1_layout}  # heads of the kind the format can express


def saved(kind, target, target_path, folder, make=None):
    heads = (make or DRAFTERS[kind].make)(target)
    save_drafter(folder, heads, TargetInfo.from_model(target, str(target_path)))
    return heads


def drafts(kind, target, folder):
    proposer = proposer_for(kind, target, folder, {"lookup": 0})
    ctx = start_proposer(proposer, target, repetitive_prompt())
    tree = proposer.propose(ctx)
    return tree.tokens.tolist(), tree.parents.tolist()


def assert_decodes_exactly(kind, target, folder):
    from specheads.inference import Engine
    from specheads.inference.proposers import AutoregressiveProposer

    prompt = repetitive_prompt()
    plain = Engine(target, AutoregressiveProposer()).generate(prompt, max_new_tokens=24)
    res = Engine(target, proposer_for(kind, target, folder, {})).generate(prompt, max_new_tokens=24)
    assert res.output_ids == plain.output_ids and res.stats.drafted > 0


@pytest.mark.parametrize(("fmt", "kind"), [("hf", k) for k in DRAFTERS] + FORMATS)
def test_export_then_import_drafts_identically(fmt, kind, target_dir, tmp_path):
    target, target_path = target_dir
    saved(kind, target, target_path, tmp_path / "heads", EXPORTABLE.get((fmt, kind)))
    done = export(tmp_path / "heads", fmt, tmp_path / "out")
    assert (tmp_path / "out" / "config.json").is_file() and done.verifier == str(target_path)
    assert drafts(kind, target, tmp_path / "out") == drafts(kind, target, tmp_path / "heads")
    if fmt == "hf":
        card = (tmp_path / "out" / "README.md").read_text()
        assert f"specheads generate --method {kind} --heads" in card


def test_a_run_exports_its_final_heads_and_the_card_reports_the_run(target_dir, tmp_path):
    target, target_path = target_dir
    run = tmp_path / "run"
    saved("eagle3", target, target_path, run / "final")
    (run / "config.yaml").write_text("recipe: eagle3\nmax_steps: 7\ndata: {source: sharegpt, max_conversations: 9}\n")
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in (
        {"step": 7, "loss": 1.25}, {"step": 7, "eval/top1_step1": 0.5},
        {"step": 7, "eval/measured_tau": 2.25, "eval/measured_chain_tau": 1.5})) + "\n")
    export(run, "hf", tmp_path / "card")
    card = (tmp_path / "card" / "README.md").read_text()
    assert "| steps | 7 |" in card and "| final loss | 1.25 |" in card and "vllm serve DIR" in card
    assert "| measured_tau | 2.250 |" in card and "| top1_step1 | 0.500 |" in card
    assert "| measured_chain_tau | 1.500 |" in card  # what a chain engine gets of the same heads
    assert "--speculative-algorithm EAGLE3" in card


def test_sglang_names_layers_its_own_way_and_counts_aux_ids_one_lower(target_dir, tmp_path):
    target, target_path = target_dir
    saved("eagle3", target, target_path, tmp_path / "heads")
    export(tmp_path / "heads", "sglang", tmp_path / "sg")
    config = json.loads((tmp_path / "sg" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 77
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2]  # ours: hidden_states 1, 2, 3
    names = set(load_file(tmp_path / "sg" / "model.safetensors"))
    assert {"midlayer.hidden_norm.weight", "additional_layers.0.hidden_norm.weight", "d2t"} <= names
    assert not any(n.startswith("layers.") or "embed_tokens" in n for n in names)


def test_bad_input_is_refused_by_name(target_dir, tmp_path):
    target, target_path = target_dir
    heads = tmp_path / "heads"
    saved("eagle3", target, target_path, heads)

    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    with pytest.raises(ValueError, match="has no finished heads"):
        export(tmp_path / "run", "speculators", tmp_path / "a")
    with pytest.raises(ValueError,
                       match=r"--to speculators cannot express eagle heads.*eagle heads export to: hf, sglang"):
        saved("eagle", target, target_path, tmp_path / "e1")
        export(tmp_path / "e1", "speculators", tmp_path / "b")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("keep me")
    with pytest.raises(ValueError, match="is not an empty folder"):
        export(heads, "speculators", tmp_path / "full")
    assert (tmp_path / "full" / "x").read_text() == "keep me"

    state = load_file(heads / "model.safetensors")
    save_file({**state, "fc.weight": torch.zeros(64, 191)}, heads / "model.safetensors")
    with pytest.raises(ValueError, match=r"tensor 'fc.weight' has shape \(64, 191\), its loader expects \(64, 192\)"):
        export(heads, "speculators", tmp_path / "c")
    assert not (tmp_path / "c").exists()
    save_file(state, heads / "model.safetensors")

    export(heads, "speculators", tmp_path / "spec")
    with pytest.raises(ValueError, match=r"were trained for target .*hidden 64, vocab 96.*not this target: hidden "
                                         r"size 64 \(heads\) vs 32 \(target\)"):
        load_heads(tmp_path / "spec", tiny_model("llama", hidden=32))
    spec_state = load_file(tmp_path / "spec" / "model.safetensors")
    save_file({**spec_state, "lm_head.weight": torch.zeros(100, 64), "d2t": torch.zeros(100, dtype=torch.long)},
              tmp_path / "spec" / "model.safetensors")
    with pytest.raises(ValueError,
                       match=r"draft vocabulary \(100 tokens\) is larger than the target vocabulary \(96\)"):
        load_heads(tmp_path / "spec", target)

    (tmp_path / "alien").mkdir()
    (tmp_path / "alien" / "config.json").write_text(json.dumps({"architectures": ["Mystery"]}))
    save_file({"w": torch.zeros(1)}, tmp_path / "alien" / "model.safetensors")
    with pytest.raises(ValueError,
                       match=r'matches none of: .*speculators eagle3 \(config.json "speculators_model_type"'):
        load_heads(tmp_path / "alien", target)


def test_pickled_weights_load_only_as_plain_tensors(target_dir, tmp_path):
    target, target_path = target_dir
    saved("eagle3", target, target_path, tmp_path / "heads")
    export(tmp_path / "heads", "sglang", tmp_path / "sg")
    state = load_file(tmp_path / "sg" / "model.safetensors")
    (tmp_path / "sg" / "model.safetensors").unlink()
    torch.save(state, tmp_path / "sg" / "pytorch_model.bin")
    assert drafts("eagle3", target, tmp_path / "sg") == drafts("eagle3", target, tmp_path / "heads")

    class Payload:  # what weights_only=True refuses to unpickle
        def __reduce__(self):
            return (print, ("unpickled",))

    torch.save({"x": Payload()}, tmp_path / "sg" / "pytorch_model.bin")
    with pytest.raises(ValueError, match="is corrupt or not plain tensors"):
        load_heads(tmp_path / "sg", target)


def test_push_to_hub_creates_the_repo_and_commits_the_export(target_dir, tmp_path):
    target, target_path = target_dir
    saved("eagle3", target, target_path, tmp_path / "heads")
    done = export(tmp_path / "heads", "speculators", tmp_path / "spec")
    with HubStub() as hub:
        url = push_folder(done.folder, "org/eagle3-tiny", private=True, token=TOKEN, endpoint=hub.url)
        assert url.startswith(hub.url) and hub.created == [
            {"name": "eagle3-tiny", "organization": "org", "visibility": "private", "type": "model"}]
        files = hub.repos["org/eagle3-tiny"]["files"]
        assert sorted(files) == ["config.json", "model.safetensors"]
        assert files["config.json"] == (tmp_path / "spec" / "config.json").read_bytes()
        with pytest.raises(ValueError,
                           match=r"pushing to the Hub repo org/x failed \(.*401.*the export in .* is intact"):
            push_folder(done.folder, "org/x", token="hf_wrong", endpoint=hub.url)
        assert "org/x" not in hub.repos and not any("/org/x/commit/" in path for _, path in hub.requests)


def test_cli_exports_and_a_failed_push_keeps_the_export(target_dir, tmp_path, capsys, monkeypatch):
    target, target_path = target_dir
    saved("eagle3", target, target_path, tmp_path / "heads")
    assert cli_main(["export", str(tmp_path / "heads"), "--to", "speculators", "--output", str(tmp_path / "a"),
                     "--verifier", "org/target"]) == 0
    assert "wrote speculators export" in capsys.readouterr().out
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/target"
    monkeypatch.setattr("huggingface_hub.constants.ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    code = cli_main(["export", str(tmp_path / "heads"), "--to", "hf", "--output", str(tmp_path / "b"),
                     "--push-to-hub", "org/x"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "the export in" in err[0] and "is intact" in err[0]
    assert (tmp_path / "b" / "model.safetensors").is_file()


def test_a_hub_id_resolves_from_the_cache_offline_and_an_uncached_one_fails_first(target_dir, tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants

    from specheads.inference.methods import METHODS

    target, target_path = target_dir
    saved("eagle3", target, target_path, tmp_path / "heads")
    # The cache layout huggingface_hub writes: models--ORG--NAME/{refs/main, snapshots/<commit>/<files>}.
    repo = tmp_path / "cache" / "models--org--eagle3-tiny"
    commit = "a" * 40
    export(tmp_path / "heads", "speculators", repo / "snapshots" / commit)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(commit)
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    assert drafts("eagle3", target, "org/eagle3-tiny") == drafts("eagle3", target, tmp_path / "heads")
    with pytest.raises(ValueError, match="org/missing is neither a local folder nor a Hub repo that could be fetched"):
        METHODS.get("eagle3").make_options({"heads": "org/missing"})


def test_vllm_medusa_writes_its_block_names_and_the_shared_head_rows(target_dir, tmp_path):
    target, target_path = target_dir
    heads = saved("medusa", target, target_path, tmp_path / "heads")
    export(tmp_path / "heads", "vllm-medusa", tmp_path / "vm")
    config = json.loads((tmp_path / "vm" / "config.json").read_text())
    assert config["architectures"] == ["MedusaModel"] and config["original_lm_head"] is True
    assert (config["num_heads"], config["truncated_vocab_size"]) == (4, 77)
    state = load_file(tmp_path / "vm" / "model.safetensors")
    ids = list(heads.config.draft_vocab)
    assert torch.equal(state["lm_heads.0.weight"], target.get_output_embeddings().weight[ids].detach())
    assert torch.equal(state["token_map"], torch.tensor(ids))
    assert torch.equal(state["blocks.2.layers.0.weight"], heads.blocks[2][0].linear.weight.detach())


def test_eagle1_checkpoints_of_eagles_own_code_import_and_decode_exactly(target_dir, tmp_path):
    """EAGLE's own layout: a Llama config, fc with a bias, a first layer without input norm, the embedding
    inside, pickled weights. It drafts here as the same heads saved by us do."""
    target, target_path = target_dir
    heads = eagle1_layout(target)
    full = type(heads)(type(heads.config)(**{**heads.config.__dict__, "draft_vocab": None}), target)
    full.load_state_dict(heads.state_dict())
    save_drafter(tmp_path / "ours", full, TargetInfo.from_model(target, str(target_path)))
    (tmp_path / "orig").mkdir()
    (tmp_path / "orig" / "config.json").write_text(json.dumps({**target.config.to_dict(), "num_hidden_layers": 1,
                                                              "architectures": ["LlamaForCausalLM"]}))
    state = {**full.state_dict(), "embed_tokens.weight": target.get_input_embeddings().weight.detach()}
    assert "layers.0.input_layernorm.weight" not in state
    torch.save(state, tmp_path / "orig" / "pytorch_model.bin")
    assert drafts("eagle", target, tmp_path / "orig") == drafts("eagle", target, tmp_path / "ours")
    assert_decodes_exactly("eagle", target, tmp_path / "orig")

    with pytest.raises(ValueError, match=r"cannot express these eagle heads \(it fuses aux layers\)"):
        saved("eagle", target, target_path, tmp_path / "aux")
        export(tmp_path / "aux", "sglang", tmp_path / "x")


def test_faster_decoding_medusa_heads_import_and_decode_exactly(target_dir, tmp_path):
    """FasterDecoding's layout: medusa_lm_head.pt with `{i}.{j}.linear` blocks and `{i}.{L}` LM heads."""
    from specheads.heads.medusa import MedusaConfig, MedusaHeads
    from tests.drafters import perturbed

    target, target_path = target_dir
    torch.manual_seed(0)
    heads = perturbed(MedusaHeads(MedusaConfig.for_target(target, num_heads=3, own_lm_head=True), target.lm_head), 0.2)
    save_drafter(tmp_path / "ours", heads, TargetInfo.from_model(target, str(target_path)))
    theirs = {}
    for name, tensor in heads.state_dict().items():
        parts = name.split(".")
        if parts[0] == "blocks":  # blocks.i.j.linear.w -> i.j.linear.w
            theirs[".".join(parts[1:])] = tensor
        else:  # lm_heads.i.w -> i.L.w
            theirs[f"{parts[1]}.1.{parts[2]}"] = tensor
    (tmp_path / "fd").mkdir()
    (tmp_path / "fd" / "config.json").write_text(json.dumps({"medusa_num_heads": 3, "medusa_num_layers": 1,
                                                            "base_model_name_or_path": str(target_path)}))
    torch.save(theirs, tmp_path / "fd" / "medusa_lm_head.pt")
    assert drafts("medusa", target, tmp_path / "fd") == drafts("medusa", target, tmp_path / "ours")
    assert_decodes_exactly("medusa", target, tmp_path / "fd")


def test_the_hub_stub_refuses_malformed_requests():
    """The stub's checks have teeth: a creation of another repo type and a commit without a header are refused."""
    import httpx

    with HubStub() as hub:
        auth = {"Authorization": f"Bearer {TOKEN}"}
        bad = httpx.post(f"{hub.url}/api/repos/create", headers=auth, json={"name": "x", "organization": "org",
                                                                             "type": "dataset"})
        assert bad.status_code == 400 and not hub.repos
        assert httpx.post(f"{hub.url}/api/repos/create", headers=auth,
                          json={"name": "x", "organization": "org"}).is_success
        commit = httpx.post(f"{hub.url}/api/models/org/x/commit/main", headers=auth,
                            content=json.dumps({"key": "file", "value": {"path": "a", "content": "",
                                                                         "encoding": "base64"}}))
        assert commit.status_code == 400 and not hub.repos["org/x"]["files"]


# tests.drafters: num_depths 4, block_size 4 (dspark drafts from its anchor's slot too)
@pytest.mark.parametrize("kind,block", [("peagle", 4), ("dflash", 3), ("dspark", 4), ("xpress", 3),
                                        ("dflash2", 3)])
def test_speculative_tokens_of_block_drafters_are_honoured_up_to_the_block_and_refused_past_it(kind, block, target_dir,
                                                                                               tmp_path):
    target, target_path = target_dir
    saved(kind, target, target_path, tmp_path / "heads")

    def recorded(folder):
        config = json.loads((folder / "config.json").read_text())
        return config["speculators_config"]["proposal_methods"][0]["speculative_tokens"]

    export(tmp_path / "heads", "speculators", tmp_path / "own")
    assert recorded(tmp_path / "own") == block  # by default the drafter's own block
    export(tmp_path / "heads", "speculators", tmp_path / "fewer", speculative_tokens=2)
    assert recorded(tmp_path / "fewer") == 2
    with pytest.raises(ValueError, match=rf"--speculative-tokens {block + 1}: these {kind} heads draft {block} tokens "
                                         rf"per forward .*pass --speculative-tokens {block} or less"):
        export(tmp_path / "heads", "speculators", tmp_path / "more", speculative_tokens=block + 1)
    assert not (tmp_path / "more").exists()
    if kind == "peagle":  # the recorded block is the imported one
        assert load_heads(tmp_path / "fewer", target, kind=kind).config.num_depths == 2


def test_every_declared_format_is_written_for_some_kind_and_an_undeclared_one_is_refused():
    from specheads.formats.base import Exporter, register_exporter
    from specheads.formats.engines import FORMATS, HF_FORMAT

    written = {e.format for _, e in EXPORTERS.items()}
    assert written == set(FORMATS) - {HF_FORMAT}
    with pytest.raises(ValueError, match="'tflite' is not declared; add it.*FORMATS"):
        register_exporter(Exporter("tflite", "eagle3", "nothing", write=lambda ckpt, folder, ctx: []))
    assert "tflite/eagle3" not in EXPORTERS
