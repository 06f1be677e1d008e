"""Offline features (cached to safetensors shards) give the same batches as online ones."""

from __future__ import annotations

import pytest
import torch

from specheads.train.data import collate
from specheads.train.feature_cache import FeatureCache, collate_with_features, write_feature_cache
from specheads.train.features import target_features
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
