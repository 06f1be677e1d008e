"""Offline features (cached to safetensors shards) give the same batches as online ones."""

from __future__ import annotations

import json

import pytest
import torch

from specheads.train.data import collate
from specheads.train.feature_cache import (
    FeatureCache,
    collate_with_features,
    join_feature_cache,
    length_batches,
    write_feature_cache,
)
from specheads.train.features import batch_features, target_features
from tests.conftest import tiny_model


def examples(n: int = 6):
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(n):
        length = 5 + 3 * i
        out.append({"input_ids": torch.randint(3, 96, (length,), generator=g).tolist(),
                    "loss_mask": [0] * 2 + [1] * (length - 2), "row": i})
    return out


def test_offline_batches_equal_online_batches(tmp_path):
    target = tiny_model("llama")
    ex = examples()
    write_feature_cache(target, [e["input_ids"] for e in ex], tmp_path / "cache", target_name="tiny",
                        dtype="float32", shard_tokens=20)  # small shards: examples span several files
    cache = FeatureCache(tmp_path / "cache")
    assert len(list((tmp_path / "cache").glob("shard_*.safetensors"))) > 1
    batch = [ex[1], ex[4], ex[2]]
    offline = collate_with_features(batch, 0, cache)
    online = collate(batch, 0)
    for key in ("input_ids", "attention_mask", "loss_mask"):
        assert torch.equal(offline[key], online[key])
    feats = target_features(target, online["input_ids"], online["attention_mask"])
    valid = online["attention_mask"].bool()
    torch.testing.assert_close(offline["features"][valid], feats[valid], atol=1e-5, rtol=1e-5)


def test_cache_is_reused_for_the_same_data_and_rebuilt_for_other_data(tmp_path):
    target = tiny_model("llama")
    ids = [e["input_ids"] for e in examples(3)]
    write_feature_cache(target, ids, tmp_path, target_name="tiny", dtype="bfloat16")
    stamp = (tmp_path / "index.json").stat().st_mtime_ns
    write_feature_cache(target, ids, tmp_path, target_name="tiny", dtype="bfloat16")
    assert (tmp_path / "index.json").stat().st_mtime_ns == stamp
    write_feature_cache(target, ids[:2], tmp_path, target_name="tiny", dtype="bfloat16")
    assert len(FeatureCache(tmp_path)) == 2
    assert FeatureCache(tmp_path)[0].dtype == torch.bfloat16


def test_missing_cache_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no feature cache"):
        FeatureCache(tmp_path / "nothing")


def test_aux_layer_features_are_the_hidden_states_and_cache_like_online(tmp_path):
    target = tiny_model("llama")
    ex = examples()
    batch = collate([ex[0], ex[3]], 0)
    feats = target_features(target, batch["input_ids"], batch["attention_mask"], aux_layers=(1, 3))
    full = target(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_hidden_states=True)
    hs = full.hidden_states
    assert feats.shape[-1] == 3 * hs[0].shape[-1]
    valid = batch["attention_mask"].bool()
    want = torch.cat([hs[1], hs[3], hs[-1]], dim=-1)
    torch.testing.assert_close(feats[valid], want[valid], atol=1e-5, rtol=1e-5)
    # The last H columns are what the LM head reads: the plain features.
    torch.testing.assert_close(feats[..., -64:], target_features(target, batch["input_ids"], batch["attention_mask"]))

    write_feature_cache(target, [e["input_ids"] for e in ex], tmp_path, target_name="tiny", dtype="float32",
                        aux_layers=(1, 3))
    cache = FeatureCache(tmp_path)
    assert cache.aux_layers == [1, 3] and cache.width == 192
    offline = collate_with_features([ex[0], ex[3]], 0, cache)
    # cached in other batches than this one's: equal up to fp32 rounding of products of other shapes
    torch.testing.assert_close(offline["features"][valid], feats[valid], atol=1e-4, rtol=1e-4)
    # A run that wants only the last layer (Medusa) reads its columns from the same cache ...
    torch.testing.assert_close(batch_features(target, offline)[valid], feats[..., -64:][valid], atol=1e-5, rtol=1e-5)
    # ... but heads that want other aux layers are told to rebuild it.
    with pytest.raises(ValueError, match="holds 3 layer"):
        batch_features(target, offline, aux_layers=(2,))


def test_cache_without_aux_layers_is_rebuilt_for_heads_that_need_them(tmp_path):
    target = tiny_model("llama")
    ids = [e["input_ids"] for e in examples(3)]
    write_feature_cache(target, ids, tmp_path, target_name="tiny", dtype="float32")
    write_feature_cache(target, ids, tmp_path, target_name="tiny", dtype="float32", aux_layers=(2,))
    assert FeatureCache(tmp_path).width == 128
    stamp = (tmp_path / "index.json").stat().st_mtime_ns
    write_feature_cache(target, ids, tmp_path, target_name="tiny", dtype="float32")  # last layer only: reused
    assert (tmp_path / "index.json").stat().st_mtime_ns == stamp


def test_length_batches_cover_every_example_once_within_the_token_budget():
    lengths = [5, 40, 12, 12, 7, 100, 3, 40]
    groups = length_batches(lengths, batch_tokens=48)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    assert groups[0] == [5]  # longer than the budget: alone, and first
    for g in groups:
        assert len(g) == 1 or len(g) * max(lengths[i] for i in g) <= 48


def test_batched_caching_gives_each_example_its_own_features(tmp_path):
    target = tiny_model("llama")
    ids = [e["input_ids"] for e in examples()]
    write_feature_cache(target, ids, tmp_path / "one", target_name="tiny", dtype="float32", batch_tokens=1)
    write_feature_cache(target, ids, tmp_path / "many", target_name="tiny", dtype="float32", batch_tokens=64,
                        shard_tokens=30)
    one, many = FeatureCache(tmp_path / "one"), FeatureCache(tmp_path / "many")
    for i, x in enumerate(ids):
        assert many[i].shape == (len(x), 64)
        # the padding beside it changes nothing but fp32 rounding in products of other shapes
        torch.testing.assert_close(many[i], one[i], atol=1e-4, rtol=1e-4)


def test_parts_written_apart_join_into_the_cache_one_writer_writes(tmp_path):
    target = tiny_model("llama")
    ids = [e["input_ids"] for e in examples(7)]
    write_feature_cache(target, ids, tmp_path / "one", target_name="tiny", dtype="float32", aux_layers=(1, 2))
    for rank in range(3):  # as three processes would, each its own examples rank, rank + 3, ...
        write_feature_cache(target, ids, tmp_path / "three", target_name="tiny", dtype="float32", aux_layers=(1, 2),
                            part=(rank, 3))
    assert not (tmp_path / "three" / "index.json").is_file()  # incomplete until joined
    assert {p.name for p in (tmp_path / "three").glob("shard_*")} == {f"shard_p{r}_00000.safetensors"
                                                                       for r in range(3)}
    join_feature_cache(tmp_path / "three", 3)
    one, three = FeatureCache(tmp_path / "one"), FeatureCache(tmp_path / "three")
    assert len(three) == 7 and not list((tmp_path / "three").glob("index.part*"))
    for i in range(7):  # batches of other rows round differently in fp32: equal up to that
        torch.testing.assert_close(three[i], one[i], atol=1e-5, rtol=1e-5)
    # the joined index serves every process afterwards, whatever the split
    write_feature_cache(target, ids, tmp_path / "three", target_name="tiny", dtype="float32", aux_layers=(1, 2),
                        part=(1, 2))
    assert not (tmp_path / "three" / "index.part1.json").is_file()
    # a part left by a run split otherwise (two processes, now three) holds other examples: written again
    write_feature_cache(target, ids, tmp_path / "stale", target_name="tiny", dtype="float32", part=(0, 2))
    write_feature_cache(target, ids, tmp_path / "stale", target_name="tiny", dtype="float32", part=(0, 3))
    assert json.loads((tmp_path / "stale" / "index.part0.json").read_text())["part"] == [0, 3]
    with pytest.raises(ValueError, match="part 3 of 3 does not exist"):
        write_feature_cache(target, ids, tmp_path / "x", target_name="tiny", part=(3, 3))
