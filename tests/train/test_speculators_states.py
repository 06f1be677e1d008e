"""Hidden states in speculators' offline format (its preprocessed dataset + vLLM's hs_<i>.safetensors) import as our
feature cache: the same rows as our own cache of the same token ids, every broken file refused by name, and a run
on them trains to the same losses as a run on our cache."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import datasets
import pytest
import torch
from safetensors.torch import load_file, save_file

from specheads.target import load_target
from specheads.train.__main__ import main as train_main
from specheads.train.config import load_train_config
from specheads.train.data import load_conversations, split_by_conversation, tokenize_dataset
from specheads.train.feature_cache import FeatureCache, fingerprint, write_feature_cache
from specheads.train.speculators_states import import_speculators_states, write_speculators_states
from specheads.train.speculators_states import main as import_main
from tests.conftest import base_args, tiny_tokenizer

TARGET_LAYER_IDS = [1, 2, 3]  # vLLM launched with --target-layer-ids 1 2 3 (the default 2, 2, 1 repeats a layer)
MISSING = 7  # a row generation skipped: no file
EAGLE3 = ("recipe=eagle3", "heads.aux_layers=[1,2,3]", "draft_vocab_size=40", "feature_dtype=float32",
          "mixed_precision='no'", "measure_prompts=0")


def needs_speculators():
    return pytest.importorskip("speculators", reason="install with: pip install --no-deps speculators==0.9.0")


def test_pre_tokenized_rows_load_cut_and_split_as_they_are(tmp_path):
    rows = [{"input_ids": [1, 5, 6, 2, 1, 7, 8, 9, 2], "loss_mask": [0, 0, 0, 0, 1, 1, 1, 1, 1]},
            {"input_ids": [1, 5, 2], "loss_mask": [0, 0, 0]},  # nothing to learn: skipped like a reply-less chat
            {"input_ids": [1, 9, 9, 9, 9, 2, 1, 3, 2], "loss_mask": [0, 0, 0, 0, 0, 0, 1, 1, 1]},
            {"input_ids": [1, 4, 2, 1, 3], "loss_mask": [0, 0, 0, 1, 1]}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ds, report = load_conversations(str(path), skip_conversations=1)
    assert (report.read, report.kept, report.skipped_no_assistant) == (4, 2, 1)
    assert ds["input_ids"] == [rows[2]["input_ids"], rows[3]["input_ids"]]
    cut = tokenize_dataset(ds.add_column("sample", [2, 3]), tiny_tokenizer(), max_length=6)
    # Row 2's loss tokens all lie past 6 tokens: dropped; row 3 fits whole. Other columns ride along.
    assert cut["input_ids"] == [rows[3]["input_ids"]] and cut["sample"] == [3] and cut["truncated"] == [False]
    ds, _ = load_conversations(str(path))
    cut = tokenize_dataset(ds, tiny_tokenizer(), max_length=7)
    assert cut["input_ids"][0] == rows[0]["input_ids"][:7] and cut["truncated"] == [True, True, False]
    assert cut["num_tokens"] == [7, 7, 5]
    train, evaluation = split_by_conversation(cut, 0.3, seed=0)
    assert len(train) + len(evaluation) == 3
    path.write_text(json.dumps({"input_ids": [1, 2, 3], "loss_mask": [0, 1]}) + "\n")
    with pytest.raises(ValueError, match="row 0 has 3 input_ids but 2 loss_mask values"):
        load_conversations(str(path))


@pytest.fixture(scope="module")
def speculators_src(tiny_run_inputs, tmp_path_factory) -> Path:
    """speculators' offline output for the tiny run's conversations: its own preprocessing of pre-tokenized rows
    saved as `prepare-data` saves it, and the hidden-state files the tiny target gives, written as vLLM's
    connector writes them (generating them needs a vLLM server) and checked with speculators' own check; one row's
    file is left out, as a sample generation skipped."""
    needs_speculators()
    target, tokenizer = load_target(str(tiny_run_inputs[0]))
    conversations, _ = load_conversations(str(tiny_run_inputs[1]))
    tokenized = tokenize_dataset(conversations, tokenizer, 96)
    src = write_speculators_states(target, tokenizer, tokenized["input_ids"], tokenized["loss_mask"],
                                   tmp_path_factory.mktemp("speculators") / "prepared",
                                   target_layer_ids=TARGET_LAYER_IDS, dtype=torch.float32)
    (src / "hidden_states" / f"hs_{MISSING}.safetensors").unlink()
    return src


def train_config(tiny_run_inputs, out: Path, *settings: str):
    args = base_args(tiny_run_inputs, out, *settings)
    return load_train_config(None, args)


def run_split(cfg, data: Path):
    """The recipe's train/eval token ids for `data` under `cfg`, as it computes them."""
    _, tokenizer = load_target(cfg.target)
    rows, _ = load_conversations(str(data), max_conversations=cfg.data.max_conversations,
                                 skip_conversations=cfg.data.skip_conversations)
    train, evaluation = split_by_conversation(tokenize_dataset(rows, tokenizer, cfg.data.max_length),
                                              cfg.data.eval_fraction, cfg.seed)
    return train["input_ids"], evaluation.select(range(min(len(evaluation), cfg.data.max_eval_conversations)))[
        "input_ids"]


@pytest.mark.interop
@pytest.mark.parametrize(("settings", "aux", "tol"), [
    (EAGLE3, (1, 2, 3), 1e-4),
    (("recipe=eagle", "heads.aux_layers=[2]", "feature_dtype=bfloat16"), (2,), 1.6e-2),  # a subset, in bf16
    (("recipe=eagle", "feature_dtype=float32"), (), 1e-4),  # the last layer alone
], ids=["all-layers", "subset-bf16", "last-only"])
def test_imported_features_equal_our_cache_of_the_same_tokens(speculators_src, tiny_run_inputs, tmp_path, settings,
                                                              aux, tol):
    cfg = train_config(tiny_run_inputs, tmp_path / "run", *settings, "data.max_length=40")  # some rows cut
    done = import_speculators_states(speculators_src, tmp_path / "imported", cfg, target_layer_ids=TARGET_LAYER_IDS)
    assert done.aux_layers == aux and done.missing == (MISSING,) and done.samples == 47
    rows = [json.loads(line) for line in done.data.read_text().splitlines()]
    src = datasets.load_from_disk(str(speculators_src)).with_format(None)
    assert len(rows) == 47 and rows[MISSING]["input_ids"] == src[MISSING + 1]["input_ids"]
    assert [r["loss_mask"] for r in rows[:MISSING]] == src["loss_mask"][:MISSING]

    target, _ = load_target(cfg.target)
    for name, ids in zip(("train", "eval"), run_split(cfg, done.data)):
        assert any(len(x) == 40 for x in ids) and len(ids) > 1
        imported = FeatureCache(done.features / name)
        index = json.loads((done.features / name / "index.json").read_text())
        assert index["fingerprint"] == fingerprint(ids, cfg.target) and index["aux_layers"] == list(aux)
        own = FeatureCache(write_feature_cache(target, ids, tmp_path / "own" / name, target_name=cfg.target,
                                               dtype=cfg.feature_dtype, aux_layers=aux))
        assert len(imported) == len(own) == len(ids)
        for k in range(len(ids)):
            assert imported[k].dtype == own[k].dtype and imported[k].shape == (len(ids[k]), 64 * (len(aux) + 1))
            torch.testing.assert_close(imported[k].float(), own[k].float(), atol=tol, rtol=tol)


def broken_copy(src: Path, tmp_path: Path, index: int, change) -> Path:
    """A copy of the speculators output whose hs_<index> file `change` rewrote (given its path and tensors)."""
    dst = tmp_path / "broken"
    shutil.copytree(src, dst)
    path = dst / "hidden_states" / f"hs_{index}.safetensors"
    change(path, load_file(path))
    return dst


def truncate(path: Path, tensors):
    path.write_bytes(path.read_bytes()[:-40])


def other_tokens(path: Path, tensors):
    tensors["token_ids"] = tensors["token_ids"].roll(1)
    save_file(tensors, path)


def without_last_layer(path: Path, tensors):  # vLLM launched with --no-include-last-layer
    tensors["hidden_states"] = tensors["hidden_states"][:, :3].contiguous()
    save_file(tensors, path)


def not_finite(path: Path, tensors):
    tensors["hidden_states"][2, 1, 5] = float("nan")
    save_file(tensors, path)


@pytest.mark.interop
@pytest.mark.parametrize(("index", "change", "message"), [
    (3, truncate, r"1 hidden-state file\(s\) .* cannot be read, first hs_3\.safetensors"),
    (5, other_tokens, r"hs_5\.safetensors does not hold row 5 of .*Token ids don't match"),
    (0, without_last_layer, r"hs_0\.safetensors holds hidden states of shape \[\d+, 3, 64\] .*missing layer"),
    (9, not_finite, r"hs_9\.safetensors does not hold row 9 of .*non-finite"),
], ids=["corrupt", "token-mismatch", "missing-layer", "not-finite"])
def test_a_broken_file_is_refused_by_name(speculators_src, tiny_run_inputs, tmp_path, index, change, message):
    src = broken_copy(speculators_src, tmp_path, index, change)
    cfg = train_config(tiny_run_inputs, tmp_path / "run", *EAGLE3)
    with pytest.raises(ValueError, match=message):
        import_speculators_states(src, tmp_path / "imported", cfg, target_layer_ids=TARGET_LAYER_IDS)
    assert not (tmp_path / "imported" / "data.jsonl").exists()  # nothing a run could take for a finished import


@pytest.mark.interop
def test_fp8_files_of_the_fp8_backend_import_dequantised(speculators_src, tiny_run_inputs, tmp_path):
    from hs_connectors.fp8_utils import SCALES_KEY, quantize_tensor_to_fp8

    fp8 = tmp_path / "fp8"
    shutil.copytree(speculators_src, fp8)
    for path in (fp8 / "hidden_states").glob("hs_*.safetensors"):  # as its FP8 connector writes them
        tensors = load_file(path)
        tensors["hidden_states"], tensors[SCALES_KEY] = quantize_tensor_to_fp8(tensors["hidden_states"])
        save_file(tensors, path)
    cfg = train_config(tiny_run_inputs, tmp_path / "run", *EAGLE3)
    plain = import_speculators_states(speculators_src, tmp_path / "plain", cfg, target_layer_ids=TARGET_LAYER_IDS)
    done = import_speculators_states(fp8, tmp_path / "imported", cfg, target_layer_ids=TARGET_LAYER_IDS)
    for name in ("train", "eval"):
        a, b = FeatureCache(done.features / name), FeatureCache(plain.features / name)
        for k in range(len(b)):
            error = float((a[k] - b[k]).norm() / b[k].norm())
            assert 0 < error < 0.08, (name, k, error)  # 3 mantissa bits, one scale per token


@pytest.mark.interop
def test_layers_the_heads_read_but_vllm_did_not_extract_are_refused(speculators_src, tiny_run_inputs, tmp_path):
    cfg = train_config(tiny_run_inputs, tmp_path / "run", *EAGLE3)
    with pytest.raises(ValueError, match=r"heads read target layer\(s\) \[1\] but vLLM extracted only \[2, 3\]"):
        import_speculators_states(speculators_src, tmp_path / "imported", cfg, target_layer_ids=[2, 3])
    with pytest.raises(ValueError, match=r"within \[0, 4\] for a 4-layer target, --target-layer-ids gives \[2, 7, 4\]"):
        import_speculators_states(speculators_src, tmp_path / "imported", cfg, target_layer_ids=[2, 7])
    with pytest.raises(ValueError, match=r"the default 2, L//2, L-3 gives \[2, 2, 1, 4\]"):
        import_speculators_states(speculators_src, tmp_path / "imported", cfg)


@pytest.mark.interop
def test_without_speculators_the_import_says_how_to_install_it(speculators_src, tiny_run_inputs, tmp_path,
                                                               monkeypatch):
    monkeypatch.setitem(sys.modules, "speculators.data_generation", None)  # as if the package were absent
    cfg = train_config(tiny_run_inputs, tmp_path / "run", *EAGLE3)
    with pytest.raises(ValueError, match=r"speculators is not installed .*pip install --no-deps speculators"):
        import_speculators_states(speculators_src, tmp_path / "imported", cfg, target_layer_ids=TARGET_LAYER_IDS)


def train_losses(out: Path) -> dict[int, float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.interop
def test_a_run_on_imported_states_trains_like_a_run_on_our_cache(speculators_src, tiny_run_inputs, tmp_path, capsys):
    steps = ("max_steps=6", "save_every=6", "eval_every=6")
    settings = [*base_args(tiny_run_inputs, tmp_path / "unused", *EAGLE3)]
    assert import_main([str(speculators_src), "--output", str(tmp_path / "imported"), *settings,
                        "--target-layer-ids", *map(str, TARGET_LAYER_IDS)]) == 0
    command = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert command[:3] == ["python", "-m", "specheads.train"]
    imported = command[-3:]  # after the run's own settings, so they win
    assert [a.split("=")[0] for a in imported] == ["data.source", "features", "feature_cache_dir"]
    stamps = {p: p.stat().st_mtime_ns for p in (tmp_path / "imported" / "features").glob("*/index.json")}
    assert len(stamps) == 2

    assert train_main([*command[3:], f"output_dir={tmp_path / 'from-speculators'}", *steps]) == 0
    # The run read the imported caches (its fingerprints matched) instead of computing its own.
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    assert not (tmp_path / "from-speculators" / "features").exists()

    ours = base_args(tiny_run_inputs, tmp_path / "ours", *EAGLE3, imported[0], "features=offline", *steps)
    assert train_main(ours) == 0
    assert (tmp_path / "ours" / "features" / "train" / "index.json").is_file()
    a, b = train_losses(tmp_path / "from-speculators"), train_losses(tmp_path / "ours")
    assert list(a) == list(b) == list(range(1, 7))
    assert a == pytest.approx(b, rel=1e-4), (a, b)
    assert a[6] != a[1]  # it trained
