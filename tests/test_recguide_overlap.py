"""RecGuide overlap: branch planner, tree mask, reuse rules, exactness of the fused forward, and end to end: greedy
output unchanged and a hit really saves a draft forward."""

import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import causal_mask
from recguide_jax import SamplingParams
from recguide_jax.model.nld import ForwardInputs
from recguide_jax.recguide import overlap as ov
from recguide_jax.recguide.fit import overlap_fit as ovf


def signals_with_margins(margins, alts=None):
  b = len(margins)
  sig = np.zeros((3, b), np.float32)
  sig[0] = 0.9
  sig[1] = margins
  sig[2] = alts if alts is not None else np.arange(100, 100 + b)
  return sig


@pytest.mark.parametrize("risky,expected", [
    ([], [("continuation", 8)]),
    ([3], [("correction", 3), ("continuation", 8)]),
    ([2, 5], [("correction", 2), ("correction", 5), ("continuation", 8)]),
    ([1, 4, 6], [("correction", 1), ("correction", 4)]),
    ([1, 2, 3, 7], [("correction", 1), ("correction", 2)]),
])
def test_branch_plan_follows_no_p3_rule(risky, expected):
  margins = np.full(8, 0.9)
  margins[0] = 0.0  # the seed position is never scanned
  margins[risky] = 0.2
  analysis = ov.analyze(signals_with_margins(margins), delta=0.5)
  assert analysis.risky == tuple(risky[:3]) and analysis.crossings == len(risky)
  plan = ov.plan_branches(analysis, 8, generated=0, committed=10, max_new=100, max_len=1000)
  assert [(b.kind, b.pre) for b in plan] == expected
  for b in plan:
    if b.kind == "correction":
      assert b.alt == 100 + b.pre


def test_margin_equal_to_delta_is_not_risky_and_boundary_filters():
  margins = np.array([0, 0.5, 0.49, 0.9, 0.9, 0.9, 0.9, 0.9])
  a = ov.analyze(signals_with_margins(margins), 0.5)
  assert a.risky == (2,)
  # near the end of max_tokens: no continuation, correction at 2 still fits
  plan = ov.plan_branches(a, 8, generated=93, committed=10, max_new=100, max_len=1000)
  assert [(b.kind, b.pre) for b in plan] == [("correction", 2)]
  plan = ov.plan_branches(a, 8, generated=98, committed=10, max_new=100, max_len=1000)
  assert plan == []
  # no valid alternative token: no correction branch
  a2 = ov.analyze(signals_with_margins(margins, alts=np.full(8, -1)), 0.5)
  assert [b.kind for b in ov.plan_branches(a2, 8, generated=0, committed=0, max_new=99, max_len=999)] == [
      "continuation"]
  # components switch parts off (ablations)
  plan = ov.plan_branches(a, 8, generated=0, committed=0, max_new=99, max_len=999, components=("continuation",))
  assert [b.kind for b in plan] == ["continuation"]


def _brute_force_expected_hit(signals, block, allowed, slots=ov.MAX_BRANCHES, gamma=1.0):
  conf, margin, alt = signals
  scores = []
  for p in range(1, block):
    if alt[p] >= 0 and p in allowed:
      scores.append((np.prod(conf[1:p]) ** gamma * (conf[p] - margin[p]), p, int(alt[p])))
  if block in allowed:
    scores.append((np.prod(conf[1:block]) ** gamma * np.mean(conf[1:block]), block, -1))
  top = sorted(scores, key=lambda s: (-s[0], s[1]))[:slots]
  return sorted((p, a) for _, p, a in top)


@pytest.mark.parametrize("seed", range(6))
def test_expected_hit_planner_matches_brute_force(seed):
  rng = np.random.default_rng(seed)
  block = 16
  conf = rng.uniform(0.3, 1.0, block)
  margin = conf * rng.uniform(0.0, 1.0, block)
  alt = rng.integers(8, 100, block).astype(float)
  alt[rng.integers(1, block)] = -1  # no executable alternative there
  signals = np.stack([conf, margin, alt])
  got = ov.plan_expected_hit(signals, block, generated=0, committed=0, max_new=1000, max_len=1000)
  assert [(b.pre, b.alt if b.kind == ov.CORRECTION else -1) for b in got] == \
      _brute_force_expected_hit(signals, block, set(range(1, block + 1)))
  assert [b.pre for b in got] == sorted(b.pre for b in got) and len(got) == ov.MAX_BRANCHES
  assert all((b.kind == ov.CONTINUATION) == (b.pre == block) for b in got)
  # boundary filters: 5 tokens left drop corrections at p >= 5 and the continuation
  got = ov.plan_expected_hit(signals, block, generated=10, committed=0, max_new=15, max_len=1000)
  assert [(b.pre, b.alt) for b in got] == _brute_force_expected_hit(signals, block, set(range(1, 5)))
  # a wider tree keeps the same ranking and fills every slot
  wide = ov.plan_expected_hit(signals, block, generated=0, committed=0, max_new=1000, max_len=1000, max_branches=6)
  assert len(wide) == 6 and {(b.pre, b.alt) for b in got} <= {(b.pre, b.alt) for b in wide}
  assert [(b.pre, b.alt if b.kind == ov.CORRECTION else -1) for b in wide] == \
      _brute_force_expected_hit(signals, block, set(range(1, block + 1)), 6)
  # a prefix exponent below 1 flattens the prefix product: the same brute force with (prod C)^gamma
  for gamma in (0.2, 0.5, 1.5):
    got = ov.plan_expected_hit(signals, block, generated=0, committed=0, max_new=1000, max_len=1000,
                               max_branches=4, prefix_exponent=gamma)
    assert [(b.pre, b.alt if b.kind == ov.CORRECTION else -1) for b in got] == \
        _brute_force_expected_hit(signals, block, set(range(1, block + 1)), 4, gamma)


def test_prefix_exponent_moves_corrections_later_and_is_fitted_by_replay():
  block = 8
  # a confident draft whose positions 1..7 all have a plausible runner-up, the late ones a stronger one
  conf = np.array([1.0, 0.7, 0.7, 0.7, 0.7, 0.8, 0.8, 0.8])
  runner_up = np.array([0.0, 0.1, 0.1, 0.1, 0.1, 0.3, 0.3, 0.3])
  signals = np.stack([conf, conf - runner_up, np.arange(100, 100 + block, dtype=float)])
  bounds = dict(generated=0, committed=0, max_new=block, max_len=100)  # no room for a continuation
  plain = ov.plan_expected_hit(signals, block, max_branches=2, **bounds)
  flat = ov.plan_expected_hit(signals, block, max_branches=2, prefix_exponent=0.1, **bounds)
  assert [b.pre for b in plain] == [1, 5] and [b.pre for b in flat] == [5, 6]
  # logged rounds whose verifier rejected at 6 and picked the runner-up: only the flat prefix covers them
  hit6 = ovf.OverlapTrace(signals, accepted=6, seed=106, **bounds)
  miss = ovf.OverlapTrace(signals, accepted=6, seed=7, **bounds)  # rejected at 6, another correction
  assert ovf.replay_correction_hits([hit6, miss], block, 2, 1.0) == 0.0
  assert ovf.replay_correction_hits([hit6, miss], block, 2, 0.1) == 0.5
  gamma, rates = ovf.fit_prefix_exponent([hit6, miss], block, 2, grid=(0.1, 0.3, 0.5, 1.0))
  assert rates[1.0] == 0.0 and rates[0.1] == 0.5
  assert gamma == max(g for g, r in rates.items() if r == 0.5)  # ties to the larger exponent
  # rejected at 1 with the runner-up: the plain product covers it, and a tie keeps gamma = 1
  hit1 = ovf.OverlapTrace(signals, accepted=1, seed=101, **bounds)
  assert ovf.fit_prefix_exponent([hit1], block, 3, grid=(0.1, 1.0))[0] == 1.0
  with pytest.raises(ValueError, match="prefix_exponent"):
    ov.plan_expected_hit(signals, block, prefix_exponent=0.0, **bounds)
  with pytest.raises(ValueError, match="no overlap rounds"):
    ovf.replay_correction_hits([], block, 3, 1.0)


def test_expected_hit_planner_prefers_the_continuation_for_a_confident_draft():
  block = 8
  conf = np.full(block, 0.99)
  signals = np.stack([conf, conf - 0.005, np.full(block, 42.0)])
  got = ov.plan_expected_hit(signals, block, generated=0, committed=0, max_new=100, max_len=100)
  assert got[-1].kind == ov.CONTINUATION and len(got) == 3
  # an uncertain position with a strong runner-up gets a correction
  conf[2], signals[1, 2] = 0.4, 0.05
  got = ov.plan_expected_hit(signals, block, generated=0, committed=0, max_new=100, max_len=100)
  assert (2, 42) in [(b.pre, b.alt) for b in got if b.kind == ov.CORRECTION]


def test_reuse_with_two_alternatives_at_one_position():
  branches = [ov.Branch(ov.CORRECTION, 3, 50), ov.Branch(ov.CORRECTION, 3, 60), ov.Branch(ov.CONTINUATION, 8)]
  toks = np.zeros((3, 8), np.int32)
  out = np.array([5, 6, 60])
  assert ov.select_reuse(3, out, branches, toks, 8) == ov.ReuseOutcome("correction_hit", 1)
  assert ov.select_reuse(3, np.array([5, 6, 70]), branches, toks, 8) == ov.ReuseOutcome("correction_miss", None)
  assert ov.select_reuse(2, np.array([5, 70]), branches, toks, 8) == ov.ReuseOutcome("no_hit", None)


def test_tree_layout_mask_positions_lora():
  blk, c = 4, 20
  draft = np.array([5, 6, 7, 8])
  branches = [ov.Branch("correction", 2, alt=42), ov.Branch("continuation", 4)]
  tokens, pos, mask, lora, write = ov.tree_layout(blk, draft, branches, c, mask_token_id=3)
  assert list(tokens[:4]) == [5, 6, 7, 8] and list(tokens[4:8]) == [42, 3, 3, 3] and list(tokens[8:12]) == [3] * 4
  assert list(pos[:4]) == [20, 21, 22, 23] and list(pos[4:8]) == [22, 23, 24, 25] and list(pos[8:12]) == [24, 25,
                                                                                                        26, 27]
  assert list(write) == [True] * 4 + [False] * 12 and list(lora) == [False] * 4 + [True] * 8 + [False] * 4
  np.testing.assert_array_equal(mask[:4, :4], causal_mask(4))
  assert not mask[:4, 4:].any()  # the verifier never sees branches
  for q in range(4, 8):  # correction block: verifier tokens 0..1 + own block
    assert list(np.nonzero(mask[q])[0]) == [0, 1, 4, 5, 6, 7]
  for q in range(8, 12):  # continuation: all verifier tokens + own block
    assert list(np.nonzero(mask[q])[0]) == [0, 1, 2, 3, 8, 9, 10, 11]
  for q in range(12, 16):  # unused slot is inert
    assert list(np.nonzero(mask[q])[0]) == [q]
  # a wider tree: the same rows, then more inert slots; too many branches for the slots is an error
  wide = ov.tree_layout(blk, draft, branches, c, mask_token_id=3, slots=5)
  assert wide[0].shape == (24,) and wide[2].shape == (24, 24)
  for narrow_part, wide_part in zip((tokens, pos, lora, write), (wide[0], wide[1], wide[3], wide[4])):
    np.testing.assert_array_equal(wide_part[:16], narrow_part)
  np.testing.assert_array_equal(wide[2][:16, :16], mask)
  assert not wide[2][:16, 16:].any() and not wide[3][16:].any()
  with pytest.raises(ValueError, match="slots"):
    ov.tree_layout(blk, draft, branches, c, mask_token_id=3, slots=1)


def test_reuse_rules():
  branches = [ov.Branch("correction", 2, alt=42), ov.Branch("correction", 5, alt=43), ov.Branch("continuation", 8)]
  bt = np.array([[42, 1, 1, 1, 1, 1, 1, 1], [43, 2, 2, 2, 2, 2, 2, 2], [77, 3, 3, 3, 3, 3, 3, 3]])
  out = np.array([10, 42, 0, 0, 0, 0, 0, 0])
  assert ov.select_reuse(2, out, branches, bt, 8) == ov.ReuseOutcome("correction_hit", 0)
  out2 = np.array([10, 41, 0, 0, 0, 0, 0, 0])
  assert ov.select_reuse(2, out2, branches, bt, 8) == ov.ReuseOutcome("correction_miss", None)
  out3 = np.array([10, 11, 12, 13, 43, 0, 0, 0])
  assert ov.select_reuse(5, out3, branches, bt, 8).branch == 1
  assert ov.select_reuse(3, out3, branches, bt, 8).label == "no_hit"
  full = np.array([1, 2, 3, 4, 5, 6, 7, 77])
  assert ov.select_reuse(8, full, branches, bt, 8) == ov.ReuseOutcome("continuation_hit", 2)
  full[-1] = 78
  assert ov.select_reuse(8, full, branches, bt, 8).label == "continuation_miss"
  assert ov.select_reuse(8, full, branches[:2], bt[:2], 8).label == "continuation_absent"


def _forward(model, tokens, positions, mask, prefix_len, page_table, cache, write=None, lora=None):
  return model(ForwardInputs(tokens=jnp.asarray(tokens)[None], positions=jnp.asarray(positions)[None],
                             block_mask=jnp.asarray(mask)[None], prefix_len=jnp.asarray([prefix_len]),
                             page_table=jnp.asarray(page_table)[None],
                             kv_write=None if write is None else jnp.asarray(write)[None],
                             lora_mask=None if lora is None else jnp.asarray(lora)[None]), cache)


def _prefilled(model, prompt):
  """(page table row, cache) of one request whose `prompt` was written to a fresh cache (pages for 64 tokens)."""
  from recguide_jax.cache.kv_cache import PageAllocator
  alloc = PageAllocator(64, 8, 16)
  alloc.add("r")
  alloc.reserve("r", 64)
  pt = alloc.page_table_row("r", 16)
  n = len(prompt)
  _, cache = _forward(model, prompt, np.arange(n), causal_mask(n), 0, pt, model.new_cache(64, 8),
                      write=np.ones(n, bool))
  return pt, cache


def test_fused_forward_is_exact(tiny_model):
  """Verifier logits equal a plain causal verify; branch drafts equal normal draft forwards on the committed
  prefix they assume; the committed cache equals the plain verify's."""
  blk, mask_id = 8, tiny_model.cfg.mask_token_id
  rng = np.random.default_rng(1)
  n = 13
  pt, cache = _prefilled(tiny_model, rng.integers(4, 128, n))
  draft = rng.integers(4, 128, blk)
  branches = [ov.Branch("correction", 3, alt=77), ov.Branch("continuation", blk)]
  tokens, pos, mask, lora, write = ov.tree_layout(blk, draft, branches, n, mask_id)
  fused_logits, fused_cache = _forward(tiny_model, tokens, pos, mask, n, pt, cache, write=write, lora=lora)
  plain_logits, plain_cache = _forward(tiny_model, draft, n + np.arange(blk), causal_mask(blk), n,
                                       pt, cache, write=np.ones(blk, bool))
  np.testing.assert_allclose(fused_logits[0, :blk], plain_logits[0], atol=1e-5)
  for a, b in zip((fused_cache.k, fused_cache.v), (plain_cache.k, plain_cache.v)):  # [L, pages, ...]
    np.testing.assert_allclose(np.asarray(a)[:, 1:], np.asarray(b)[:, 1:], atol=1e-6)  # page 0 is trash
  # correction branch == drafting [alt, MASK...] after committing draft[:3]
  full = np.ones((blk, blk), bool)
  corr_in = np.array([77] + [mask_id] * (blk - 1))
  corr_ref, _ = _forward(tiny_model, corr_in, n + 3 + np.arange(blk), full, n + 3, pt, plain_cache)
  np.testing.assert_allclose(fused_logits[0, blk:2 * blk], corr_ref[0], atol=1e-5)
  cont_ref, _ = _forward(tiny_model, np.full(blk, mask_id), n + blk + np.arange(blk), full, n + blk, pt, plain_cache)
  np.testing.assert_allclose(fused_logits[0, 2 * blk:3 * blk], cont_ref[0], atol=1e-5)


def test_a_drafting_row_of_the_fused_forward_is_a_draft_forward(tiny_model):
  """A request without a draft drafts inside the fused forward (`draft_layout`): its branch slot's logits equal a
  draft forward's from its seed over the committed prefix, and its row writes nothing to the cache."""
  blk, mask_id = 8, tiny_model.cfg.mask_token_id
  n = 11
  pt, cache = _prefilled(tiny_model, np.random.default_rng(2).integers(4, 128, n))
  seed = 42
  tokens, pos, mask, lora, write = ov.draft_layout(blk, seed, n, mask_id, 3)
  assert not write.any() and tokens.shape == (4 * blk,)
  fused_logits, fused_cache = _forward(tiny_model, tokens, pos, mask, n, pt, cache, write=write, lora=lora)
  draft_in = np.array([seed] + [mask_id] * (blk - 1))
  draft_ref, _ = _forward(tiny_model, draft_in, n + np.arange(blk), np.ones((blk, blk), bool), n, pt, cache,
                          write=np.zeros(blk, bool))
  np.testing.assert_allclose(fused_logits[0, blk:2 * blk], draft_ref[0], atol=1e-5)
  for a, b in zip((fused_cache.k, fused_cache.v), (cache.k, cache.v)):
    np.testing.assert_array_equal(np.asarray(a)[:, 1:], np.asarray(b)[:, 1:])  # page 0 is trash


def test_overlap_is_lossless_and_hits_save_forwards(tiny_llm):
  from recguide_jax.decoding.builtin import ARStrategy
  from recguide_jax.recguide.controller import RecGuideStrategy
  rng = np.random.default_rng(4)
  prompts = [[int(t) for t in np.tile(rng.integers(4, 128, 2), 12)[:int(rng.integers(3, 24))]] for _ in range(6)]
  params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
  tiny_llm.set_policy(ARStrategy())
  ar = [o.outputs[0].token_ids for o in tiny_llm.generate(prompts, params)]
  # delta 1.0: every position is risky, so corrections are planned whenever an alternative exists;
  # delta 0.0: nothing is risky, so every round carries a continuation branch
  for planner, slots in (("expected_hit", 5), ("expected_hit", 3), ("no_p3", 3)):  # expected_hit: every slot
    for delta in ((None,) if planner == "expected_hit" else (0.0, 1.0)):             # filled, corrections anywhere
      last = RecGuideStrategy(16, delta=delta, planner=planner, fixed_regime="overlap", overlap_slots=slots)
      tiny_llm.set_policy(last)
      tiny_llm.engine.forward_log = []
      outs = tiny_llm.generate(prompts, params)
      assert [o.outputs[0].token_ids for o in outs] == ar, (planner, delta)
      assert tiny_llm.engine.allocator.num_used == 0
      assert {k for k, _, _ in tiny_llm.engine.forward_log} & {"fused3", "fused5"} == {f"fused{slots}"}
      tiny_llm.engine.forward_log = None
  # the strategy's overlap log replays to exactly the correction hits it counted with the same planner
  strategy = RecGuideStrategy(16, planner="expected_hit", fixed_regime="overlap", overlap_slots=4, prefix_exponent=0.5)
  tiny_llm.set_policy(strategy)
  strategy.overlap_log = []
  logged = tiny_llm.generate(prompts, params)
  assert [o.outputs[0].token_ids for o in logged] == ar
  rounds = strategy.overlap_log
  assert len(rounds) == sum(o.metrics["rounds"] for o in logged)
  counted = strategy.overlap_outcomes["correction_hit"]  # its overlap rounds' outcomes, over every request
  assert ovf.replay_correction_hits(rounds, 16, 4, 0.5) * len(rounds) == pytest.approx(counted)
  hits = last.overlap_outcomes["correction_hit"] + last.overlap_outcomes["continuation_hit"]  # the last sweep's
  saved = sum(o.metrics["rounds"] - o.metrics["forwards"]["draft"] for o in outs)
  # each consumed hit skipped exactly one draft forward (a hit in a request's last round is never consumed)
  assert 0 < saved <= hits
  assert all(o.metrics["forwards"]["verify"] == o.metrics["rounds"] for o in outs)


def test_best_sweep_row_prices_first_then_tokens_per_forward():
  row = lambda rate, tpf, slots, delta=None, gamma=1.0: dict(  # noqa: E731
      priced_tokens_per_ms=rate, tpf=tpf, slots=slots, delta=delta, prefix_exponent=gamma)
  cheap, wide, slow = row(0.5159, 2.95, 3, gamma=0.35), row(0.5158, 3.03, 4, gamma=0.45), row(0.505, 3.10, 5)
  assert ovf.best_sweep_row([cheap, wide, slow]) is wide  # within 0.1% of the best price: more tokens per forward
  assert ovf.best_sweep_row([cheap, wide, slow], rel_tol=1e-5) is cheap  # a strict tolerance: the price alone
  assert ovf.best_sweep_row([slow, cheap]) is cheap
  same = [row(0.5, 3.0, 4), row(0.5, 3.0, 3), row(0.5, 3.0, 3, gamma=0.5)]
  assert ovf.best_sweep_row(same) is same[1]  # a full tie: the narrower tree, then gamma nearer 1
  deltas = [row(0.48, 2.7, 3, delta=0.3, gamma=None), row(0.48, 2.7, 3, delta=0.5, gamma=None)]
  assert ovf.best_sweep_row(deltas) is deltas[1]
  with pytest.raises(ValueError):
    ovf.best_sweep_row([])


def test_fused_branch_drafts_built_in_position_slices_equal_one_pass(tiny_model, monkeypatch):
  """With large logits the fused step builds the branches' logits in position slices (issue 33: [b, 4B, V] float32
  did not fit a TPU's activation reserve); its branch tokens, signals and verify results equal the one-pass step."""
  from recguide_jax.cache.kv_cache import PageAllocator
  from recguide_jax.runtime import steps
  from recguide_jax.runtime.runner import Runner, RunnerConfig
  from recguide_jax.runtime.steps import SamplingArrays
  cfg = tiny_model.cfg
  blk, mask_id = 8, cfg.mask_token_id
  rng = np.random.default_rng(3)
  alloc = PageAllocator(64, 8, 16)
  rows = []
  for r, n in enumerate((13, 21)):
    alloc.add(r)
    alloc.reserve(r, 64)
    branches = [ov.Branch("correction", 3, alt=77), ov.Branch("continuation", blk)]
    rows.append(ov.tree_layout(blk, rng.integers(4, 128, blk), branches, n, mask_id) + (n, alloc.page_table_row(r, 16)))
  tokens, pos, mask, lora, write, prefix, pt = (np.stack([np.asarray(x[i]) for x in rows]) for i in range(7))
  samp = SamplingArrays.greedy(2)

  def run():
    runner = Runner(tiny_model, RunnerConfig(num_pages=64, page_size=8, max_model_len=120, max_batch=2,
                                             block_sizes=(8,), prefill_chunk=8))
    res, br_tok, br_sig = runner.fused(tokens, pos, mask, lora, write, prefix.astype(np.int32), pt, samp, blk)
    return res, br_tok, br_sig

  one = run()
  assert steps.position_slices(2, tokens.shape[1], cfg.vocab_size) == 1
  monkeypatch.setattr(steps, "LOGITS_SLICE_BYTES", 2 * blk * cfg.vocab_size * 4)  # a slice of one branch block
  monkeypatch.setattr(steps, "MIN_SLICE_ROWS", 1)
  assert steps.position_slices(2, 2 * blk, cfg.vocab_size) == 2
  sliced = run()
  np.testing.assert_array_equal(sliced[1], one[1])
  np.testing.assert_allclose(sliced[2], one[2], atol=1e-6)
  np.testing.assert_array_equal(sliced[0].tokens, one[0].tokens)
  np.testing.assert_array_equal(sliced[0].accepted, one[0].accepted)


def test_position_slices_keep_logits_under_the_budget_but_rows_dense():
  from recguide_jax.runtime.steps import LOGITS_SLICE_BYTES, position_slices
  # NLD-8B at tp=4 (32768 vocabulary entries per device), batch 32, three branch blocks of 32: half a block a slice
  assert position_slices(32, 96, 32768) == 6 and 32 * 16 * 32768 * 4 <= LOGITS_SLICE_BYTES
  assert position_slices(32, 32, 32768) == 2  # its verified block
  assert position_slices(1, 96, 32768) == 1  # small logits: one head matmul
  assert position_slices(4, 96, 131072) == 1  # thinner slices would re-read the head's weights for few rows
  assert position_slices(256, 7, 131072) == 7  # a prime count of positions still divides
