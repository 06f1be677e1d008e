"""One request's speculative-decoding acceptance, as the server reports it in the response's `usage`
(`usage.spec_decode_metrics`), after vLLM's `--per-request-spec-decode-metrics` and SGLang's per-request
`spec_accept_length`.

The numbers come straight from the request's `GenerationStats`. Field names follow vLLM's per-request report where it
has one:

- `mean_acceptance_length`: vLLM's definition, 1 + accepted / `num_spec_steps`, where a spec step is a verify step
  that checked at least one drafted token (steps the speculation policy made plain, and the prefill, are not spec
  steps); 1.0 when no step drafted.
- `tau`: our acceptance length τ, tokens committed per target forward (accepted + 1, the bonus included) averaged
  over every forward of the request, the prefill and plain steps included: (accepted + `num_steps`) / `num_steps`.
  It equals `mean_acceptance_length` when every step after the prefill drafted, except that τ also counts the
  prefill forward and its one token, which pulls it towards 1 on short answers.
- `draft_acceptance_rate`: accepted / drafted tokens (a tree's every node counts as drafted, so wide trees have low
  rates at the same acceptance length).
- `acceptance_histogram[j]`: spec steps that accepted exactly j drafted tokens (dense, j = 0 .. the deepest).
- detailed only: `num_accepted_tokens_per_pos[i]`, spec steps that accepted at least i + 1 tokens (the counter of
  the same name on /metrics), and `acceptance_rate_per_position[i]` = that over `num_spec_steps` (vLLM's per-position
  acceptance rate).

SGLang's `spec_accept_length` is completion tokens / verify forwards, where its verify forwards exclude the prefill
but its completion tokens include the prefill's token: it reads a little above both of ours on short answers.
"""

from __future__ import annotations

from specheads.inference.engine.stats import GenerationStats

LEVELS = ("summary", "detailed")


def check_level(level: str | None) -> None:
    if level is not None and level not in LEVELS:
        raise ValueError(f"per-request spec decode metrics must be one of {', '.join(LEVELS)} (or off), got {level!r}")


def acceptance_histogram(stats: GenerationStats) -> list[int]:
    """[j]: spec steps that accepted exactly j drafted tokens (steps without drafts accept none and are not counted)."""
    at_least = [stats.draft_steps, *stats.accepted_at_least]  # [j]: spec steps that accepted >= j tokens
    return [at_least[j] - (at_least[j + 1] if j + 1 < len(at_least) else 0) for j in range(len(at_least))]


def spec_decode_metrics(stats: GenerationStats, level: str) -> dict:
    """The request's report at `level` ("summary" or "detailed")."""
    check_level(level)
    spec_steps = stats.draft_steps
    report = {
        "mean_acceptance_length": 1.0 + stats.accepted / spec_steps if spec_steps else 1.0,
        "tau": stats.tau,
        "draft_acceptance_rate": stats.acceptance_rate,
        "num_steps": stats.steps,
        "num_spec_steps": spec_steps,
        "num_draft_tokens": stats.drafted,
        "num_accepted_draft_tokens": stats.accepted,
        "acceptance_histogram": acceptance_histogram(stats),
    }
    if level == "detailed":
        report["num_accepted_tokens_per_pos"] = list(stats.accepted_at_least)
        report["acceptance_rate_per_position"] = [n / spec_steps for n in stats.accepted_at_least] if spec_steps else []
    return report


def log_line(request_id: str, stats: GenerationStats) -> str:
    """The request's acceptance in one line (the server logs it at debug level for every request)."""
    m = spec_decode_metrics(stats, "detailed")
    rates = ", ".join(f"{r:.2f}" for r in m["acceptance_rate_per_position"])
    return (f"{request_id}: {stats.new_tokens} tokens in {stats.steps} steps ({m['num_spec_steps']} drafted), "
            f"mean acceptance length {m['mean_acceptance_length']:.3f}, tau {m['tau']:.3f}, acceptance rate "
            f"{m['draft_acceptance_rate']:.3f} ({stats.accepted}/{stats.drafted}), per position [{rates}], "
            f"finish {stats.finish_reason}")
