"""RecGuide's overlap round (docs/spec/recguide.md §4): verification-overlapped drafting. A draft forward runs only
for requests without a prefetched block; then one fused forward verifies every request's block and drafts the
branches its planner chose, laid out as a tree (`overlap.tree_layout`). A branch that verification confirms
(`overlap.select_reuse`) becomes the request's next draft (`RecGuideStrategy.observe` stores it), which saves that
round's draft forward.

Every draft here is a point mass (the argmax, as the branches are) and the fused forward accepts by the reference
rule (a verifier sample equal to the draft), which is lossless for any draft chosen before the round's noise: so
a sampled request keeps the AR distribution, and a branch hits when the sampled correction or bonus token equals
its first token."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from recguide_jax.decoding.rounds import verified_output
from recguide_jax.decoding.strategy import Batch, Round, RoundOutput
from recguide_jax.recguide import overlap as ov
from recguide_jax.recguide.fit.overlap_fit import OverlapTrace
from recguide_jax.recguide.kinds import OverlapKind
from recguide_jax.runtime.step_key import StepKind, fused_kind


@dataclasses.dataclass
class OverlapResult:
  """An overlap round's own output (`RoundOutput.extra`), per row: the branch outcome (None: no branch planned),
  the confirmed branch as the next draft (None: none), the round's trace (`overlap_fit.OverlapTrace`, only while
  the strategy records them)."""
  outcomes: list
  prefetch: list
  traces: list
  saved_drafts: int


class OverlapRound(Round):
  """The round RecGuide plans in its overlap regime; bound to its strategy (planner, slots)."""
  kind = OverlapKind.OVERLAP

  def __init__(self, strategy):
    self.strategy = strategy

  @staticmethod
  def bounds(runner, r, committed: int) -> dict:
    """What limits a request's branches this round (token budget, cache length), as the planners take them."""
    rc = runner.config
    return dict(generated=len(r.output_ids), committed=committed, max_new=r.params.max_tokens,
                max_len=rc.max_model_len + rc.max_block)

  def run(self, runner, batch: Batch) -> RoundOutput:
    reqs, blk, b, n = batch.reqs, batch.block, batch.b, batch.n
    strategy = self.strategy
    drafts = np.zeros((b, blk), np.int32)
    signals = np.zeros((b, 3, blk), np.float32)
    prefs = []
    for r in reqs:
      p = strategy.state(r).prefetched
      prefs.append(p if p is not None and len(p.tokens) == blk else None)
    need = [i for i, p in enumerate(prefs) if p is None]
    forwards = []
    if need:
      sub = batch.sub(need)
      sub.samp.temperature[:] = 0.0  # the argmax draft: under the reference rule a sampled draft accepts less
      tok, _, sig = runner.draft(sub.seed, sub.prefix_len, sub.page_table, blk, sub.samp)
      tok, sig = jax.device_get((tok, sig))  # one device->host transfer
      forwards.append((StepKind.DRAFT, blk, len(need)))
      drafts[need], signals[need] = tok[:len(need)], sig[:len(need)]
    for i, pref in enumerate(prefs):
      if pref is not None:
        drafts[i], signals[i] = pref.tokens, pref.signals
    bounds = [self.bounds(runner, r, int(batch.prefix_len[i])) for i, r in enumerate(reqs)]
    plans = [strategy.plan_branches(signals[i], blk, bounds[i]) for i in range(n)]
    any_branch = any(plans)
    slots = strategy.overlap_slots
    mask_id = runner.cfg.mask_token_id
    qn = (1 + slots) * blk if any_branch else blk
    tokens = np.full((b, qn), mask_id, np.int32)
    positions = np.zeros((b, qn), np.int32)
    mask = np.zeros((b, qn, qn), bool)
    mask[:, np.arange(qn), np.arange(qn)] = True  # padding rows: inert
    lora = np.zeros((b, qn), bool)
    write = np.zeros((b, qn), bool)
    for i in range(n):
      t, pos, m, lo, w = ov.tree_layout(blk, drafts[i], plans[i], int(batch.prefix_len[i]), mask_id, slots,
                                       runner.cfg.draft_head)
      tokens[i], positions[i], mask[i], lora[i], write[i] = t[:qn], pos[:qn], m[:qn, :qn], lo[:qn], w[:qn]
    res, br_tok, br_sig = runner.fused(tokens, positions, mask, lora, write, batch.prefix_len, batch.page_table,
                                       batch.samp, blk)
    res.draft_tokens, res.draft_signals = drafts, signals
    forwards.append((fused_kind(slots) if any_branch else StepKind.VERIFY, blk, n))
    accepted = res.accepted[:n].astype(np.int64)
    outcomes, prefetch, traces = [], [], []
    for i in range(n):
      acc = int(accepted[i])
      outcome = ov.select_reuse(acc, res.tokens[i], plans[i], br_tok[i], blk) if plans[i] else None
      pref = None
      if outcome is not None and outcome.branch is not None:
        tok = br_tok[i, outcome.branch].copy()
        tok[0] = res.tokens[i, acc - 1]  # the committed next token (== the new seed)
        pref = ov.Prefetched(tok, br_sig[i, outcome.branch], plans[i][outcome.branch].kind)
      outcomes.append(outcome)
      prefetch.append(pref)
      if strategy.overlap_log is not None:
        traces.append(OverlapTrace(signals[i].copy(), acc, int(res.tokens[i, acc - 1]), **bounds[i]))
    drafted = np.zeros((n,), np.int64)
    drafted[need] = 1
    # rounds that also ran a draft forward cost more: the strategy times the two kinds apart
    label = OverlapKind.OVERLAP_DRAFT if need else OverlapKind.OVERLAP
    return verified_output(label, res, batch, accepted, forwards,
                           {StepKind.DRAFT: drafted, StepKind.VERIFY: np.ones((n,), np.int64)},
                           extra=OverlapResult(outcomes, prefetch, traces, n - len(need)))
