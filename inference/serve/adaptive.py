"""Adaptive speculation: draft only while it pays on this machine, at this batch size.

A speculative step over a batch of b rows costs `t_spec(b)` and commits τ tokens per row; a plain step costs
`t_plain(b)` and commits one. Speculation pays while τ > t_spec(b) / t_plain(b), the *break-even τ*. At small
batches the verify forward is nearly free (memory-bound) and the break-even sits just above 1 plus the draft's
cost; as the batch grows the forward turns compute-bound, the draft forwards add up row by row, and the break-even
climbs past what any drafter reaches. `specheads calibrate` measures t_plain, t_spec and τ at each batch size for a
target and method on this machine (`SpeculationProfile`, a small JSON), and `AdaptiveSpeculation` reads it and
decides before each step, row by row:

1. above `max_batch`, the largest batch at which the calibrated τ beat the break-even, every row steps plainly;
2. a row whose running τ (an average over its recent steps that were allowed to draft, whether or not the proposer
   found anything to draft) fell below the break-even at the current batch steps plainly for `probe_every` steps,
   then probes with one speculative step;
3. otherwise it drafts, as deep as the observed per-position acceptance pays for: draft level d is kept while the
   share of steps accepting at least d tokens exceeds the cost of one draft level at this batch,
   (break-even - 1) / mean draft depth. Every `probe_every`-th capped step drafts uncapped, so deeper levels keep
   being measured.

A plain step verifies a root-only tree (the proposer still sees the verified tokens through `on_verified`, so it
can draft again later), and which tree is verified never changes which tokens are accepted: every mode is exact
(greedy output equals plain greedy; sampled output follows the target's distribution). The decisions follow the
batch's composition, so a seeded sampled request reproduces its tokens under the same load only.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from specheads.inference.engine.speculation import AlwaysSpeculate, NeverSpeculate, RowState, Speculation
from specheads.inference.engine.tree import DraftTree
from specheads.inference.engine.verifier import VerifyResult

SPECULATION_MODES = ("on", "off", "adaptive")


@dataclass(frozen=True)
class BatchCost:
    """One batch size's step times with every row speculating and with every row plain (medians of run means)."""

    batch: int
    plain_step_s: float
    spec_step_s: float

    @property
    def break_even(self) -> float:
        """The τ at which a speculative step commits tokens as fast as plain steps do."""
        return self.spec_step_s / self.plain_step_s


@dataclass(frozen=True)
class SpeculationProfile:
    """Where speculation pays for one target and method on one machine (`specheads calibrate` writes it)."""

    method: str  # the method and its options, as `methods.method_label` writes them
    machine_key: str  # the target's shapes, dtype, layout, device, threads and software (verify_cost.machine_key)
    machine: str  # the same in words, for people
    # The drafter on the calibration prompts (a row drafts in a batch what it drafts alone, so these hold at any
    # batch size): tokens per row per speculative step (accepted + 1), the share of steps that accepted at least
    # i + 1 tokens, and the mean depth of the drafted trees.
    tau: float
    accept_per_position: tuple[float, ...]
    mean_depth: float
    costs: tuple[BatchCost, ...]  # increasing batch sizes
    created: str = ""

    def __post_init__(self) -> None:
        batches = [c.batch for c in self.costs]
        if not batches or batches != sorted(set(batches)) or batches[0] < 1:
            raise ValueError(f"a speculation profile needs increasing batch sizes >= 1, got {batches}")
        if any(not (c.plain_step_s > 0 and c.spec_step_s > 0) for c in self.costs):
            raise ValueError("step times must be > 0")
        if not (self.tau >= 1 and self.mean_depth >= 0 and all(0 <= s <= 1 for s in self.accept_per_position)):
            raise ValueError("a profile needs tau >= 1, mean_depth >= 0 and acceptance shares in [0, 1]")

    def pays(self, batch: int) -> bool:
        """Whether the calibrated τ beats the break-even at `batch`."""
        return self.tau > self.break_even(batch)

    @property
    def max_batch(self) -> int:
        """The largest calibrated batch at which speculation paid (0: at none)."""
        return max((c.batch for c in self.costs if self.pays(c.batch)), default=0)

    def _at(self, batch: int, value) -> float:
        """`value(cost)` at `batch`: linear between calibrated sizes, the nearest end outside them."""
        costs = self.costs
        if batch <= costs[0].batch:
            return value(costs[0])
        for lo, hi in zip(costs, costs[1:]):
            if batch <= hi.batch:
                w = (batch - lo.batch) / (hi.batch - lo.batch)
                return (1 - w) * value(lo) + w * value(hi)
        return value(costs[-1])

    def break_even(self, batch: int) -> float:
        return self._at(batch, lambda c: c.break_even)

    def level_cost(self, batch: int) -> float:
        """What one draft level costs, in plain steps: the speculative step's extra cost over the mean depth."""
        return (self.break_even(batch) - 1.0) / max(self.mean_depth, 1.0)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str, source: str = "the profile") -> SpeculationProfile:
        try:
            data = json.loads(text)
            costs = tuple(BatchCost(**c) for c in data.pop("costs"))
            shares = tuple(data.pop("accept_per_position"))
            return cls(costs=costs, accept_per_position=shares, **data)
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{source} is not a speculation profile ({err}); write one with `specheads calibrate`") \
                from None

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.to_json() + "\n", encoding="utf-8")
        tmp.replace(path)


def read_profile(path: str | Path) -> SpeculationProfile:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"speculation profile {path} does not exist; write it with `specheads calibrate ... "
                         f"--output {path}`")
    return SpeculationProfile.from_json(path.read_text(encoding="utf-8"), source=str(path))


def check_profile(profile: SpeculationProfile, *, method: str, machine_key: str, source: str = "the profile") -> None:
    """Refuse (naming the fix) a profile measured for another method, target or machine."""
    if profile.method != method:
        raise ValueError(f"{source} was calibrated for method {profile.method!r}, not {method!r}; run `specheads "
                         f"calibrate` with this --method and options")
    if profile.machine_key != machine_key:
        raise ValueError(f"{source} was calibrated for another target, dtype, device, thread count or software "
                         f"({profile.machine}); run `specheads calibrate` again here, with this target")


@dataclass
class AdaptiveSpeculation:
    """`adaptive`: the rules of the module docstring, on a calibrated `SpeculationProfile`."""

    profile: SpeculationProfile
    probe_every: int = 8  # plain steps before a row below break-even probes again; capped steps per uncapped probe
    memory: float = 256.0  # steps the per-position acceptance remembers (an exponential average)
    tau_weight: float = 0.25  # weight of each new step in a row's running τ
    prior_steps: float = 16.0  # how many steps the calibration's per-position acceptance counts for at first
    _reach: list[float] = field(default_factory=list, init=False)  # [d-1]: steps whose tree reached depth d
    _hit: list[float] = field(default_factory=list, init=False)  # [d-1]: those that accepted at least d tokens
    _capped: int = field(default=0, init=False)
    _max_batch: int = field(default=0, init=False)  # the profile's, asked once per row and step

    def __post_init__(self) -> None:
        if self.probe_every < 1:
            raise ValueError(f"probe_every must be >= 1, got {self.probe_every}")
        self._max_batch = self.profile.max_batch
        shares = self.profile.accept_per_position
        self._reach = [self.prior_steps] * len(shares)
        self._hit = [self.prior_steps * s for s in shares]

    def start(self, row: RowState) -> None:
        row.tau = self.profile.tau  # a new row starts from the calibrated τ, until its own steps say otherwise
        row.plain_left = 0

    def enabled(self, batch: int) -> bool:
        return batch <= self._max_batch

    def depth(self, row: RowState, batch: int) -> int | None:
        row.allowed = False
        if not self.enabled(batch):
            return 0
        if row.plain_left > 0:
            row.plain_left -= 1
            return 0
        row.allowed = True
        return self._depth_cap(batch)

    def _depth_cap(self, batch: int) -> int | None:
        """The deepest level whose acceptance share pays for a level at this batch (at least 1); None on the
        periodic uncapped probe or when every measured level pays."""
        cost = self.profile.level_cost(batch)
        cap = 0
        for reach, hit in zip(self._reach, self._hit):
            if reach <= 0 or hit / reach < cost:
                break
            cap += 1
        if cap == len(self._reach):
            return None
        self._capped += 1
        return None if self._capped % self.probe_every == 0 else max(cap, 1)

    def observe(self, row: RowState, batch: int, tree: DraftTree, result: VerifyResult) -> None:
        if not row.allowed:
            return  # a step it made plain says nothing about the drafter
        # A step the proposer left plain counts: the calibration's τ and step times count such steps too, so the
        # running τ and the break-even compare like with like.
        tokens = result.num_accepted + 1
        row.tau = (1 - self.tau_weight) * row.tau + self.tau_weight * tokens
        if row.tau < self.profile.break_even(batch):
            row.plain_left = self.probe_every
        depth = tree.max_depth
        if depth == 0:
            return
        keep = 1.0 - 1.0 / self.memory
        if depth > len(self._reach):
            self._reach += [0.0] * (depth - len(self._reach))
            self._hit += [0.0] * (depth - len(self._hit))
        for d in range(len(self._reach)):
            self._reach[d] *= keep
            self._hit[d] *= keep
            if d < depth:
                self._reach[d] += 1.0
                self._hit[d] += float(d < result.num_accepted)


def speculation_policy(mode: str, profile: SpeculationProfile | None = None) -> Speculation:
    """The policy `mode` names (one of SPECULATION_MODES); `adaptive` needs a profile."""
    if mode == "on":
        return AlwaysSpeculate()
    if mode == "off":
        return NeverSpeculate()
    if mode == "adaptive":
        if profile is None:
            raise ValueError("adaptive speculation needs a calibration: run `specheads calibrate` and pass its JSON "
                             "with --calibration")
        return AdaptiveSpeculation(profile)
    raise ValueError(f"unknown speculation mode {mode!r}; use one of: {', '.join(SPECULATION_MODES)}")
