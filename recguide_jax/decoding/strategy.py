"""The decoding-strategy protocol: the one seam between the engine and a way of decoding (AR, diffusion, LinearSS,
RecGuide, or one a user registers). Engine and rounds exchange data, not callbacks:

1. the engine takes a read-only `StepView` (the step's decoding requests and the load) and asks its strategy for a
   `StepPlan` (`Strategy.plan_step`): one `RoundPlan` (a `Round` object and a block size) per request;
2. the engine groups the plans into batches, reserves their pages and builds each `Batch` (page table, prefix
   lengths, sampling arrays, seed tokens), then calls `Round.run(runner, batch)`, which runs the device forwards
   and returns a `RoundOutput`: per row the tokens to emit, the tokens to commit to the cache and the rounds to
   record; the forwards it ran; the label its wall time is recorded under;
3. the engine applies the output (`Engine.apply`: pages, counters, request stats, emission, stop conditions) and
   hands the strategy the `RoundOutcome` (`Strategy.observe`).

A strategy keeps what it remembers about a request in `Request.strategy_state`, an object it sets in `on_admit`;
the engine never looks inside. The engine knows no strategy by name: adding one is a subclass and a
`registry.register_strategy` call.
"""

from __future__ import annotations

import copy
import dataclasses
import enum
from typing import Any, Sequence

import numpy as np


class RoundKind(enum.StrEnum):
  """Labels of the generic rounds (`rounds.py`): what their wall time is recorded under and what a cost model prices.
  A strategy's own rounds label themselves with their own strings (str-valued: profiles keep their JSON keys)."""
  AR = "ar"
  LINEAR = "linear"
  DIFFUSION = "diffusion"
  RAGGED = "ragged"  # LinearSS rows at their own blocks and AR rows in one ragged draft + one ragged verify forward


@dataclasses.dataclass(frozen=True)
class StepView:
  """What a strategy may read about the engine when it plans a step (a snapshot, taken once per step)."""
  step: int  # the engine's step counter
  requests: tuple  # the requests decoding in this step, in planning order (read-only)
  max_batch: int
  max_model_len: int
  max_block: int
  eos_token_ids: frozenset[int]
  # requests admitted and not finished, decoding or still prefilling: the load a choice that lasts beyond this step
  # is made under (a request that prefills this step decodes in the next); 0: unknown, use `decoding`
  running: int = 0
  # the engine runs LinearSS and AR rows as ragged steps (bucketing "ragged"): a step's mixed blocks cost one
  # ragged draft + verify forward, not a batch per block size
  ragged_steps: bool = False

  @property
  def decoding(self) -> int:
    """Requests decoding in this step (the load)."""
    return len(self.requests)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
  """One request's round: which round object runs it, at which block size (1 for AR). `verify_price`: on a ragged
  step, the verify keeps a drafted token only while the running product of the draft's top probabilities through it
  is at least this (what one more verified token must be expected to return at this load; 0: the whole block)."""
  round: "Round"
  block_size: int
  verify_price: float = 0.0


@dataclasses.dataclass(frozen=True)
class StepPlan:
  """A strategy's plan of one step: `plans[i]` is the round of `view.requests[i]`."""
  plans: tuple[RoundPlan, ...]

  @classmethod
  def uniform(cls, plan: RoundPlan, n: int) -> "StepPlan":
    return cls((plan,) * n)


@dataclasses.dataclass
class Batch:
  """One round's batch, built by the engine: rows 0..n-1 are `reqs` (padded to the bucket `b`), their pages reserved
  for the round. `planned[i]` is the block request i was planned at (smaller than `block` when the engine padded it
  into a larger batch, which `Round.pads_to_largest` allows: the request then keeps at most its planned block of the
  verified tokens). `steps`: AR decode steps the call may run (1 unless the round is multi-step). Sampling keys are
  (seed, counter + k) for a round's k-th use of them (`sub`); the engine advances each counter by the output's
  `key_rounds` afterwards."""
  round: "Round"
  block: int
  reqs: list
  planned: np.ndarray  # [n] int
  b: int = 0
  page_table: np.ndarray | None = None  # [b, P]
  prefix_len: np.ndarray | None = None  # [b] committed tokens per row
  samp: Any = None  # SamplingArrays [b]
  seed: np.ndarray | None = None  # [b] the token each row's round starts from
  live: np.ndarray | None = None  # [b] real rows
  steps: int = 1
  bucket_for: Any = None  # n -> the batch bucket of n rows (sub-batches)
  request_rows: Any = None  # the engine's per-request rows of `reqs` (`engine.batch_rows.BatchRows`)
  verify_price: np.ndarray | None = None  # [n] float: each row's `RoundPlan.verify_price` (None: all 0)
  running_as_of: int = -1  # the engine's count of finished requests when every row's request was known to run

  @property
  def n(self) -> int:
    return len(self.reqs)

  def sub(self, rows: Sequence[int], key_offset: int = 0) -> "Batch":
    """The batch of `rows` only (padded to their own bucket), its sampling keys `key_offset` rounds on."""
    rows = np.asarray(rows, np.int64)
    b = self.bucket_for(len(rows))
    out = Batch(self.round, self.block, [self.reqs[i] for i in rows], self.planned[rows], b,
                steps=self.steps, bucket_for=self.bucket_for,
                verify_price=None if self.verify_price is None else self.verify_price[rows])
    out.page_table = np.zeros((b, self.page_table.shape[1]), np.int32)
    out.page_table[:len(rows)] = self.page_table[rows]
    out.prefix_len = np.zeros((b,), np.int32)
    out.prefix_len[:len(rows)] = self.prefix_len[rows]
    out.seed = np.zeros((b,), np.int32)
    out.seed[:len(rows)] = self.seed[rows]
    out.live = np.zeros((b,), bool)
    out.live[:len(rows)] = True
    s = self.samp
    out.samp = type(s).greedy(b)
    for name in ("temperature", "top_k", "top_p", "keys", "top_logprobs"):
      getattr(out.samp, name)[:len(rows)] = getattr(s, name)[rows]
    out.samp.keys[:len(rows), 1] += np.uint32(key_offset)
    return out


@dataclasses.dataclass
class RoundOutput:
  """What a round did, as data (rows as in its `Batch`):
  - emission: row i emits `tokens[i, :emit[i]]` with `logprobs` (and top entries when computed);
  - the cache: `commit[i]` more tokens of row i hold committed K/V (what the round wrote past them is dropped);
  - the books: each row's `rounds` decode rounds at `block[i]` with `accepted[i]` tokens each (multi-step AR: `steps`
    rounds of 1 at block 1); `speculative`: the rounds verified drafts (the draft counters); `verified[i]`: the
    tokens row i's verify forward ran (fewer than `block[i]` where it was truncated; None: all of them);
  - the device: `forwards` (kind, block, live rows) in the order they ran, `row_forwards` (kind -> [n]);
  - `drafting[i]`: row i only drafted (for a later round): it emits, commits and records nothing, uses no
    sampling-key round and counts only its `row_forwards` (None: every row ran its round);
  - `label`: what its wall time is recorded under; `key_rounds`: sampling-key rounds it used;
  - `verify`: the verification result (per-position entropy etc.) and `extra`: the round's own data, both for the
    strategy's `observe`."""
  label: str
  tokens: np.ndarray  # [n, T]
  emit: np.ndarray  # [n]
  logprobs: np.ndarray  # [n, T]
  commit: np.ndarray  # [n]
  block: np.ndarray  # [n]
  accepted: np.ndarray  # [n]
  forwards: list[tuple[str, int, int]]
  row_forwards: dict[str, np.ndarray]
  top_logprobs: np.ndarray | None = None  # [n, T, K]
  top_ids: np.ndarray | None = None
  rounds: int = 1
  speculative: bool = True
  key_rounds: int = 1
  trim: bool = True  # the round may have written past what it commits (a verify): drop those pages
  verify: Any = None  # the runner's VerifyResult, rows as in the batch
  extra: Any = None
  verified: np.ndarray | None = None  # [n]
  drafting: np.ndarray | None = None  # [n] bool


@dataclasses.dataclass
class RoundOutcome:
  """What a strategy observes after the engine applied a round: the batch, its output, each row's generated tokens
  before the round, and the round's wall seconds (batch assembly, forwards, acceptance, emission)."""
  batch: Batch
  output: RoundOutput
  generated_before: np.ndarray  # [n]
  seconds: float


class Round:
  """A kind of round. Subclasses implement `run`; instances are hashable by identity (plans are grouped by them)."""
  kind: str = "round"
  # True: requests planned at different blocks may share one batch padded to the largest (LinearSS rounds)
  pads_to_largest: bool = False
  # the round that runs this round's requests as rows of a ragged step, each at its own planned block (LinearSS and
  # AR rounds: `rounds.RAGGED`); None: it never does
  ragged_round: "Round | None" = None
  # True: a call may run several AR steps (`Batch.steps`); the engine decides how many
  multi_step: bool = False
  # True: `dispatch(runner, batch, seed)` / `collect(runner, batch, handle)` split `run`, and the next call can start
  # from the previous call's device outputs (the engine then prepares and dispatches it before it reads that one)
  pipelined: bool = False
  # True: each row runs at its own planned block (a ragged step), so a call dispatched ahead may give its rows other
  # blocks than the call before it (`AheadPlan`)
  replans_rows: bool = False

  def ahead(self, batch: "Batch") -> tuple[int, int, int]:
    """For a pipelined round: (the most tokens a row of `batch` commits, the fewest, its sampling-key rounds): what
    the engine prepares the next call with before it has read this one back."""
    raise NotImplementedError

  def reserve(self, block: int, steps: int) -> int:
    """Tokens past each row's committed length the round may write (its pages are reserved before `run`)."""
    return block * steps

  def run(self, runner, batch: Batch) -> RoundOutput:
    raise NotImplementedError

  def __repr__(self) -> str:
    return f"{type(self).__name__}({self.kind})"


@dataclasses.dataclass(frozen=True)
class StrategyMetric:
  """One series a strategy exports on the server's /metrics: `kind` "counter" or "gauge"; `value` a number, or with
  `label` a list of (label value, number)."""
  name: str
  doc: str
  kind: str
  value: Any
  label: str | None = None


@dataclasses.dataclass(frozen=True)
class AheadPlan:
  """The step after a batch's round, planned before that round's outcome is applied (`Strategy.plans_ahead`): the
  same round over the same rows, each at `planned[i]` (its block) and `verify_price[i]` (None: all 0). Only a round
  whose rows each run at their own block (`Round.replans_rows`) takes blocks other than the batch's."""
  planned: np.ndarray  # [n] int
  verify_price: np.ndarray | None = None  # [n] float

  @classmethod
  def again(cls, batch: Batch) -> "AheadPlan":
    """`batch`'s own plan, once more."""
    return cls(batch.planned, batch.verify_price)


class Strategy:
  """Base decoding strategy; subclasses implement `plan_step` and may override the hooks."""
  name = "base"
  supports_logprobs = True
  plans_ar = False  # True: plans AR rounds (block 1) beside `block_sizes` (metrics show their share from the start)

  def plan_step(self, view: StepView) -> StepPlan:
    raise NotImplementedError

  def plans_ahead(self, batch: Batch) -> AheadPlan | None:
    """The step after `batch`'s round, planned before `batch`'s outcome is applied (the engine then dispatches it
    while `batch`'s call runs; it asks only where nothing else could change the step): `batch`'s rows in the same
    round (`AheadPlan`). None: every step is planned after the one before it was applied."""
    del batch
    return None

  def observe(self, outcome: RoundOutcome) -> None:
    """Called after the engine applied each round this strategy planned."""

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

  def metrics(self) -> list[StrategyMetric]:
    """The strategy's own series for /metrics (read from the server's thread: return copies)."""
    return []

  def clone(self) -> "Strategy":
    """An independent copy for another engine (a data-parallel group): no mutable state shared."""
    return copy.deepcopy(self)
