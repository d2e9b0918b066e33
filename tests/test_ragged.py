"""Ragged steps (issue 36): LinearSS rows at their own blocks and AR rows in one draft and one verify forward,
compiled per packed-token bucket. Lossless: the same tokens as bucketed and padded grouping, and as AR."""

import zlib

import numpy as np
import pytest

from pallas_kernels.common import causal_mask
from recguide_jax import SamplingParams, benchmarks as bench
from recguide_jax.decoding.builtin import ARStrategy
from recguide_jax.decoding import rounds
from recguide_jax.decoding.strategy import AheadPlan, RoundPlan, StepPlan, Strategy

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MIXES = {  # per-request block choices a step draws from (1: an AR row)
  "linear": (8, 16, 32),
  "linear_ar": (1, 8, 16, 32),
  "ar_heavy": (1, 1, 1, 8),
}


class MixedBlocks(Strategy):
  """Plans each request at a block drawn per (request, step) from `choices`: every step mixes block sizes; LinearSS
  rows carry `verify_price`."""
  name = "mixed"

  def __init__(self, choices, verify_price=0.0):
    self.choices = choices
    self.verify_price = verify_price

  def plan_step(self, view):
    plans = []
    for req in view.requests:
      blk = self.choices[(zlib.crc32(req.request_id.encode()) + 7 * view.step) % len(self.choices)]
      plans.append(RoundPlan(rounds.AR, 1) if blk == 1 else RoundPlan(rounds.LINEAR, blk, self.verify_price))
    return StepPlan(tuple(plans))

  def block_sizes(self):
    return tuple(b for b in self.choices if b > 1)

  def step_kinds(self):
    return ("prefill", "draft", "verify", "ragged")


class StickyBlocks(MixedBlocks):
  """Plans each request at one block drawn per prompt from `choices`, every step alike: its steps run ahead."""
  name = "sticky"

  def plan_step(self, view):
    plans = []
    for req in view.requests:
      blk = self.choices[zlib.crc32(np.asarray(req.prompt_ids, np.int64).tobytes()) % len(self.choices)]
      plans.append(RoundPlan(rounds.AR, 1) if blk == 1 else RoundPlan(rounds.LINEAR, blk, self.verify_price))
    return StepPlan(tuple(plans))

  def plans_ahead(self, batch):
    return AheadPlan.again(batch)


class RoundBlocks(MixedBlocks):
  """Plans each request's k-th round at a block drawn per (prompt, k) from `choices`, and plans ahead on ragged
  steps with the next round's blocks: the rows of a call dispatched ahead change blocks, each row's sequence of
  blocks the same with or without running ahead."""
  name = "round_blocks"

  def __init__(self, choices, verify_price=0.0):
    super().__init__(choices, verify_price)
    self.rounds = {}  # request id -> rounds planned
    self.replanned = 0  # calls planned ahead at other blocks than the call before them

  def _block(self, req):  # by prompt, not request id: the same in every run
    k = self.rounds.get(req.request_id, 0)
    return self.choices[(zlib.crc32(np.asarray(req.prompt_ids, np.int64).tobytes()) + 7 * k) % len(self.choices)]

  def plan_step(self, view):
    plans = []
    for req in view.requests:
      blk = self._block(req)
      self.rounds[req.request_id] = self.rounds.get(req.request_id, 0) + 1
      plans.append(RoundPlan(rounds.AR, 1) if blk == 1 else RoundPlan(rounds.LINEAR, blk, self.verify_price))
    return StepPlan(tuple(plans))

  def plans_ahead(self, batch):
    blocks = np.array([self._block(r) for r in batch.reqs], np.int64)
    if not (batch.round.replans_rows and blocks.max() > 1):
      return None
    for r in batch.reqs:
      self.rounds[r.request_id] += 1
    self.replanned += int(not np.array_equal(blocks, batch.planned))
    return AheadPlan(blocks, np.where(blocks > 1, self.verify_price, 0.0))


def prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in np.tile(rng.integers(4, 128, int(rng.integers(1, 4))), 20)[:int(rng.integers(2, 30))]]
          for _ in range(n)]


@pytest.fixture(scope="module")
def ar_reference(tiny_llm):
  ps = prompts(8, 5)
  tiny_llm.set_policy(ARStrategy())
  return ps, [o.outputs[0].token_ids for o in tiny_llm.generate(ps, PARAMS)]


def run(llm, ps, strategy, bucketing, concurrency, params=PARAMS):
  llm.set_policy(strategy)
  llm.engine.bucketing = bucketing
  llm.engine.forward_log = []
  try:
    reqs, _ = bench.run_concurrent(llm.engine, ps, params, concurrency)
    log = llm.engine.forward_log
  finally:
    llm.engine.bucketing = "auto"
    llm.engine.forward_log = None
  assert llm.engine.allocator.num_used == 0
  return [r.output_ids for r in reqs], log


def test_ragged_layout_packs_rows_back_to_back():
  import jax.numpy as jnp
  from recguide_jax.runtime.steps import ragged_layout
  row_len = jnp.asarray([3, 0, 1, 2], jnp.int32)
  layout, j = ragged_layout(row_len, 4, 8)
  slot, token = np.asarray(layout.slot), np.asarray(layout.token)
  # packed tokens 0..5 belong to rows 0,0,0,2,3,3 at in-row indices 0,1,2,0,0,1
  assert slot[:6].tolist() == [0, 1, 2, 8, 12, 13] and np.asarray(j)[:6].tolist() == [0, 1, 2, 0, 0, 1]
  for r, n in enumerate(row_len.tolist()):
    for k in range(n):  # row slot (r, k) reads back the packed token that maps onto it
      assert slot[token[r, k]] == r * 4 + k
  assert slot.max() < 16 and token.max() < 8


@pytest.mark.parametrize("mix", sorted(MIXES))
def test_ragged_equals_ar(tiny_llm, ar_reference, mix):
  ps, ar = ar_reference
  out, log = run(tiny_llm, ps, MixedBlocks(MIXES[mix]), "ragged", 8)
  assert out == ar
  kinds = {k for k, _, _ in log} - {"prefill"}  # one draft and one verify forward per decode step, whatever the mix
  assert "ragged_verify" in kinds and kinds <= {"ragged_draft", "ragged_verify", "decode"}, kinds


def test_truncated_lengths_keep_the_head_whose_running_confidence_pays():
  conf = np.array([[1.0, 0.9, 0.8, 0.9, 0.5],  # running products 0.9, 0.72, 0.648, 0.324
                   [1.0, 0.9, 0.8, 0.9, 0.5],
                   [1.0, 0.1, 1.0, 1.0, 1.0],
                   [1.0, 0.2, 0.2, 0.2, 0.2]])
  blocks = np.array([5, 3, 5, 1])
  lengths = rounds.truncated_lengths(conf, blocks, np.array([0.7, 0.0, 0.5, 0.5]))
  # the seed and drafts 1..2 (0.72 >= 0.7); the whole block at price 0; the seed alone; an AR row stays 1
  assert lengths.tolist() == [3, 3, 1, 1]
  assert rounds.truncated_lengths(conf, np.array([5, 5, 5, 5]), np.zeros(4)).tolist() == [5] * 4


@pytest.mark.parametrize("price", [0.05, 0.4])
def test_truncated_verifies_equal_ar(tiny_llm, ar_reference, price):
  """Rows verifying only the head of their drafts that pays at `price`: the same tokens as AR, fewer verify tokens
  than drafted."""
  ps, ar = ar_reference
  out, log = run(tiny_llm, ps, MixedBlocks(MIXES["linear_ar"], verify_price=price), "ragged", 8)
  assert out == ar
  assert bench.unverified_drafts(log) > 0


def test_ragged_equals_bucketed_and_padded(tiny_llm, ar_reference):
  """The same requests and plans grouped per block size, padded to the largest, and ragged: the same tokens."""
  ps, _ = ar_reference
  ps = ps[:4]
  outs = {b: run(tiny_llm, ps, MixedBlocks(MIXES["linear_ar"]), b, 4)[0] for b in (True, False, "ragged")}
  assert outs["ragged"] == outs[True] == outs[False]


def test_ragged_rows_join_and_leave(tiny_llm, ar_reference):
  """Concurrency below the batch: rows come and go between steps, partial ragged batches."""
  ps, ar = ar_reference
  out, _ = run(tiny_llm, ps, MixedBlocks(MIXES["linear_ar"]), "ragged", 3)
  assert out == ar


@pytest.mark.parametrize("price", [0.0, 0.4])
@pytest.mark.parametrize("strategy_cls", [StickyBlocks, RoundBlocks])
def test_ragged_steps_run_ahead_with_the_same_tokens(tiny_llm, ar_reference, price, strategy_cls):
  """A ragged step planned ahead is dispatched while the one before it runs, from that one's seeds and committed
  lengths on the device (each row at its own block, truncated verifies included), whether its rows keep their blocks
  (`StickyBlocks`) or take others (`RoundBlocks`: an `AheadPlan` whose blocks change every step): the same tokens as
  AR; sampled, the same tokens as without running ahead."""
  ps, ar = ar_reference
  engine = tiny_llm.engine
  ahead = []
  dispatch_ahead = engine._dispatch_ahead
  engine._dispatch_ahead = lambda batch, *a: ahead.append(batch.round) or dispatch_ahead(batch, *a)
  try:
    strategy = strategy_cls(MIXES["linear_ar"], price)
    out, log = run(tiny_llm, ps, strategy, "ragged", 8)
    assert out == ar and ahead and set(ahead) == {rounds.RAGGED}
    assert (bench.unverified_drafts(log) > 0) == (price > 0)
    assert getattr(strategy, "replanned", 1) > 0
    sampled = SamplingParams(max_tokens=24, temperature=0.8, seed=11, ignore_eos=True)
    outs = {}
    for pipeline in (True, False):
      engine.pipeline = pipeline
      outs[pipeline], _ = run(tiny_llm, ps, strategy_cls(MIXES["linear_ar"], price), "ragged", 8, sampled)
  finally:
    engine.pipeline = True
    del engine._dispatch_ahead
  assert outs[True] == outs[False] and outs[True] != ar


def test_ragged_variants_do_not_grow_with_block_sizes(tiny_llm):
  runner = tiny_llm.engine.runner
  few = [v for v in runner.variants(["ragged"], (8, 32)) if v.kind.ragged]
  assert few == [v for v in runner.variants(["ragged"], (8, 12, 16, 24, 32)) if v.kind.ragged]
  assert len(few) == 2 * len(runner.config.ragged_buckets)


@pytest.mark.parametrize("verify_price", [0.0, 0.3])
def test_ragged_sampling_keeps_the_ar_distribution(verify_price):
  """Sampled ragged steps over several rounds whose rows switch between AR and LinearSS at blocks 2 and 3 from step
  to step, with and without truncated verifies: the continuations follow the exact AR distribution (chi-square
  over every continuation)."""
  from flax import nnx
  from recguide_jax import LLM
  from recguide_jax.model.nld import NLDModel
  from tests.conftest import tiny_config
  from tests.test_sampling import MASK, PROMPT, VOCAB, chi_square_pvalue
  n_tokens, n_samples = 6, 2000  # the prefill samples the first token: 5 decoded over >= 3 rounds
  cfg = tiny_config(vocab_size=VOCAB, mask_token_id=MASK, eos_token_ids=(0,), bos_token_id=1)
  model = NLDModel(cfg, rngs=nnx.Rngs(3))
  llm = LLM(model=model, policy=MixedBlocks((1, 1, 1, 2, 3), verify_price), max_num_seqs=32, max_model_len=32,
            page_size=4, prefill_chunk=4, block_sizes=(2, 3), warmup=False, compile_cache_dir=None,
            bucketing="ragged")
  params = SamplingParams(max_tokens=n_tokens, temperature=0.9, ignore_eos=True)
  llm.engine.forward_log = []
  outs = llm.generate([PROMPT] * n_samples, [params.__class__(**{**params.__dict__, "seed": 7000 + i})
                                              for i in range(n_samples)])
  log = llm.engine.forward_log
  assert {"ragged_draft", "ragged_verify"} <= {k for k, _, _ in log}
  assert (bench.unverified_drafts(log) > 0) == (verify_price > 0)
  rounds = [len(o.metrics["block_sizes"]) for o in outs]
  assert np.mean(rounds) >= 3 and min(rounds) >= 2, np.mean(rounds)
  assert all(len(set(o.metrics["block_sizes"])) > 1 for o in outs[:50])  # each request's rows switch blocks
  exact = _exact(model, params, n_tokens)
  pvalue = chi_square_pvalue([o.outputs[0].token_ids for o in outs], exact)
  assert pvalue > 0.01, f"ragged sampled continuations deviate from AR (p={pvalue:.2e})"


def _exact(model, params, n_tokens):
  """P(continuation) of every continuation of `n_tokens` tokens after test_sampling's PROMPT (one causal forward)."""
  import itertools
  import jax.numpy as jnp
  from recguide_jax.model.nld import ForwardInputs
  from recguide_jax.runtime import sampling
  from tests.test_sampling import MASK, PROMPT, VOCAB
  conts = list(itertools.product([t for t in range(VOCAB) if t != MASK], repeat=n_tokens))
  seqs = jnp.asarray([PROMPT + list(c) for c in conts])
  b, n = seqs.shape
  logits, _ = model(ForwardInputs(tokens=seqs, positions=jnp.broadcast_to(jnp.arange(n), (b, n)),
                                  block_mask=causal_mask(n)))
  p = np.asarray(sampling.processed_probs(logits, jnp.full((b,), params.temperature), jnp.full((b,), params.top_k),
                                          jnp.full((b,), params.top_p), MASK))
  rows = np.arange(b)[:, None]
  cols = len(PROMPT) - 1 + np.arange(n_tokens)[None, :]
  probs = np.prod(p[rows, cols, np.asarray(conts)], axis=1)
  return dict(zip(conts, probs.tolist()))


# ---- pricing (recguide/pricing.py) ------------------------------------------------------------------------------
def test_fitted_rule_keeps_its_form_on_another_profile():
  from recguide_jax.recguide import pricing
  fitted = {8: 17.1, 16: 18.7, 32: 21.5}
  values = {8: 4.0, 16: 5.1, 32: 5.9}
  rho = 0.3
  assert pricing.rescaled_rho(rho, fitted, fitted) == rho
  # the same device in another time unit (or 2x slower throughout): the same block as the fitted rule
  slower = {b: 2 * c for b, c in fitted.items()}
  want = max(sorted(fitted), key=lambda b: (values[b] - rho * fitted[b], -b))
  assert pricing.decide_rescaled(values, rho, fitted, slower) == want
  # not the ratio rule: argmax V/T picks another block here
  assert max(fitted, key=lambda b: values[b] / slower[b]) != want


def test_ragged_step_prices_below_bucketing_and_padding_on_the_b200_table():
  from recguide_jax.recguide import pricing
  from recguide_jax.recguide.profile import load_profile
  prof = load_profile("b200_nld8b")
  blocks = [8] * 10 + [16] * 12 + [32] * 10
  c = len(blocks)
  ragged = pricing.ragged_step_cost(blocks, prof)
  bucketed = sum(prof.cost(blocks.count(b), b) for b in (8, 16, 32))
  padded = prof.cost(c, 32)
  assert ragged < bucketed and ragged < padded
  # a uniform plan prices as the table's own round (mean block = B)
  assert abs(pricing.ragged_step_cost([16] * 8, prof) - prof.cost(8, 16)) < 1e-9
  assert pricing.ragged_step_cost([1, 1], prof) == prof.ar_cost(2)


def test_a_plan_priced_by_its_rows_per_block_costs_what_its_rows_cost():
  """A whole-step plan priced by its rows per block (as RecGuide's batch pricing prices its fixed and mixed plans)
  costs exactly what the same plan listed row by row costs, ragged and bucketed."""
  import collections

  from recguide_jax.decoding import grouping
  from recguide_jax.recguide import pricing
  from recguide_jax.recguide.profile import load_profile
  prof = load_profile("b200_nld8b")
  rng = np.random.default_rng(5)
  plans = [[], [16] * 8, [1] * 3, [1, 8, 8, 32]] + [rng.choice([1, 8, 16, 32], int(rng.integers(1, 40))).tolist()
                                                    for _ in range(20)]
  for cost in (lambda rows, blk: prof.cost(rows, blk), lambda rows, blk: 10.0 + rows * blk / 4):
    for blocks in plans:
      drafted = [b for b in blocks if b > 1]
      # one draft forward of the drafting rows' blocks packed, one verify of every row (an AR step without any)
      want = (0.0 if not blocks else prof.ar_cost(len(blocks)) if not drafted else
              prof.ragged_cost(len(drafted), sum(drafted), draft=True)
              + prof.ragged_cost(len(blocks), sum(blocks), draft=False))
      assert pricing.ragged_counts_cost(collections.Counter(blocks), prof) == want
      assert pricing.ragged_step_cost(blocks, prof) == want
      if drafted:  # the plan's own rows, batched the cheapest way (one block: one batch, no search)
        sizes = sorted(set(drafted))
        splits = [[[s] for s in sizes]] + ([[sizes]] if len(sizes) > 1 else [])
        priced = [sum(cost(sum(drafted.count(b) for b in run), run[-1]) for run in runs) for runs in splits]
        assert grouping.plan_cost(collections.Counter(drafted), cost) <= min(priced) + 1e-9
        if len(sizes) == 1:
          assert grouping.plan_cost(collections.Counter(drafted), cost) == cost(len(drafted), sizes[0])


def test_ragged_verify_below_the_smallest_block_prices_down_to_a_measured_ar_step():
  """On a profile that measured its AR step, a ragged verify of fewer than the smallest block's tokens per row (AR
  rows, truncated verifies) costs linearly less, down to the AR step at one per row, never above the smallest
  block and never below a cheaper verify; without a measured AR step it is the smallest block's cost."""
  from recguide_jax.recguide import pricing
  from recguide_jax.recguide.profile import load_profile
  for name in ("h200_nld8b", "docs/profile_cpu.json"):
    prof = load_profile(name)
    for c in (1, 2, 8, 32):
      v8 = prof.forward_costs(c, 8)[1]
      costs = [prof.ragged_cost(c, n, draft=False) for n in range(c, 8 * c + 1)]
      assert costs[-1] == pytest.approx(v8) and costs[0] == pytest.approx(min(prof.ar_cost(c), v8))
      assert all(a <= b + 1e-12 for a, b in zip(costs, costs[1:]))
    # h200's AR step at C = 1 is slower than its B = 8 verify: flat there; the CPU's is far cheaper
    flat = prof.ragged_cost(1, 4, draft=False) == pytest.approx(prof.forward_costs(1, 8)[1])
    assert flat == (prof.name == "h200_nld8b")
    # a mixed step of AR and B = 8 rows prices below the same rows all at B = 8
    assert pricing.ragged_step_cost([1] * 4 + [8] * 4, prof) < pricing.ragged_step_cost([8] * 8, prof)
    # and a truncated B = 8 row saves: its last verify token has a price
    assert pricing.verify_token_price([8] * 8, 30.0, prof) > 0
  b200 = load_profile("b200_nld8b")
  assert b200.ragged_cost(8, 20, draft=False) == b200.forward_costs(8, 8)[1]


def _times_three(prof):
  """`prof` in another time unit: every cost 3x."""
  from recguide_jax.recguide.profile import HardwareProfile
  return HardwareProfile(draft_verify_ms={c: {b: 3 * ms for b, ms in row.items()}
                                          for c, row in prof.draft_verify_ms.items()}, name=f"{prof.name}_times_3")


def _recguide_fixtures():
  from tests import test_recguide_priced as tp
  return tp


def test_recguide_prices_a_mixed_step_as_one_ragged_forward():
  """On ragged steps a step's mixed blocks cost one ragged draft + verify: the per-request rule's mix (B = 32 for
  requests that keep accepting, 8 for the others) wins, where split into a batch per block it loses to one block."""
  from recguide_jax.recguide.controller import RecGuideStrategy
  from recguide_jax.recguide.profile import load_profile
  tp = _recguide_fixtures()
  prof = load_profile("b200_nld8b")
  accepts = {"confident": {8: 8, 16: 15, 32: 28}, "unsure": {8: 3, 16: 3, 32: 3}}
  tables = tp._tables(prof, 0.1, accepts)
  reqs = [tp._Req(k, accepts) for k in ["confident", "unsure"] * 16]
  chosen = {}
  for ragged in (False, True):
    pol = RecGuideStrategy(16, profile=prof, tables=tables, overlap=False, calibrate=False)
    pol.ragged_steps = ragged
    chosen[ragged] = pol.price_step(reqs, len(reqs))
  name, blocks = chosen[True]
  assert name == "rule" and blocks == [32, 8] * 16
  assert chosen[False][0] != "rule" and len(set(chosen[False][1])) == 1


def test_recguide_off_its_tables_profile_keeps_the_fitted_rule():
  """Tables fitted on one profile, the policy priced on another in a different time unit (3x every cost): the same
  blocks as the tables' own rule V - rho T (rho rescaled), not the ratio V / T."""
  from recguide_jax.recguide.controller import RecGuideStrategy
  from recguide_jax.recguide.profile import load_profile
  tp = _recguide_fixtures()
  prof = load_profile("b200_nld8b")
  slow = _times_three(prof)
  accepts = {"confident": {8: 8, 16: 12, 32: 14}, "unsure": {8: 3, 16: 3, 32: 3}}
  tables = tp._tables(prof, 0.12, accepts)
  pol = RecGuideStrategy(16, profile=slow, tables=tables, overlap=False, calibrate=False, batch_priced=False)
  assert not pol._tables_priced_here
  ratio_rule_differs = False
  for c in (1, 8, 32):
    for kind in ("confident", "unsure"):
      req = tp._Req(kind, accepts)
      want = tables.next_block(c, req.strategy_state.history)
      assert pol._adaptive_block(req, c) == want, (c, kind)
      values, costs = pol._values(req), pol._linear_costs(c)
      ratio_rule_differs |= max((8, 16, 32), key=lambda b: (values[b] / costs[b], -b)) != want
  assert ratio_rule_differs  # the case is one where the two rules part


@pytest.mark.parametrize("impl", ["reference", "pallas_gpu", "pallas_tpu"])
def test_ragged_forward_matches_each_rows_own_forward(impl):
  """The model's ragged forward (packed tokens, rows of 3, 0, 8 and 1 tokens over prefixes in the paged cache)
  gives each row's logits and K/V writes of that row's own forward at its own block; the attention of the row
  layout runs on the XLA path or, interpreted, on either Pallas kernel (what the dispatcher picks on an
  accelerator)."""
  import jax
  import jax.numpy as jnp
  from flax import nnx
  from recguide_jax.attention.dispatch import set_attention_impl
  from recguide_jax.model.nld import ForwardInputs, NLDModel
  from recguide_jax.runtime.steps import ragged_inputs, ragged_layout
  from tests.conftest import tiny_config
  cfg = tiny_config()
  model = NLDModel(cfg, rngs=nnx.Rngs(1))
  set_attention_impl(model, impl)
  page_size, width, pages = 8, 8, 4
  row_len = np.array([3, 0, 8, 1], np.int32)
  prefix = np.array([5, 0, 12, 20], np.int32)
  rows = len(row_len)
  table = 1 + np.arange(rows * pages, dtype=np.int32).reshape(rows, pages)
  rng = np.random.default_rng(0)
  cache = model.new_cache(1 + rows * pages, page_size)
  cache = type(cache)(*(jnp.asarray(rng.normal(size=x.shape), x.dtype) for x in (cache.k, cache.v)))
  tokens = rng.integers(4, cfg.vocab_size, (rows, width)).astype(np.int32)
  causal = causal_mask(width)[None] & (jnp.arange(width)[None, None] < row_len[:, None, None])
  write = np.arange(width)[None] < row_len[:, None]
  layout, j = ragged_layout(jnp.asarray(row_len), width, 16)
  inp = ragged_inputs(layout, j, jnp.asarray(tokens), jnp.asarray(prefix), jnp.asarray(table), causal,
                      jnp.asarray(write), None)
  logits, new_cache = jax.jit(lambda c: model(inp, c))(cache)
  logits = np.asarray(logits[0])[np.asarray(layout.token)]  # [rows, width, V]
  for r in range(rows):
    n = int(row_len[r])
    if not n:
      continue
    own = ForwardInputs(tokens=jnp.asarray(tokens[r:r + 1, :n]), positions=jnp.asarray(prefix[r] + np.arange(n))[None],
                        block_mask=causal_mask(n), prefix_len=jnp.asarray(prefix[r:r + 1]),
                        page_table=jnp.asarray(table[r:r + 1]), kv_write=jnp.ones((1, n), bool))
    want, want_cache = model(own, cache)
    np.testing.assert_allclose(logits[r, :n], np.asarray(want[0]), rtol=2e-4, atol=2e-4)
    for got_pages, want_pages in ((new_cache.k, want_cache.k), (new_cache.v, want_cache.v)):
      np.testing.assert_allclose(np.asarray(got_pages)[:, table[r]], np.asarray(want_pages)[:, table[r]],
                                 rtol=1e-5, atol=1e-5)


def _truncating_recguide(prof, tables, **kw):
  from recguide_jax.recguide.controller import RecGuideStrategy
  return RecGuideStrategy(16, profile=prof, tables=tables, overlap=False, calibrate=False,
                          fixed_regime="adaptive", **kw)


def test_recguide_prices_verified_tokens_on_ragged_steps():
  """With verify truncation, a ragged step's LinearSS rows carry the step's rate times its verify's last token cost
  (none on bucketed steps, none with truncation off); a profile in another time unit prices them alike."""
  from recguide_jax.decoding.strategy import StepView
  from recguide_jax.recguide import pricing
  from recguide_jax.recguide.profile import load_profile
  tp = _recguide_fixtures()
  prof = load_profile("b200_nld8b")
  slow = _times_three(prof)
  accepts = {"confident": {8: 8, 16: 15, 32: 28}, "unsure": {8: 3, 16: 3, 32: 3}}
  tables = tp._tables(prof, 0.1, accepts)
  reqs = tuple(tp._Req(k, accepts) for k in ["confident", "unsure"] * 16)

  def prices(ragged, profile=prof, **kw):
    pol = _truncating_recguide(profile, tables, **kw)
    plans = pol.plan_step(StepView(0, reqs, 32, 1024, 32, frozenset({2}), ragged_steps=ragged)).plans
    return [p.block_size for p in plans], [p.verify_price for p in plans], pol

  blocks, price, pol = prices(True, verify_truncation=True)
  assert blocks == [32, 8] * 16
  tokens = sum(pol._values(r)[b] for r, b in zip(reqs, blocks))
  want = pricing.verify_token_price(blocks, tokens, prof)
  assert want > 0 and price == pytest.approx([want] * 32)
  assert prices(True, slow, verify_truncation=True)[1] == pytest.approx(price)  # a ratio of costs: unit-free
  assert set(prices(False, verify_truncation=True)[1]) == {0.0}
  assert set(prices(True)[1]) == {0.0}
  # rows at the profile's smallest block: a shorter verify costs the same, nothing to truncate
  assert pricing.verify_token_price([8] * 32, 100.0, prof) == 0.0


def test_recguide_truncated_verifies_equal_ar_and_record_what_they_verified(tiny_llm, ar_reference):
  """RecGuide deciding with the B200 table on ragged steps with verify truncation: AR's tokens, some drafts left
  unverified, and a truncated round that accepted all it verified is remembered at the length it verified (it says
  nothing of the block's further tokens); any other round at its planned block."""
  from recguide_jax.recguide.profile import load_profile
  ps, ar = ar_reference
  pol = _truncating_recguide(load_profile("b200_nld8b"), None, verify_truncation=True, batch_priced=False)
  rounds_seen = []  # (planned, verified, accepted, blocks observed)
  observe, observe_verifications = pol.observe, pol.observe_verifications

  def spy_observe(outcome):
    out = outcome.output
    rounds_seen.append([out.block, out.verified, np.asarray(out.accepted), None])
    observe(outcome)

  def spy_verifications(reqs, blocks, *args, **kw):
    rounds_seen[-1][3] = np.asarray(blocks)
    observe_verifications(reqs, blocks, *args, **kw)

  pol.observe, pol.observe_verifications = spy_observe, spy_verifications
  tiny_llm.set_policy(pol)
  tiny_llm.engine.bucketing = "ragged"
  tiny_llm.engine.forward_log = []
  try:
    reqs, _ = bench.run_concurrent(tiny_llm.engine, ps, PARAMS, 8)
    log = tiny_llm.engine.forward_log
  finally:
    tiny_llm.engine.bucketing = "auto"
    tiny_llm.engine.forward_log = None
  assert tiny_llm.engine.allocator.num_used == 0
  assert [r.output_ids for r in reqs] == ar
  assert bench.unverified_drafts(log) > 0
  censored = 0
  for planned, verified, accepted, observed in rounds_seen:
    if verified is None or observed is None:
      continue
    cut = (verified < planned) & (accepted >= verified)
    assert observed.tolist() == np.where(cut, verified, planned).tolist()
    censored += int(cut.sum())
  assert censored > 0
