"""RecGuide's overlap round (docs/spec/recguide.md §4): verification-overlapped drafting for greedy requests. A draft
forward runs only for requests without a prefetched block; then one fused forward verifies every request's block
and drafts the branches its planner chose, laid out as a tree (`overlap.tree_layout`). A branch that verification
confirms (`overlap.select_reuse`) is kept as the request's next draft, which saves that round's draft forward."""

from __future__ import annotations

import jax
import numpy as np

from recguide_jax.decoding.strategy import Group, Round, RoundContext, RoundKind
from recguide_jax.recguide import overlap as ov
from recguide_jax.recguide.fit.overlap_fit import OverlapTrace
from recguide_jax.engine.requests import Forward


class OverlapRound(Round):
  """The round RecGuide plans in its overlap regime; bound to its strategy (planner, slots, online estimates)."""
  kind = RoundKind.OVERLAP

  def __init__(self, strategy):
    self.strategy = strategy

  @staticmethod
  def bounds(ctx: RoundContext, r) -> dict:
    """What limits a request's branches this round (token budget, cache length), as the planners take them."""
    return dict(generated=len(r.output_ids), committed=ctx.committed(r), max_new=r.params.max_tokens,
                max_len=ctx.rc.max_model_len + ctx.rc.max_block)

  def run(self, ctx: RoundContext, group: Group) -> RoundKind:
    reqs, blk = group.reqs, group.block
    strategy = self.strategy
    states = [strategy.state(r) for r in reqs]
    ctx.reserve(reqs, blk)
    b, page_table, prefix_len, samp = ctx.batch_arrays(reqs)
    drafts = np.zeros((b, blk), np.int32)
    signals = np.zeros((b, 3, blk), np.float32)
    prefs = [s.prefetched if s.prefetched is not None and len(s.prefetched.tokens) == blk else None for s in states]
    need = [i for i, p in enumerate(prefs) if p is None]
    if need:
      sub = [reqs[i] for i in need]
      b2, pt2, pl2, samp2 = ctx.batch_arrays(sub)
      seed, _ = ctx.seeds(sub, b2)
      tok, _, sig = ctx.runner.draft(seed, pl2, pt2, blk, samp2)
      tok, sig = jax.device_get((tok, sig))  # one device->host transfer
      ctx.count_forward(Forward.DRAFT, blk, len(sub))
      for j, i in enumerate(need):
        drafts[i], signals[i] = tok[j], sig[j]
        reqs[i].stats.forwards[Forward.DRAFT] += 1
    for i, pref in enumerate(prefs):
      if pref is not None:
        drafts[i], signals[i] = pref.tokens, pref.signals
        ctx.totals["overlap_saved_drafts"] += 1
    bounds = [self.bounds(ctx, r) for r in reqs]
    plans = [strategy.plan_branches(signals[i], blk, bounds[i]) for i in range(len(reqs))]
    any_branch = any(plans)
    slots = strategy.overlap_slots
    mask_id = ctx.cfg.mask_token_id
    qn = (1 + slots) * blk if any_branch else blk
    tokens = np.full((b, qn), mask_id, np.int32)
    positions = np.zeros((b, qn), np.int32)
    mask = np.zeros((b, qn, qn), bool)
    mask[:, np.arange(qn), np.arange(qn)] = True  # padding rows: inert
    lora = np.zeros((b, qn), bool)
    write = np.zeros((b, qn), bool)
    for i in range(len(reqs)):
      t, pos, m, lo, w = ov.tree_layout(blk, drafts[i], plans[i], int(prefix_len[i]), mask_id, slots)
      tokens[i], positions[i], mask[i], lora[i], write[i] = t[:qn], pos[:qn], m[:qn, :qn], lo[:qn], w[:qn]
    res, br_tok, br_sig = ctx.runner.fused(tokens, positions, mask, lora, write, prefix_len, page_table, samp, blk)
    res.draft_tokens, res.draft_signals = drafts, signals
    from recguide_jax.runtime.runner import fused_kind
    ctx.count_forward(fused_kind(slots) if any_branch else Forward.VERIFY, blk, len(reqs))
    for i, r in enumerate(reqs):
      r.stats.forwards[Forward.VERIFY] += 1
      accepted = int(res.accepted[i])
      if plans[i]:
        outcome = ov.select_reuse(accepted, res.tokens[i], plans[i], br_tok[i], blk)
        ctx.totals[f"overlap_{outcome.label}"] += 1
        r.stats.overlap[outcome.label] = r.stats.overlap.get(outcome.label, 0) + 1
        strategy.observe_overlap(r, outcome.branch is not None)
      else:
        outcome = None
        ctx.totals["overlap_no_branch"] += 1
      if strategy.overlap_log is not None:
        strategy.overlap_log.append(OverlapTrace(signals[i].copy(), accepted, int(res.tokens[i, accepted - 1]),
                                                 **bounds[i]))
      ctx.verified(r, blk, accepted, res, i)
      if outcome is not None and outcome.branch is not None and not r.finished:
        tok = br_tok[i, outcome.branch].copy()
        tok[0] = res.tokens[i, accepted - 1]  # the committed next token (== the new seed)
        states[i].prefetched = ov.Prefetched(tok, br_sig[i, outcome.branch], plans[i][outcome.branch].kind)
    # rounds that also ran a draft forward cost more: the strategy times the two kinds apart
    return RoundKind.OVERLAP_DRAFT if need else RoundKind.OVERLAP
