"""Acceptance diagnosis: where, and on what, drafts get rejected.

`RejectionLog` is a speculation policy (`adaptive.py`) that drafts as the one it wraps says and, for every verified
step that drafted anything, records where the draft stopped being accepted: the first rejected draft token (the
last accepted node's most probable child, or its first when the proposer gives no estimates), the token the
target put there (the step's bonus token) and the draft position (accepted + 1). A step whose accepted path ran to
the end of its branch rejected nothing; it is recorded at position 0 ("the draft ran out"). It also counts the
accepted draft tokens, so each target token gets an acceptance rate. `summarise` aggregates by position, by the
target token's class (`specheads.token_classes`) and by category; its rows sum to the step counts.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field

from specheads.inference.engine.speculation import AlwaysSpeculate, RowState, Speculation
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult
from specheads.token_classes import TOKEN_CLASSES, TokenClasses

RAN_OUT = 0  # the position of a step that rejected nothing: its accepted path reached the end of its branch


@dataclass(frozen=True)
class Rejection:
    """One verified step that drafted something."""

    category: str
    position: int  # the first rejected draft's depth (accepted + 1); RAN_OUT when nothing was rejected
    draft_token: int  # the first rejected draft token (-1 when nothing was rejected)
    target_token: int  # the token the target put at that position (the step's bonus token)


@dataclass
class RejectionLog:
    """Drafts as `inner` says; records each drafted step's first rejection (module doc). Set `category` before each
    generation to attribute its steps."""

    inner: Speculation = field(default_factory=AlwaysSpeculate)
    category: str = ""
    steps: list[Rejection] = field(default_factory=list)
    accepted: Counter = field(default_factory=Counter)  # (category, token) -> accepted draft tokens

    def clear(self) -> None:
        """Forget what was recorded (e.g. a warm-up's steps)."""
        self.steps.clear()
        self.accepted.clear()

    def enabled(self, batch: int) -> bool:
        return self.inner.enabled(batch)

    def start(self, row: RowState) -> None:
        self.inner.start(row)

    def depth(self, row: RowState, batch: int) -> int | None:
        return self.inner.depth(row, batch)

    def observe(self, row: RowState, batch: int, tree: DraftTree, result: VerifyResult) -> None:
        self.inner.observe(row, batch, tree, result)
        if tree.num_drafted == 0:
            return  # a plain step drafted nothing to reject
        tokens = result.tokens.tolist()
        for token in tokens[:-1]:
            self.accepted[self.category, token] += 1
        last = int(result.path[-1])
        children = (tree.parents.cpu() == last).nonzero().flatten()
        if children.numel() == 0:
            self.steps.append(Rejection(self.category, RAN_OUT, -1, tokens[-1]))
            return
        if tree.accept_probs is not None:
            child = int(children[int(tree.accept_probs[children].argmax())])
        else:
            child = int(children[0])
        self.steps.append(Rejection(self.category, result.num_accepted + 1, int(tree.tokens[child]), tokens[-1]))


@dataclass(frozen=True)
class DiagnosisRow:
    """Steps of one category whose draft stopped at one position on one class of target token."""

    category: str
    position: int
    target_class: str
    steps: int


@dataclass(frozen=True)
class TokenRejections:
    """One target token: how often a draft was rejected in its place, and accepted as it."""

    token: int
    target_class: str
    rejected: int
    accepted: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / max(self.accepted + self.rejected, 1)


@dataclass(frozen=True)
class Diagnosis:
    rows: list[DiagnosisRow]  # (category, position, class) -> steps; they sum to `steps`
    steps: int
    stopped_on: dict[str, float]  # class -> share of steps whose first rejection was in the place of such a token
    by_position: dict[int, int]  # position -> steps (RAN_OUT: nothing rejected)
    most_rejected: list[TokenRejections]
    # class -> accepted drafts in the place of such tokens over those and the rejected ones (classes drafted at only)
    acceptance: dict[str, float]

    def to_json(self) -> dict:
        return {"steps": self.steps, "stopped_on": self.stopped_on, "acceptance": self.acceptance,
                "by_position": self.by_position,
                "rows": [asdict(r) for r in self.rows],
                "most_rejected": [asdict(t) | {"acceptance_rate": t.acceptance_rate} for t in self.most_rejected]}


def summarise(log: RejectionLog, classes: TokenClasses, top: int = 10) -> Diagnosis:
    """Aggregate a log: rows by (category, position, target class), the share of steps stopped on each class, the
    acceptance rate of each class, steps by position, and the `top` most often rejected target tokens with their
    acceptance rates."""
    names = classes.names([s.target_token for s in log.steps]) if log.steps else []
    rows = Counter((s.category, s.position, name) for s, name in zip(log.steps, names))
    rejected = [(s, name) for s, name in zip(log.steps, names) if s.position != RAN_OUT]
    stopped = Counter(name for _, name in rejected)
    n = len(log.steps)
    by_token = Counter(s.target_token for s, _ in rejected)
    accepted = Counter()
    for (_, token), count in log.accepted.items():
        accepted[token] += count
    most = [TokenRejections(token, classes.names([token])[0], count, accepted[token])
            for token, count in by_token.most_common(top)]
    accepted_by_class = Counter()
    if accepted:
        for token, name in zip(accepted, classes.names(list(accepted))):
            accepted_by_class[name] += accepted[token]
    tried = {k: accepted_by_class[k] + stopped[k] for k in TOKEN_CLASSES}
    return Diagnosis(
        rows=[DiagnosisRow(c, p, k, v) for (c, p, k), v in sorted(rows.items())], steps=n,
        stopped_on={k: stopped[k] / max(n, 1) for k in TOKEN_CLASSES},
        by_position=dict(sorted(Counter(s.position for s in log.steps).items())), most_rejected=most,
        acceptance={k: accepted_by_class[k] / tried[k] for k in TOKEN_CLASSES if tried[k]})


def by_category(diagnosis: Diagnosis) -> dict[str, tuple[int, dict[str, float], float]]:
    """Per category: its drafting steps, the share of them stopped on each class, and the share that ran out."""
    out: dict[str, tuple[int, dict[str, float], float]] = {}
    for category in sorted({r.category for r in diagnosis.rows}):
        rows = [r for r in diagnosis.rows if r.category == category]
        steps = sum(r.steps for r in rows)
        shares = {k: sum(r.steps for r in rows if r.target_class == k and r.position != RAN_OUT) / steps
                  for k in TOKEN_CLASSES}
        out[category] = (steps, shares, sum(r.steps for r in rows if r.position == RAN_OUT) / steps)
    return out


def diagnosis_markdown(summaries: dict[str, Diagnosis], decode) -> str:
    """The tables of a diagnosed run: per method the share of steps that stopped on each class and the steps by
    position, then each method's most rejected target tokens (`decode(id)` shows them)."""
    lines = ["## Where drafts are rejected", "",
             "Share of drafting steps whose first rejected draft stood in the place of a target token of each class "
             "(the rest ran out of draft):", "",
             "| method | steps | " + " | ".join(TOKEN_CLASSES) + " | ran out |",
             "|---|---|" + "---|" * (len(TOKEN_CLASSES) + 1)]
    for method, d in summaries.items():
        ran_out = d.by_position.get(RAN_OUT, 0) / max(d.steps, 1)
        lines.append(f"| {method} | {d.steps} | " + " | ".join(f"{d.stopped_on[k]:.2f}" for k in TOKEN_CLASSES)
                     + f" | {ran_out:.2f} |")
    lines += ["", "Acceptance rate by class (accepted drafts in the place of such tokens over accepted and rejected; "
              "- where nothing was drafted):", "", "| method | " + " | ".join(TOKEN_CLASSES) + " |",
              "|---|" + "---|" * len(TOKEN_CLASSES)]
    for method, d in summaries.items():
        lines.append(f"| {method} | " + " | ".join(_rate(d.acceptance.get(k)) for k in TOKEN_CLASSES) + " |")
    lines += ["", "Share of drafting steps stopped on each class, by category:", "",
              "| method | category | steps | " + " | ".join(TOKEN_CLASSES) + " | ran out |",
              "|---|---|---|" + "---|" * (len(TOKEN_CLASSES) + 1)]
    for method, d in summaries.items():
        for category, (steps, shares, ran_out) in by_category(d).items():
            lines.append(f"| {method} | {category} | {steps} | " + " | ".join(f"{shares[k]:.2f}" for k in TOKEN_CLASSES)
                         + f" | {ran_out:.2f} |")
    deepest = max((p for d in summaries.values() for p in d.by_position), default=0)
    lines += ["", "Steps by the position of the first rejected draft:", "",
              "| method | " + " | ".join(str(p) for p in range(1, deepest + 1)) + " |",
              "|---|" + "---|" * deepest]
    for method, d in summaries.items():
        lines.append(f"| {method} | " + " | ".join(str(d.by_position.get(p, 0)) for p in range(1, deepest + 1)) + " |")
    lines += ["",
              "Most rejected target tokens (acceptance rate: accepted drafts of the token over accepted and rejected):",
              "", "| method | token | class | rejected | accepted | acceptance rate |", "|---|---|---|---|---|---|"]
    for method, d in summaries.items():
        for t in d.most_rejected:
            lines.append(f"| {method} | `{decode(t.token)!r}` | {t.target_class} | {t.rejected} | {t.accepted} | "
                         f"{t.acceptance_rate:.2f} |")
    return "\n".join(lines) + "\n"


def _rate(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def plot_diagnosis(summaries: dict[str, Diagnosis], path) -> None:
    """Two bar charts by token class, a bar per method: the acceptance rate, and the share of drafting steps whose
    first rejection stood in the place of such a token."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summaries = {m: d for m, d in summaries.items() if d.steps} or summaries  # methods that drafted
    fig, axes = plt.subplots(1, 2, figsize=(min(16.0, max(10.0, 0.5 * len(TOKEN_CLASSES) * len(summaries))), 4.5))
    width = 0.8 / max(len(summaries), 1)
    panels = ((axes[0], lambda d, k: d.acceptance.get(k, 0.0), "acceptance rate", "Drafts accepted, by token class"),
              (axes[1], lambda d, k: d.stopped_on[k], "share of drafting steps stopped here",
               "First rejected draft, by the class of the target's token"))
    for ax, value, ylabel, title in panels:
        for i, (method, d) in enumerate(summaries.items()):
            ax.bar([c + i * width for c in range(len(TOKEN_CLASSES))], [value(d, k) for k in TOKEN_CLASSES],
                   width=width, label=method)
        ax.set_xticks([c + 0.4 - width / 2 for c in range(len(TOKEN_CLASSES))], TOKEN_CLASSES, fontsize=8)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
    handles, labels = axes[0].get_legend_handles_labels()  # below the panels: method names are long
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 2), fontsize=7)
    fig.tight_layout(rect=(0, 0.06 * ((len(labels) + 1) // 2), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def diagnosis_tables(summaries: dict[str, Diagnosis], decode) -> dict[str, tuple[list[str], list[list]]]:
    """The diagnosis as named tables (columns, rows): the shares stopped on each class, the acceptance rate of each
    class, the rows by category, position and class, and the most rejected tokens."""
    stopped = [[m, d.steps, *(d.stopped_on[k] for k in TOKEN_CLASSES), d.by_position.get(RAN_OUT, 0) / max(d.steps, 1)]
               for m, d in summaries.items()]
    rows = [[m, r.category, r.position, r.target_class, r.steps] for m, d in summaries.items() for r in d.rows]
    tokens = [[m, decode(t.token), t.target_class, t.rejected, t.accepted, t.acceptance_rate]
              for m, d in summaries.items() for t in d.most_rejected]
    return {"diagnosis_stopped_on": (["method", "steps", *TOKEN_CLASSES, "ran_out"], stopped),
            "diagnosis_acceptance": (["method", *TOKEN_CLASSES],
                                     [[m, *(d.acceptance.get(k) for k in TOKEN_CLASSES)]
                                      for m, d in summaries.items()]),
            "diagnosis_rows": (["method", "category", "position", "target_class", "steps"], rows),
            "diagnosis_tokens": (["method", "token", "class", "rejected", "accepted", "acceptance_rate"], tokens)}
