"""RecGuide's overlap round (docs/spec/recguide.md §4): verification-overlapped drafting, one forward per engine step.
The fused forward verifies the block of every request that holds a draft and drafts the branches its planner chose,
laid out as a tree (`overlap.tree_layout`); a request without a draft (entering overlap, or after a miss) drafts in
the same forward (`overlap.draft_layout`) and verifies in the next step's. A branch that verification confirms
(`overlap.select_reuse`) becomes the request's next draft (`RecGuideStrategy.observe` stores it), which saves that
request its drafting step. Only a step where no request holds a draft runs a draft forward alone.

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
  the confirmed branch or the request's own new draft as its next draft (None: none), the round's traces
  (`overlap_fit.OverlapTrace`, of the rows that verified, only while the strategy records them), the verifications
  that reused a branch (a draft forward saved). The rows that drafted instead of verifying: `RoundOutput.drafting`."""
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
    prefs = []
    for r in reqs:
      p = strategy.state(r).prefetched
      prefs.append(p if p is not None and len(p.tokens) == blk else None)
    ready = np.array([p is not None for p in prefs], bool)
    if not ready.any():
      return self._draft_only(runner, batch)
    drafts = np.zeros((b, blk), np.int32)
    signals = np.zeros((b, 3, blk), np.float32)
    for i in np.flatnonzero(ready).tolist():
      drafts[i], signals[i] = prefs[i].tokens, prefs[i].signals
    bounds = [self.bounds(runner, r, int(batch.prefix_len[i])) for i, r in enumerate(reqs)]
    plans = [strategy.plan_branches(signals[i], blk, bounds[i]) if ready[i] else [] for i in range(n)]
    slots = strategy.overlap_slots
    drafting = ~ready
    tree = drafting.any() or any(plans)
    mask_id, head = runner.cfg.mask_token_id, runner.cfg.draft_head
    qn = (1 + slots) * blk if tree else blk
    tokens = np.full((b, qn), mask_id, np.int32)
    positions = np.zeros((b, qn), np.int32)
    mask = np.zeros((b, qn, qn), bool)
    mask[:, np.arange(qn), np.arange(qn)] = True  # padding rows: inert
    lora = np.zeros((b, qn), bool)
    write = np.zeros((b, qn), bool)
    for i in range(n):
      committed = int(batch.prefix_len[i])
      if ready[i]:
        t, pos, m, lo, w = ov.tree_layout(blk, drafts[i], plans[i], committed, mask_id, slots, head)
      else:  # drafts here, verifies in the next step's forward
        t, pos, m, lo, w = ov.draft_layout(blk, int(batch.seed[i]), committed, mask_id, slots, head)
      tokens[i], positions[i], mask[i], lora[i], write[i] = t[:qn], pos[:qn], m[:qn, :qn], lo[:qn], w[:qn]
    res, br_tok, br_sig = runner.fused(tokens, positions, mask, lora, write, batch.prefix_len, batch.page_table,
                                       batch.samp, blk)
    res.draft_tokens, res.draft_signals = drafts, signals
    accepted = np.where(ready, res.accepted[:n], 0).astype(np.int64)
    outcomes, prefetch, traces = [], [], []
    for i in range(n):
      pref = outcome = None
      if not ready[i]:  # its own draft, for the next step
        pref = ov.Prefetched(br_tok[i, 0].copy(), br_sig[i, 0].copy(), ov.FRESH)
      elif plans[i]:
        acc = int(accepted[i])
        outcome = ov.select_reuse(acc, res.tokens[i], plans[i], br_tok[i], blk)
        if outcome.branch is not None:
          tok = br_tok[i, outcome.branch].copy()
          tok[0] = res.tokens[i, acc - 1]  # the committed next token (== the new seed)
          pref = ov.Prefetched(tok, br_sig[i, outcome.branch], plans[i][outcome.branch].kind)
      outcomes.append(outcome)
      prefetch.append(pref)
      if strategy.overlap_log is not None and ready[i]:
        traces.append(OverlapTrace(signals[i].copy(), int(accepted[i]), int(res.tokens[i, accepted[i] - 1]),
                                   **bounds[i]))
    saved = sum(p is not None and p.kind != ov.FRESH for p in prefs)
    verifies = ready.astype(np.int64)
    forwards = [(fused_kind(slots) if tree else StepKind.VERIFY, blk, n)]
    out = verified_output(OverlapKind.OVERLAP, res, batch, accepted, forwards,
                          {StepKind.DRAFT: drafting.astype(np.int64), StepKind.VERIFY: verifies},
                          extra=OverlapResult(outcomes, prefetch, traces, saved))
    out.drafting = drafting if drafting.any() else None
    return out

  def _draft_only(self, runner, batch: Batch) -> RoundOutput:
    """A step where no request holds a draft: a draft forward alone, its drafts kept for the next step."""
    n, blk = batch.n, batch.block
    samp = dataclasses.replace(batch.samp, temperature=np.zeros_like(batch.samp.temperature))  # argmax drafts
    tok, _, sig = runner.draft(batch.seed, batch.prefix_len, batch.page_table, blk, samp)
    tok, sig = jax.device_get((tok, sig))  # one device->host transfer
    prefetch = [ov.Prefetched(tok[i].copy(), sig[i].copy(), ov.FRESH) for i in range(n)]
    zeros, ones = np.zeros((n,), np.int64), np.ones((n,), np.int64)
    return RoundOutput(OverlapKind.OVERLAP_DRAFT, np.zeros((n, 1), np.int32), zeros, np.zeros((n, 1), np.float32),
                       zeros, np.full((n,), blk, np.int64), zeros, [(StepKind.DRAFT, blk, n)],
                       {StepKind.DRAFT: ones}, speculative=False, key_rounds=0, trim=False,
                       extra=OverlapResult([None] * n, prefetch, [], 0),
                       drafting=np.ones((n,), bool))
