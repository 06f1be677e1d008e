import json
import time

import pytest
import torch

from specheads import gemm_choice
from specheads.gemm_choice import BUCKETS, KERNELS, bucket, describe, measure_plan, packing_available, plans, run_kernel


def test_a_row_count_runs_the_plan_of_the_smallest_bucket_that_holds_it():
    assert [bucket(m) for m in (1, 2, 3, 4, 5, 16, 17, 64, 65, 1000)] == [0, 1, 2, 2, 3, 4, 5, 6, 6, 6]


def test_describe_names_each_run_of_rows_by_kernel():
    plan_of = {(576, 1536): ("row", "transposed", "transposed", "packed", "packed", "packed", "packed"),
               (8, 4): ("packed",) * len(BUCKETS)}
    assert describe(plan_of) == ("8x4: rows 1+ packed\n"
                                 "576x1536: rows 1 row, 2-4 transposed, 5+ packed")


@pytest.mark.parametrize("kernel", KERNELS)
def test_every_kernel_computes_the_linear_product(kernel):
    if kernel == "packed" and not packing_available(torch.float32):
        pytest.skip("oneDNN packs no fp32 weights on this CPU")
    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(24, 16, generator=gen), torch.randn(24, generator=gen)
    packed = gemm_choice.pack(weight) if kernel == "packed" else None
    for shape in ((1, 16), (3, 16), (2, 5, 16)):
        x = torch.randn(*shape, generator=gen)
        for b in (None, bias):
            got = run_kernel(kernel, x, weight, b, packed)
            assert got.shape == (*shape[:-1], 24) and got.is_contiguous()
            torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_measuring_times_every_candidate_and_keeps_the_fastest():
    plan, seconds = measure_plan((32, 16), torch.float32, reps=1)
    assert len(plan) == len(BUCKETS) and set(plan) <= set(KERNELS)
    assert seconds["transposed"][0] is None  # one row runs F.linear either way: not a candidate
    for b, kernel in enumerate(plan):
        timed = {k: s[b] for k, s in seconds.items() if s[b] is not None}
        assert timed[kernel] == min(timed.values())
    assert ("packed" in seconds) == packing_available(torch.float32)


class FakeMeasure:
    """Stands in for the timing (which only a quiet machine makes meaningful): counts what it is asked."""

    def __init__(self, plan=("row",) * len(BUCKETS)):
        self.plan, self.calls = plan, []

    def __call__(self, shape, dtype):
        self.calls.append(shape)
        return self.plan, {"row": [1e-3] * len(BUCKETS)}


def test_plans_are_measured_once_per_machine_then_read_back(tmp_path, monkeypatch):
    monkeypatch.setattr(gemm_choice, "_plans", {})
    measure = FakeMeasure(("transposed",) * len(BUCKETS))
    got = plans([(8, 4), (16, 4), (8, 4)], torch.float32, cache_dir=tmp_path, measure=measure)
    assert got == {(8, 4): measure.plan, (16, 4): measure.plan} and sorted(measure.calls) == [(8, 4), (16, 4)]
    (path,) = tmp_path.glob("*.json")
    entries = json.loads(path.read_text())
    assert set(entries) == {"8x4", "16x4"} and entries["8x4"]["plan"] == list(measure.plan)
    assert time.time() - entries["8x4"]["measured_at"] < 60
    plans([(8, 4)], torch.float32, cache_dir=tmp_path, measure=measure)  # this process's own: nothing measured
    monkeypatch.setattr(gemm_choice, "_plans", {})  # a new process reads the machine's cache
    assert plans([(8, 4), (16, 4)], torch.float32, cache_dir=tmp_path, measure=measure)[(8, 4)] == measure.plan
    assert len(measure.calls) == 2
    assert plans([(4, 4)], torch.float32, cache_dir=tmp_path, measure=measure) == {(4, 4): measure.plan}
    assert set(json.loads(path.read_text())) == {"8x4", "16x4", "4x4"}  # added beside the others
    assert not list(tmp_path.glob("*.tmp-*"))


def test_an_old_a_damaged_or_an_unknown_plan_is_measured_again(tmp_path, monkeypatch):
    measure = FakeMeasure()
    monkeypatch.setattr(gemm_choice, "_plans", {})
    plans([(8, 4), (16, 4)], torch.float32, cache_dir=tmp_path, measure=measure)
    (path,) = tmp_path.glob("*.json")
    entries = json.loads(path.read_text())
    entries["8x4"]["measured_at"] -= gemm_choice.MAX_AGE_S + 1
    entries["16x4"]["plan"] = ["simd"] * len(BUCKETS)  # a kernel this version does not know
    path.write_text(json.dumps(entries))
    monkeypatch.setattr(gemm_choice, "_plans", {})
    plans([(8, 4), (16, 4)], torch.float32, cache_dir=tmp_path, measure=measure)
    assert measure.calls[2:] == [(8, 4), (16, 4)]
    path.write_text("{not json")
    monkeypatch.setattr(gemm_choice, "_plans", {})
    assert plans([(8, 4)], torch.float32, cache_dir=tmp_path, measure=measure) == {(8, 4): measure.plan}
    assert measure.calls[4:] == [(8, 4)] and set(json.loads(path.read_text())) == {"8x4"}


def test_plans_depend_on_the_dtype_and_the_threads(monkeypatch):
    key = gemm_choice.machine_key(torch.float32)
    assert gemm_choice.machine_key(torch.bfloat16) != key
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert gemm_choice.machine_key(torch.float32) != key
    finally:
        torch.set_num_threads(threads)
