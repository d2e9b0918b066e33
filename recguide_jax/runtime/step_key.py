"""What identifies one compiled step variant: its kind (an enum) and its static shapes, as a frozen, hashable,
picklable key (it crosses processes when a multi-host leader tells its followers which step to run)."""

from __future__ import annotations

import dataclasses
import enum


class StepKind(str, enum.Enum):
  """A compiled step's kind (a str enum: its value is the label in logs, traces and cost tables)."""
  PREFILL = "prefill"  # causal chunk: writes K/V of its valid tokens, samples the next token at each row's last one
  DRAFT = "draft"  # bidirectional block [seed, MASK...] over the cached prefix, draft LoRA on; cache untouched
  VERIFY = "verify"  # causal block: writes its K/V, speculative acceptance against the draft distributions
  DECODE = "decode"  # plain AR decode: a verify of a block of 1 that takes no draft distribution (`steps` of them)
  FUSED = "fused"  # greedy verify of a block plus `slots` tree branches drafted in the same forward
  GVERIFY = "gverify"  # greedy verify of host-provided draft tokens (a fused forward with no branch slots)
  DENOISE = "denoise"  # NLD's block-diffusion loop (confidence threshold) as one on-device while loop
  # a PREFILL that also scores the prompt: the logprob (and top entries) of each next prompt token at every
  # position (prompt logprobs, `echo`); compiled on first use, so a server whose clients never ask pays nothing
  SCORE = "score"
  # Ragged steps: every request's own query tokens packed into one token dimension (`StepKey.tokens`, a few
  # buckets), each row at its own block (LinearSS rows at their planned B, AR rows at 1): one forward per engine
  # step for any mix, compiled per token bucket, not per (kind, block, batch)
  RAGGED_DRAFT = "ragged_draft"  # each row's bidirectional draft block [seed, MASK...] of its own length
  RAGGED_VERIFY = "ragged_verify"  # each row's causal block (a LinearSS verify or one AR token): writes its K/V
  # the causal forward that commits a denoised block's K/V: it runs the PREFILL variant (never a StepKey of its own)
  # and is counted apart in the forward ledger and the request stats
  COMMIT = "commit"

  @property
  def writes_cache(self) -> bool:
    return self not in (StepKind.DRAFT, StepKind.DENOISE, StepKind.RAGGED_DRAFT)

  @property
  def ragged(self) -> bool:
    return self in (StepKind.RAGGED_DRAFT, StepKind.RAGGED_VERIFY)

  def __str__(self) -> str:
    return self.value


@dataclasses.dataclass(frozen=True, order=True)
class StepKey:
  """One compiled variant: `kind` at query block `block` (the prefill chunk for PREFILL and SCORE, 1 for DECODE), batch
  bucket `batch`, for FUSED its number of branch slots, and for DECODE the AR steps one call runs (each step feeds
  the token it sampled to the next on the device: one dispatch and one read-back for `steps` tokens). A ragged
  kind packs `tokens` query tokens of up to `batch` rows, each row at most `block` of them (the largest block)."""
  kind: StepKind
  block: int
  batch: int
  slots: int = 0
  steps: int = 1
  # the length of each row's sparse sampling-control list (sampling.Controls); 0: the step applies no controls. A
  # batch with controls runs its own variant, compiled on first use, so batches without any pay nothing for them
  controls: int = 0
  tokens: int = 0  # a ragged step's packed query tokens (0 for every other kind)

  def __post_init__(self):
    object.__setattr__(self, "kind", StepKind(self.kind))
    if self.kind == StepKind.COMMIT:
      raise ValueError("a commit forward runs the prefill variant: no step key of its own")
    if self.block < 1 or self.batch < 1:
      raise ValueError(f"a step's block and batch must be positive: {self}")
    if self.kind == StepKind.DECODE and self.block != 1:
      raise ValueError(f"decode is a block of 1, got {self.block}")
    if (self.kind == StepKind.FUSED) != (self.slots > 0):
      raise ValueError(f"only a fused step has branch slots (and it has at least one): {self}")
    if self.steps < 1 or (self.steps > 1 and self.kind != StepKind.DECODE):
      raise ValueError(f"only a decode step runs several steps per call (and at least one): {self}")
    if self.controls < 0:
      raise ValueError(f"a step's control list length is non-negative: {self}")
    if self.kind.ragged != (self.tokens > 0):
      raise ValueError(f"only a ragged step has a packed token count (and it is positive): {self}")

  @property
  def rows(self) -> int:
    """Query tokens the dense layers of one call compute: the batch's padded rows, or a ragged step's packed
    tokens."""
    return self.tokens if self.kind.ragged else self.batch * self.query_tokens

  @property
  def query_tokens(self) -> int:
    """Query tokens per row: the block plus the tree's branch blocks."""
    return (1 + self.slots) * self.block

  @property
  def label(self) -> str:
    """The step-kind label of logs, traces and cost tables ("verify", "fused2")."""
    return kind_label(self.kind, self.slots)

  @property
  def name(self) -> str:
    """"kind/block/batch", as reports and tables name a variant ("fused2/16/8"; "decode/1/8x4": 4 steps a call)."""
    controls = f"+c{self.controls}" if self.controls else ""
    if self.kind.ragged:
      return f"{self.label}/t{self.tokens}{controls}"
    return f"{self.label}/{self.block}/{self.batch}" + (f"x{self.steps}" if self.steps > 1 else "") + controls

  @classmethod
  def parse(cls, kind: str | StepKind, block: int, batch: int) -> "StepKey":
    """A key from a kind label ("fused2" = FUSED with 2 slots)."""
    kind_enum, slots = parse_kind_label(kind)
    return cls(kind_enum, block, batch, slots)


# the forwards a request's stats count (`RequestStats.forwards`), in their JSON order
COUNTED_FORWARDS = (StepKind.PREFILL, StepKind.DRAFT, StepKind.VERIFY, StepKind.DECODE, StepKind.DENOISE,
                    StepKind.COMMIT)


def kind_label(kind: StepKind, slots: int = 0) -> str:
  if kind == StepKind.FUSED:
    return f"fused{slots}"
  return StepKind(kind).value


def parse_kind_label(kind: str | StepKind) -> tuple[StepKind, int]:
  """("fused2") -> (FUSED, 2); ("verify") -> (VERIFY, 0). A fused label names its slot count."""
  if kind == StepKind.FUSED:
    raise ValueError("a fused step kind names its branch slots: fused<N>")
  if isinstance(kind, StepKind):
    return kind, 0
  if kind.startswith("fused"):
    digits = kind[len("fused"):]
    if not digits.isdigit() or int(digits) < 1:
      raise ValueError(f"unknown step kind {kind!r}")
    return StepKind.FUSED, int(digits)
  try:
    kind_enum = StepKind(kind)
  except ValueError:
    raise ValueError(f"unknown step kind {kind!r}; expected one of {[k.value for k in StepKind]} or fused<N>")
  return kind_enum, 0


def batch_buckets(max_batch: int) -> tuple[int, ...]:
  """Powers of two below `max_batch`, then `max_batch`: a batch is padded to the first bucket that holds it."""
  out, b = [], 1
  while b < max_batch:
    out.append(b)
    b *= 2
  out.append(max_batch)
  return tuple(out)


# the smallest token bucket of a ragged step: below it a step's dense layers cost about the same at any size
MIN_RAGGED_TOKENS = 16


def ragged_token_buckets(max_batch: int, max_block: int) -> tuple[int, ...]:
  """Packed-token buckets of ragged steps: powers of two from MIN_RAGGED_TOKENS, then max_batch * max_block (every
  row at the largest block). They follow the batch and the largest block only, never the set of block sizes."""
  top = max_batch * max_block
  out, t = [], MIN_RAGGED_TOKENS
  while t < top:
    out.append(t)
    t *= 2
  out.append(top)
  return tuple(out)


def fused_kind(slots: int) -> str:
  """The step-kind label of a fused verify+branches forward with `slots` branch slots."""
  if slots < 1:
    raise ValueError(f"a fused forward needs at least one branch slot, got {slots}")
  return kind_label(StepKind.FUSED, slots)


def fused_slots(kind: str) -> int:
  """Inverse of `fused_kind`."""
  kind_enum, slots = parse_kind_label(kind)
  if kind_enum != StepKind.FUSED:
    raise ValueError(f"{kind!r} is not a fused step kind")
  return slots
