"""One question's answer as `specheads generate` gives it: its turns answered in order, each after the method's
own earlier answers, every turn drawing from the stream of (seed, question_id, turn, sample)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from transformers import PreTrainedTokenizerBase

from specheads.inference.engine.constraint import GrammarConstraint
from specheads.inference.engine.engine import Engine, GenerationResult
from specheads.inference.engine.sampling import SamplingParams
from specheads.target import render_chat


def answer(engine: Engine, tokenizer: PreTrainedTokenizerBase, turns: Sequence[str], *, num_turns: int,
           question_id: int | str | None, sample: int, max_new_tokens: int, sampling: SamplingParams,
           stop_token_ids: Sequence[int], on_tokens: Callable[[list[int]], None] | None = None,
           constraint: Callable[[], GrammarConstraint | None] | None = None,
           ) -> tuple[GenerationResult, str]:
    """The last of the first `num_turns` turns' results and its text; `on_tokens` gets that turn's tokens as they
    come (earlier turns are history, not shown). `constraint` makes each turn's grammar (structured outputs)."""
    history: list[str] = []
    result = None
    for i in range(num_turns):
        ids = render_chat(tokenizer, list(turns[: i + 1]), history)
        result = engine.generate(ids, max_new_tokens=max_new_tokens,
                                 sampling=sampling.for_draw(question_id, i + 1, sample),
                                 stop_token_ids=stop_token_ids, on_tokens=on_tokens if i == num_turns - 1 else None,
                                 constraint=constraint() if constraint is not None else None)
        history.append(tokenizer.decode(result.output_ids, skip_special_tokens=True))
    assert result is not None, "num_turns >= 1"
    return result, history[-1]


def answer_row(question_id: int | str | None, sample: int, result: GenerationResult, text: str) -> dict:
    """One line of `specheads generate --output`."""
    return {"question_id": question_id, "sample": sample, "output_ids": result.output_ids, "text": text,
            "stats": result.stats.to_dict()}
