"""The decoding-strategy protocol: the one seam between the engine and a way of decoding (AR, diffusion, LinearSS,
RecGuide, or one a user registers).

Each engine step, for each decoding request, the engine asks its strategy for a `RoundPlan` given a read-only
`StepView` of the batch and the load. A plan names a `Round` (an object of the strategy's choosing: one of the
generic rounds in `rounds.py`, or the strategy's own) and a block size. The engine groups requests by plan into
batches and hands each `Group` to its round, which runs its forwards through the runner with the services of a
`RoundContext` (batch arrays, page reservation, the forward ledger, and `verified`, which commits the accepted
tokens' pages, tells the strategy (`observe`) and emits the tokens). The round returns the label its wall time is
recorded under (`observe_round`). A strategy keeps what it remembers about a request in `Request.strategy_state`,
an object it sets in `on_admit`; the engine never looks inside.

The engine knows no strategy by name: adding one is a subclass and a `registry.register_strategy` call.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Protocol, Sequence


class RoundKind(enum.StrEnum):
  """Labels of the rounds the library's strategies run: what a round's wall time is recorded under (and what
  RecGuide's cost model prices). str-valued: profiles and calibration tables keep their JSON keys."""
  AR = "ar"
  LINEAR = "linear"
  DIFFUSION = "diffusion"
  OVERLAP = "overlap"  # RecGuide's fused verify + branches, every draft prefetched
  OVERLAP_DRAFT = "overlap_draft"  # the same round when it also ran a draft forward
  SHADOW = "shadow"
  RAGGED = "ragged"  # LinearSS rows at their own blocks and AR rows in one ragged draft + one ragged verify forward


@dataclasses.dataclass(frozen=True)
class StepView:
  """What a strategy may read about the engine when it plans (a snapshot, taken once per step)."""
  step: int  # the engine's step counter: a strategy may decide something once per step by it
  decoding: int  # requests decoding in this step (the load)
  max_batch: int
  max_model_len: int
  max_block: int
  eos_token_ids: frozenset[int]
  # the requests decoding in this step, in planning order: a strategy may plan the step as a whole (the cost of a
  # batch depends on every request's block, not on one request's alone); read-only
  batch: tuple = ()
  # requests admitted and not finished, decoding or still prefilling: the load a choice that lasts beyond this step
  # is made under (a request that prefills this step decodes in the next); 0: unknown, use `decoding`
  running: int = 0
  # the engine runs LinearSS and AR rows as ragged steps (bucketing "ragged"): a step's mixed blocks cost one
  # ragged draft + verify forward, not a batch per block size
  ragged_steps: bool = False


@dataclasses.dataclass(frozen=True)
class RoundPlan:
  """One request's round: which round object runs it, at which block size (1 for AR)."""
  round: "Round"
  block_size: int


@dataclasses.dataclass
class Group:
  """A batch of requests whose plans share a round: `block` is the block the round runs at; `planned[i]` is the
  block request i was planned at (smaller than `block` when the engine padded it into a larger batch, which
  `Round.pads_to_largest` allows: the request then keeps at most its planned block of the verified tokens)."""
  round: "Round"
  block: int
  reqs: list
  planned: list[int]


class Round:
  """A kind of round. Subclasses implement `run`; instances are hashable by identity (plans are grouped by them)."""
  kind: RoundKind | str = "round"
  # True: requests planned at different blocks may share one batch padded to the largest (LinearSS rounds)
  pads_to_largest: bool = False
  # the round that runs this round's requests as rows of a ragged step, each at its own planned block (LinearSS and
  # AR rounds: `rounds.RAGGED`); None: it never does
  ragged_round: "Round | None" = None

  def run(self, ctx: "RoundContext", group: Group) -> str | tuple[str, int] | None:
    """Runs one round for `group`; returns the label to record its wall time under (None: `kind`), or (label,
    rounds) when one call ran several rounds (multi-step AR decode: each is recorded at its share of the time)."""
    raise NotImplementedError

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.kind})"


class RoundContext(Protocol):
  """The engine's services to a running round."""
  runner: Any  # the device side (prefill / draft / verify / fused / denoise)
  cfg: Any  # the model's NLDConfig (mask and EOS token ids)
  rc: Any  # the runner's RunnerConfig (page size, max_model_len, max_block)
  strategy: "Strategy"
  totals: Any  # engine-wide counters (collections.Counter) the server's /metrics reads
  signal_log: list | None  # analysis: per-round draft signals, when a caller asked for them

  def batch_arrays(self, reqs: Sequence, rounds: int = 1) -> tuple:
    """(bucket b, page_table [b, P], prefix_len [b], SamplingArrays) of a padded batch; advances each request's
    round counter (its sampling key) by `rounds` (a multi-step decode's steps count up from it)."""

  def decode_steps(self, reqs: Sequence) -> int:
    """AR decode steps the next decode call of `reqs` runs (1, or the runner's `decode_steps`)."""

  def seeds(self, reqs: Sequence, b: int) -> tuple:
    """(seed tokens [b], live-row flags [b]) of a padded batch."""

  def reserve(self, reqs: Sequence, blk: int) -> None:
    """Pages for `blk` more tokens past each request's committed length."""

  def committed(self, req) -> int:
    """Tokens of `req` whose K/V are committed in the cache."""

  def commit(self, req, length: int) -> None:
    """Marks `length` tokens of `req` committed (after a forward wrote them)."""

  def count_forward(self, kind: str, blk: int, rows: int) -> None:
    """Records one device forward in the engine's ledger."""

  def count_block(self, req, blk: int, accepted: int) -> None:
    """Records one decoded block of `req` in its stats (rounds, accepted lengths, block sizes)."""

  def verified(self, req, blk: int, accepted: int, result, row: int) -> None:
    """After a verification: stats, pages (commit `accepted`, drop the rest), `strategy.observe`, emission."""

  def decoded(self, req, steps: int, result, row: int) -> None:
    """After an AR decode call of `steps` steps: stats and `strategy.observe` per step, pages, emission."""

  def emit(self, req, tokens: list[int], logprobs, top_logprobs, top_ids) -> None:
    """Appends tokens to `req` (stop conditions, logprobs, its update callback)."""

  def finish(self, req, reason: str) -> None:
    """Ends `req` (frees its pages)."""


class Strategy:
  """Base decoding strategy; subclasses implement `plan` and may override the hooks."""
  name = "base"
  ragged_steps = False  # the last step's `StepView.ragged_steps`, for strategies that price a step's plan
  threshold = 0.9  # confidence threshold of the diffusion denoise loop
  supports_logprobs = True

  def plan(self, req, view: StepView) -> RoundPlan:
    raise NotImplementedError

  def observe(self, req, block_size: int, accepted: int, result, row: int) -> None:
    """Called after each verification of `req` (result: the runner's VerifyResult, row: req's row in it)."""

  def observe_round(self, kind: str, block_size: int, rows: int, seconds: float) -> None:
    """Called after every round the engine ran for this strategy: the label its round returned, block size, live
    rows and wall seconds."""

  def on_admit(self, req) -> None:
    """Called when `req` joins the running batch: set `req.strategy_state` here."""

  def on_finish(self, req) -> None:
    pass

  def block_sizes(self) -> tuple[int, ...]:
    """Block sizes this strategy may plan (what must be compiled)."""
    return ()

  def step_kinds(self) -> tuple[str, ...]:
    """The runner's step kinds this strategy's rounds call (what must be compiled)."""
    return ("prefill", "verify")

  def round_cost(self, batch: int, block_size: int) -> float | None:
    """Cost of one LinearSS round (draft + verify) of `batch` requests at block `block_size` in the strategy's cost
    model, or None when it has none (the engine then keeps one batch per planned block size)."""
    del batch, block_size
    return None
