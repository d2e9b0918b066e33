"""Predictive draft-verify overlap, the planner (RecGuide, light load; docs/spec/recguide.md §4).

After a draft, each draft position i in 1..B-1 is analysed (confidence, top-1/top-2 margin with the mask token
excluded); a position is risky when its margin < delta (strict). From the first two risky positions P1 < P2 and
the crossing count K, the paper's final rule ("margin_risk_no_p3") plans speculative branches:

  K = 0: continuation;  K = 1: corr(P1) + continuation;  K = 2: corr(P1) + corr(P2) + continuation;
  K >= 3: corr(P1) + corr(P2).

The verify forward and every branch draft run in ONE forward with a flattened shared-prefix ("tree") layout: the
B verifier tokens, then B tokens per branch. A branch block token sees the committed KV, the verifier tokens
before its branch point `pre` (P_k for a correction, B for the continuation) and its own block as the model's draft
reads one (bidirectionally for NLD);
verifier tokens are causal among themselves. Positions put each branch block exactly where the next round's block
will sit if it is confirmed. Only the verifier tokens are committed; draft LoRA is on for branch tokens only.

After verification a branch is reused as the next round's draft when it hits, which saves a draft forward:
- full acceptance and the continuation's first token equals the bonus token;
- first rejection at P_k with corr(P_k) executed and the verifier's correction equals alt_k.

A request without a draft (entering overlap, or after a miss) drafts in the fused forward of other requests'
verifications, as a branch of its own from its seed (`draft_layout`), and verifies it in the next one: one forward
per engine step whatever the mix, no draft forward of its own unless no request verifies.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from pallas_kernels.common import causal_mask
from recguide_jax.model import draft_head
from recguide_jax.model.config import DraftHead

MAX_BRANCHES = 3  # the paper's tree: up to P1, P2 and the continuation (the default number of branch slots)
MAX_SLOTS = 8  # the widest fused tree offered: 9B query tokens per request
PLANNERS = ("no_p3", "expected_hit")  # the paper's final rule (default), our slot-filling alternative
CORRECTION, CONTINUATION = "correction", "continuation"
FRESH = "fresh"  # `Prefetched.kind` of a request's own draft (made in a fused forward while others verified)


@dataclasses.dataclass(frozen=True)
class DraftAnalysis:
  risky: tuple[int, ...]  # first (up to 3) risky positions, ascending
  crossings: int  # total number of risky positions
  alt: tuple[int, ...]  # runner-up token at each of `risky` (-1: no valid alternative)


@dataclasses.dataclass(frozen=True)
class Branch:
  kind: str  # CORRECTION | CONTINUATION
  pre: int  # verifier tokens the branch builds on (P_k, or B for the continuation)
  alt: int = -1  # the correction token placed at the block's first slot (corrections only)


@dataclasses.dataclass
class Prefetched:
  """A branch block confirmed by verification, ready as the next round's draft (its analysis done)."""
  tokens: np.ndarray  # [B]; tokens[0] is the committed next token (the new seed)
  signals: np.ndarray  # [3, B] confidence, margin, runner-up of the block's positions
  kind: str


def analyze(signals: np.ndarray, delta: float) -> DraftAnalysis:
  """signals: [3, B] (confidence, margin, runner-up) of one draft; position 0 (the seed) is never scanned."""
  margin = signals[1, 1:]
  risky = [int(i) + 1 for i in np.nonzero(margin < delta)[0]]
  alt = tuple(int(signals[2, p]) for p in risky[:3])
  return DraftAnalysis(tuple(risky[:3]), len(risky), alt)


def plan_branches(analysis: DraftAnalysis, block: int, *, generated: int, committed: int, max_new: int,
                  max_len: int, components: Sequence[str] = ("p1", "p2", "continuation")) -> list[Branch]:
  """The paper's no-P3 rule plus its boundary filters. `components` switches parts on for ablations
  (Table 5: "p1" only, then "+p2", then "+continuation")."""
  out: list[Branch] = []
  for idx, name in ((0, "p1"), (1, "p2")):
    if name not in components or len(analysis.risky) <= idx:
      continue
    p, alt = analysis.risky[idx], analysis.alt[idx]
    if alt < 0:  # no executable alternative token
      continue
    if generated + p >= max_new or committed + p + block > max_len:
      continue
    out.append(Branch(CORRECTION, p, alt))
  if ("continuation" in components and analysis.crossings <= 2 and generated + block < max_new
      and committed + 2 * block <= max_len):
    out.append(Branch(CONTINUATION, block))
  return out


def plan_expected_hit(signals: np.ndarray, block: int, *, generated: int, committed: int, max_new: int,
                      max_len: int, max_branches: int = MAX_BRANCHES, prefix_exponent: float = 1.0) -> list[Branch]:
  """Our alternative to the no-P3 rule: fill every branch slot of the fused forward with the branches most likely
  to hit, judged by the draft's own probabilities (signals [3, B]: confidence C, margin M, runner-up id).

  A correction at p hits when draft positions 1..p-1 are accepted and the verifier picks the runner-up at p:
  P ~ prod_{j<p} C_j * (C_p - M_p) (C_p - M_p is the runner-up's probability). The continuation hits on full
  acceptance with the right bonus: P ~ prod_{j<B} C_j * mean(C) (the bonus is not drafted yet). The fused forward
  has a fixed shape of (1 + slots) * B query tokens, so an empty slot costs as much as a used one; the paper's
  rule leaves slots empty because its padded dense rows did cost compute (docs/spec/recguide.md §4.7). How many
  slots pay off (wider trees hit more often but cost more query tokens) is fitted per model and device
  (launch/fit_delta.py). Same boundary filters as the paper's rule.

  `prefix_exponent` gamma scores the prefix as (prod_{j<p} C_j)^gamma. The plain product (gamma = 1) treats the
  positions' acceptances as independent, but they are positively correlated (a draft that is right at j is
  likelier right at j + 1), so the product decays too fast and the planner under-covers later positions. gamma is
  fitted per checkpoint from logged overlap rounds (`fit_prefix_exponent`, launch/fit_delta.py)."""
  if not 0.0 < prefix_exponent <= 2.0:
    raise ValueError(f"prefix_exponent must lie in (0, 2], got {prefix_exponent}")
  conf, margin, alt = signals[0, :block], signals[1, :block], signals[2, :block].astype(np.int64)
  # before[p-1] = (prod_{j=1..p-1} C_j)^gamma for p = 1..B (before[B-1]: the whole block, the continuation's prefix)
  before = np.cumprod(np.concatenate([[1.0], conf[1:block]])) ** prefix_exponent
  cands: list[tuple[float, Branch]] = []
  for p in range(1, block):
    if alt[p] < 0 or generated + p >= max_new or committed + p + block > max_len:
      continue
    cands.append((float(before[p - 1] * (conf[p] - margin[p])), Branch(CORRECTION, p, int(alt[p]))))
  if generated + block < max_new and committed + 2 * block <= max_len:
    cands.append((float(before[block - 1] * np.mean(conf[1:block])), Branch(CONTINUATION, block)))
  # highest score first; ties to the earlier branch point (its prefix is likelier to be accepted)
  chosen = sorted(cands, key=lambda sb: (-sb[0], sb[1].pre))[:max_branches]
  return [b for _, b in sorted(chosen, key=lambda sb: sb[1].pre)]


def tree_layout(block: int, draft: np.ndarray, branches: Sequence[Branch], committed: int, mask_token_id: int,
                slots: int = MAX_BRANCHES, head: DraftHead = DraftHead.SAME_POSITION):
  """One request's flattened tree: Q = (1 + slots) B query tokens (the verifier block, then `slots` branch slots;
  unused slots are inert). A branch block is read as the model drafts (`head`: its in-block mask and the tokens the
  draft adapter is on for).

  Returns tokens [Q], positions [Q], mask [Q, Q] (bool, row = query), lora [Q], write [Q].
  """
  if len(branches) > slots:
    raise ValueError(f"{len(branches)} branches do not fit a tree of {slots} slots")
  q = (1 + slots) * block
  tokens = np.full((q,), mask_token_id, np.int32)
  positions = np.zeros((q,), np.int32)
  mask = np.zeros((q, q), bool)
  lora = np.zeros((q,), bool)
  write = np.zeros((q,), bool)
  tokens[:block] = draft
  positions[:block] = committed + np.arange(block)
  mask[:block, :block] = causal_mask(block)
  write[:block] = True
  for k in range(slots):
    lo = (k + 1) * block
    sl = slice(lo, lo + block)
    if k < len(branches):
      br = branches[k]
      positions[sl] = committed + br.pre + np.arange(block)
      if br.kind == CORRECTION:
        tokens[lo] = br.alt
      mask[sl, :br.pre] = True  # the verifier tokens before the branch point (same K/V as a committed prefix)
      mask[sl, sl] = draft_head.block_mask(head, block)  # the block itself, as a draft reads it
      lora[sl] = draft_head.adapter_rows(head, tokens[sl], mask_token_id)
    else:  # inert slot: sees only itself
      positions[sl] = committed + np.arange(block)
      mask[np.arange(lo, lo + block), np.arange(lo, lo + block)] = True
  return tokens, positions, mask, lora, write


def draft_layout(block: int, seed: int, committed: int, mask_token_id: int, slots: int,
                 head: DraftHead = DraftHead.SAME_POSITION):
  """A drafting request's row of a fused forward (`tree_layout`'s shapes): its verifier slots inert (nothing
  verified, nothing written), its first branch slot the draft a draft forward would make, from `seed` at the
  committed length over the committed prefix alone (the branch's tokens and signals are the draft)."""
  if slots < 1:
    raise ValueError("a drafting row needs a branch slot")
  tokens, positions, mask, lora, write = tree_layout(block, np.full((block,), mask_token_id, np.int32),
                                                     [Branch(CORRECTION, 0, seed)], committed, mask_token_id, slots,
                                                     head)
  mask[:block, :block] = np.eye(block, dtype=bool)
  write[:block] = False
  return tokens, positions, mask, lora, write


@dataclasses.dataclass(frozen=True)
class ReuseOutcome:
  label: str  # one of OUTCOMES
  branch: int | None  # index of the reused branch


OUTCOMES = ("correction_hit", "correction_miss", "continuation_hit", "continuation_miss", "continuation_absent",
            "no_hit")
HIT_OUTCOMES = ("correction_hit", "continuation_hit")  # a branch became the next draft
MISS_OUTCOMES = ("correction_miss", "continuation_miss", "continuation_absent", "no_hit")


def select_reuse(accepted: int, out_tokens: np.ndarray, branches: Sequence[Branch], branch_tokens: np.ndarray,
                 block: int) -> ReuseOutcome:
  """accepted in 1..B; out_tokens [>= accepted] the emitted tokens (out[accepted-1] = new seed);
  branch_tokens [n, B] the branch blocks' tokens (correction blocks start with their alt)."""
  seed = int(out_tokens[accepted - 1])
  if accepted == block:  # full acceptance: the continuation guessed the bonus token?
    for k, br in enumerate(branches):
      if br.kind == CONTINUATION:
        hit = int(branch_tokens[k][0]) == seed
        return ReuseOutcome("continuation_hit" if hit else "continuation_miss", k if hit else None)
    return ReuseOutcome("continuation_absent", None)
  rejected = accepted  # the first rejected draft position (m + 1)
  covering = [k for k, br in enumerate(branches) if br.kind == CORRECTION and br.pre == rejected]
  for k in covering:  # several alternatives may cover one position (expected-hit planner)
    if branches[k].alt == seed:
      return ReuseOutcome("correction_hit", k)
  return ReuseOutcome("correction_miss" if covering else "no_hit", None)
