import pytest
import torch

from specheads.inference.bench.divergence import attach_margins, fp32_margin
from specheads.inference.bench.runner import Record, mark_exactness
from specheads.inference.engine.stats import GenerationStats
from tests.conftest import tiny_model

PROMPT = [5, 17, 9, 30]


def _logits_after(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, -1]


def test_margin_is_the_fp32_logit_gap_where_the_outputs_part():
    model = tiny_model("llama")
    first = int(_logits_after(model, PROMPT).argmax())
    # The reference is the same forward fp32_margin runs (last position only): a full-sequence LM head takes
    # another GEMM kernel, which rounds apart from the one-row product on some CPUs.
    with torch.no_grad():
        row = model(input_ids=torch.tensor([PROMPT + [first]]), logits_to_keep=1).logits[0, -1]
    a, b = row.topk(2).indices.tolist()
    want = float(row[a] - row[b])
    assert want > 0
    assert fp32_margin(model, PROMPT, [first, a, 3], [first, b], 1) == want
    assert fp32_margin(model, PROMPT, [first, b], [first, a, 3], 1) == want  # symmetric
    assert fp32_margin(model, PROMPT, [first, a], [first], 1) is None  # one output stopped: no choice to measure
    with pytest.raises(ValueError, match="float32"):
        fp32_margin(model.to(torch.bfloat16), PROMPT, [first, a], [first, b], 1)


def test_attach_margins_measures_only_divergences_from_the_same_prompt():
    model = tiny_model("llama")
    first = int(_logits_after(model, PROMPT).argmax())
    a, b = _logits_after(model, PROMPT + [first]).topk(2).indices.tolist()

    def rec(method: str, turn: int, prompt: list[int], out: list[int]) -> Record:
        return Record("q1", "writing", turn, method, prompt, out, GenerationStats())

    records = [rec("ar", 1, PROMPT, [first, a]), rec("x", 1, PROMPT, [first, b]),
               rec("ar", 2, PROMPT + [1], [7, 8]), rec("x", 2, PROMPT + [2], [7, 9]),  # turn 2 after a diverged turn 1
               rec("y", 1, PROMPT, [first, a])]
    mark_exactness(records)
    attach_margins(records, model)
    margins = {(r.method, r.turn): r.margin_fp32 for r in records}
    assert margins[("x", 1)] is not None and margins[("x", 1)] >= 0
    assert margins[("x", 2)] is None and margins[("y", 1)] is None and margins[("ar", 1)] is None
