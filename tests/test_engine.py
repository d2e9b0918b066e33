"""Engine: losslessness of every decoding path against greedy AR, batch invariance, continuous batching, stop
conditions, no KV page leaks, and no compilation after warm-up."""

import dataclasses
import time

import jax
import numpy as np
import pytest

from pallas_kernels.common import causal_mask
from recguide_jax import SamplingParams
from recguide_jax.decoding.builtin import ARStrategy, DiffusionStrategy, LinearStrategy
from recguide_jax.decoding.strategy import AheadPlan
from recguide_jax.engine.requests import RequestError
from recguide_jax.model.nld import ForwardInputs

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def varied_prompts(n=20, seed=0, vocab=128):
  rng = np.random.default_rng(seed)
  prompts = []
  for i in range(n):
    length = int(rng.choice([1, 2, 5, 9, 16, 17, 33, 60]))
    if i % 4 == 0:  # repetitive prompts push the model into loops, others are noise
      prompts.append([int(t) for t in np.tile(rng.integers(4, vocab, 3), length)[:length]])
    else:
      prompts.append([int(t) for t in rng.integers(4, vocab, length)])
  return prompts


def run(llm, policy, prompts, params=GREEDY, join_every=None):
  """Runs prompts through the engine; with join_every=k a new request joins every k engine steps."""
  llm.set_policy(policy)
  eng = llm.engine
  if join_every is None:
    reqs = [eng.add_request(p, params) for p in prompts]
    eng.run_until_done()
  else:
    reqs, pending, steps = [], list(prompts), 0
    while pending or eng.has_work():
      if pending and steps % join_every == 0:
        reqs.append(eng.add_request(pending.pop(0), params))
      eng.step()
      steps += 1
  assert eng.allocator.num_used == 0
  eng.allocator.check()
  return reqs


@pytest.fixture(scope="module")
def ar_outputs(tiny_llm):
  prompts = varied_prompts()
  reqs = run(tiny_llm, ARStrategy(), prompts)
  return prompts, [r.output_ids for r in reqs]


@pytest.mark.parametrize("block", [8, 16, 32])
def test_linear_greedy_equals_ar_batch1(tiny_llm, ar_outputs, block):
  prompts, expected = ar_outputs
  for p, exp in zip(prompts, expected):
    (req,) = run(tiny_llm, LinearStrategy(block), [p])
    assert req.output_ids == exp
    assert sum(req.stats.accepted_lengths) >= len(exp) - 1
    assert req.stats.forwards["draft"] == req.stats.forwards["verify"] == req.stats.rounds


@pytest.mark.parametrize("block", [8, 16, 32])
def test_linear_greedy_equals_ar_batch8_joining(tiny_llm, ar_outputs, block):
  prompts, expected = ar_outputs
  reqs = run(tiny_llm, LinearStrategy(block), prompts, join_every=3)
  assert [r.output_ids for r in reqs] == expected
  assert max(len(tiny_llm.engine.running), 0) == 0


def test_ar_batch_invariance(tiny_llm, ar_outputs):
  prompts, expected = ar_outputs
  # same requests in other company: together, reversed, and interleaved with sampled requests
  reqs = run(tiny_llm, ARStrategy(), prompts[::-1], join_every=2)
  assert [r.output_ids for r in reqs][::-1] == expected
  mixed = []
  for p in prompts[:6]:
    mixed.append((p, GREEDY))
    mixed.append((p[::-1], SamplingParams(max_tokens=25, temperature=1.0, seed=3)))
  tiny_llm.set_policy(LinearStrategy(16))
  eng = tiny_llm.engine
  rs = [eng.add_request(p, sp) for p, sp in mixed]
  eng.run_until_done()
  assert [r.output_ids for r in rs[::2]] == expected[:6]


def test_multi_step_decode_equals_one_step_calls(tiny_llm, tiny_model, ar_outputs):
  """AR decode calls of 4 steps (the LLM default) give the tokens and logprobs of one-step calls: greedy, sampled
  (step s draws with the request's round counter + s), and through a stop token or max_tokens inside a call, whose
  later steps' pages are freed with the request."""
  from recguide_jax import LLM
  single = LLM(model=tiny_model, policy="ar", max_num_seqs=8, max_model_len=256, page_size=8, prefill_chunk=16,
               warmup=False, compile_cache_dir=None, decode_steps=1)
  assert tiny_llm.runner.config.decode_steps == 4 and single.runner.config.decode_steps == 1
  prompts, expected = ar_outputs
  stop_tok = expected[1][10]
  cases = [SamplingParams(max_tokens=23, temperature=0.0, ignore_eos=True, logprobs=2),
           SamplingParams(max_tokens=30, temperature=0.9, top_p=0.9, seed=5, logprobs=1),
           SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop_token_ids=[stop_tok])]
  steps_seen = []
  tiny_llm.runner.before_execute = lambda key, args: steps_seen.append(key.steps)
  try:
    for params in cases:
      outs = []
      for llm in (single, tiny_llm):
        llm.set_policy(ARStrategy())
        outs.append(llm.generate(prompts[:6], params, use_tqdm=False))
        assert llm.engine.allocator.num_used == 0
        llm.engine.allocator.check()
      for one, multi in zip(*outs):
        one, multi = one.outputs[0], multi.outputs[0]
        assert multi.token_ids == one.token_ids and multi.finish_reason == one.finish_reason
        assert (multi.logprobs is None) == (one.logprobs is None) == (params.logprobs is None)
        for a, b in zip(multi.logprobs or [], one.logprobs or [], strict=True):
          assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"], abs=1e-5)
          assert a.get("top_logprobs", {}).keys() == b.get("top_logprobs", {}).keys()
  finally:
    tiny_llm.runner.before_execute = None
  assert 4 in steps_seen and 1 in steps_seen  # multi-step calls ran, and single steps where fewer tokens were left
  assert outs[1][1].outputs[0].token_ids == expected[1][:expected[1].index(stop_tok) + 1]


@pytest.mark.parametrize("strategy_cls", ["ar", "linear"])
def test_pipelined_rounds_are_exact(tiny_llm, ar_outputs, strategy_cls):
  """AR calls and LinearSS rounds dispatched ahead (the next call starts from the inputs the previous step returned
  on the device, before the host reads it back) give the synchronous engine's streams exactly: greedy, sampled and
  logprobs, through stop tokens and max_tokens (a request that stops wastes its row of the call in flight), and
  requests joining mid-run."""
  prompts, expected = ar_outputs
  eng = tiny_llm.engine
  assert eng.pipeline  # the default
  stop = expected[1][9]
  cases = [SamplingParams(max_tokens=37, temperature=0.0, ignore_eos=True, stop_token_ids=[stop], logprobs=1),
           SamplingParams(max_tokens=29, temperature=0.8, seed=3)]
  first_kind = "decode" if strategy_cls == "ar" else "draft"
  results = {}
  for ahead in (False, True):
    strategy = ARStrategy() if strategy_cls == "ar" else LinearStrategy(8)
    strategy.plans_ahead = lambda batch, ahead=ahead: AheadPlan.again(batch) if ahead else None
    tiny_llm.set_policy(strategy)
    ahead_calls, streams, outs, counts = [], {}, [], {"dispatched": 0, "read": 0}

    def on_execute(key, args):  # a round dispatched while an earlier one is not read back yet: it ran ahead
      if key.kind == first_kind:
        ahead_calls.append(counts["dispatched"] > counts["read"])
        counts["dispatched"] += 1

    def read_verify(outs, real=tiny_llm.runner.read_verify):
      counts["read"] += 1
      return real(outs)
    tiny_llm.runner.before_execute = on_execute
    tiny_llm.runner.read_verify = read_verify
    try:
      for params in cases:
        eng.reset_prefix_cache()
        reqs = [eng.add_request(p, dataclasses.replace(params, max_tokens=params.max_tokens + 3 * i), f"r{i}",
                                on_update=lambda r, new: streams.setdefault(r.request_id, []).append(list(new)))
                for i, p in enumerate(prompts[:5])]
        for _ in range(6):
          eng.step()
        reqs.append(eng.add_request(prompts[5], params, "late"))  # joins while calls run ahead
        eng.run_until_done()
        outs.append([(r.output_ids, r.finish_reason, r.token_logprobs, r.logprobs) for r in reqs])
        assert eng.allocator.num_used == 0
        eng.allocator.check()
    finally:
      tiny_llm.runner.before_execute = None
      del tiny_llm.runner.read_verify
    assert any(ahead_calls) == ahead
    results[ahead] = (outs, streams)
  (outs_ahead, streams_ahead), (outs_sync, streams_sync) = results[True], results[False]
  for case_ahead, case_sync in zip(outs_ahead, outs_sync, strict=True):
    for (ids, reason, lps, entries), (ids0, reason0, lps0, entries0) in zip(case_ahead, case_sync, strict=True):
      assert (ids, reason) == (ids0, reason0)
      # a row that ran ahead may have been computed in a larger padded batch than the synchronous engine's next
      # call: the same tokens, logprobs equal to float32 rounding
      np.testing.assert_allclose(lps, lps0, atol=1e-5)
      assert [e["token_id"] for e in entries or ()] == [e["token_id"] for e in entries0 or ()]
  assert {k: sum(v, []) for k, v in streams_ahead.items()} == {k: sum(v, []) for k, v in streams_sync.items()}
  assert outs_ahead[0][1][0] == expected[1][:expected[1].index(stop) + 1]  # greedy through its stop token


@pytest.mark.parametrize("ahead", [False, True])
def test_round_wall_times_tile_the_run(tiny_llm, ar_outputs, ahead):
  """Each round's wall time (what a strategy's calibration reads) is the time it adds: consecutive rounds do not
  overlap, pipelined or not, so their sum stays within the run's wall time. Timed from its dispatch, a call run
  ahead also counted the reading and applying of the call before it."""
  prompts, _ = ar_outputs
  eng = tiny_llm.engine
  strategy = ARStrategy()
  strategy.plans_ahead = lambda batch: AheadPlan.again(batch) if ahead else None
  tiny_llm.set_policy(strategy)
  params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
  tiny_llm.generate(prompts[:3], params, use_tqdm=False)  # compiles what the timed run uses
  eng.round_log = []
  try:
    for p in prompts[:3]:
      eng.add_request(p, params)
    start = time.perf_counter()
    eng.run_until_done()
    wall = time.perf_counter() - start
    log = eng.round_log
  finally:
    eng.round_log = None
  assert len(log) >= 10 and all(o.seconds > 0 for o in log)
  assert sum(o.seconds for o in log) <= wall


def test_pipelined_rounds_keep_the_pages_the_next_round_reserves(tiny_llm, ar_outputs):
  """While a LinearSS round is in flight, applying the round before it trims no page: the pages past a row's
  committed length are those of the round in flight and of the one the pipeline dispatches next, which would
  reserve them again (trimming them took and freed pages every step). Every page is back when the requests end."""
  prompts, _ = ar_outputs
  eng = tiny_llm.engine
  tiny_llm.set_policy(LinearStrategy(8))
  alloc = eng.allocator
  trims = []  # (a call in flight, pages freed) per trim
  trim = alloc.trim_rows

  def counted(rows, keep=0):
    used = alloc.num_used
    trim(rows, keep)
    trims.append((eng._pending is not None, used - alloc.num_used))
  alloc.trim_rows = counted
  params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
  try:
    eng.reset_prefix_cache()
    reqs = [eng.add_request(p, params, f"r{i}") for i, p in enumerate(prompts[:4])]
    eng.run_until_done()
  finally:
    del alloc.trim_rows
  assert all(len(r.output_ids) == 48 for r in reqs)
  assert alloc.num_used == 0
  alloc.check()
  in_flight = [freed for ahead, freed in trims if ahead]
  assert len(in_flight) > 10 and not any(in_flight), trims


def test_multi_step_decode_waits_for_nothing_queued(tiny_llm):
  """A multi-step call runs only while no request waits to be admitted or prefilled, and only when some request
  of the batch has that many tokens left; its wall time counts as that many AR rounds."""
  tiny_llm.set_policy(ARStrategy())
  eng = tiny_llm.engine
  calls = []

  def record(key, args):
    if key.kind == "decode":
      prefilling = any(eng.prefilled(r) < len(r.prompt_ids) for r in eng.running if not r.finished)
      calls.append((key.steps, len(eng.waiting), prefilling))

  rounds = []
  observe = eng.strategy.observe
  eng.strategy.observe = lambda outcome: rounds.extend([(outcome.output.label, outcome.batch.block)]
                                                       * outcome.output.rounds)
  tiny_llm.runner.before_execute = record
  try:
    # 9 requests for 8 slots: one waits until the shortest (11 tokens) finishes, then prefills (a 40-token prompt)
    reqs = [eng.add_request([5 + i] * (3 if i < 8 else 40), SamplingParams(max_tokens=11 + 3 * i, temperature=0.0,
                                                                           ignore_eos=True)) for i in range(9)]
    eng.run_until_done()
  finally:
    tiny_llm.runner.before_execute = None
    eng.strategy.observe = observe
  assert [len(r.output_ids) for r in reqs] == [11 + 3 * i for i in range(9)]
  assert all(steps == 1 for steps, waiting, prefilling in calls if waiting or prefilling)
  assert any(steps == 4 for steps, _, _ in calls) and any(w for _, w, _ in calls) and any(p for _, _, p in calls)
  assert eng.allocator.num_used == 0
  assert rounds and all(r == ("ar", 1) for r in rounds)


def test_diffusion_commit_seeds_are_ar_predictions(tiny_llm, tiny_model):
  """Block diffusion is not AR-equivalent, but every committed block's seed is the AR argmax after it."""
  import jax.numpy as jnp
  prompts = varied_prompts(4, seed=5)
  reqs = run(tiny_llm, DiffusionStrategy(8, threshold=0.5), prompts,
             SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
  for p, r in zip(prompts, reqs):
    assert len(r.output_ids) == 24
    seq = p + r.output_ids
    n = len(seq)
    logits, _ = tiny_model(ForwardInputs(tokens=jnp.asarray([seq]), positions=jnp.arange(n)[None],
                                         block_mask=causal_mask(n)))
    ar = np.asarray(jnp.argmax(logits[0].at[:, 3].set(-jnp.inf), -1))
    # output index 0 is the prefill's token; then each round emits 7 denoised tokens + 1 committed seed
    assert r.output_ids[0] == ar[len(p) - 1]
    for k in range(8, 24, 8):
      assert r.output_ids[k] == ar[len(p) + k - 1]
    assert r.stats.forwards["commit"] == 3 and r.stats.forwards["denoise"] >= 3


def test_stop_conditions(tiny_llm, ar_outputs):
  prompts, expected = ar_outputs
  tiny_llm.set_policy(LinearStrategy(8))
  eng = tiny_llm.engine
  target = expected[1]
  stop_tok = target[10]
  r1 = eng.add_request(prompts[1], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                  stop_token_ids=[stop_tok]))
  r2 = eng.add_request(prompts[1], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))
  eng.run_until_done()
  first = target.index(stop_tok)
  assert r1.output_ids == target[:first + 1] and r1.finish_reason == "stop"
  assert r2.output_ids == target[:7] and r2.finish_reason == "length"


def test_eos_stops_unless_ignored(tiny_llm, ar_outputs):
  prompts, expected = ar_outputs
  tiny_llm.set_policy(LinearStrategy(16))
  eng = tiny_llm.engine
  # pretend the 5th generated token is EOS by making it a stop id; ignore_eos keeps going past real EOS
  r = eng.add_request(prompts[2], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=False))
  eng.run_until_done()
  eos = tiny_llm.cfg.eos_token_ids[0]
  exp = expected[2]
  cut = exp.index(eos) + 1 if eos in exp else len(exp)
  assert r.output_ids == exp[:cut]


def test_abort_and_errors_leak_no_pages(tiny_llm):
  tiny_llm.set_policy(LinearStrategy(16))
  eng = tiny_llm.engine
  prompts = varied_prompts(8, seed=9)
  # EOS ignored: two rounds of 16 leave every request running, whatever its seeded draws
  reqs = [eng.add_request(p, SamplingParams(max_tokens=60, temperature=0.7, seed=i, ignore_eos=True))
          for i, p in enumerate(prompts)]
  eng.step()
  eng.step()
  assert eng.allocator.num_used > 0
  assert eng.abort(reqs[0].request_id) and eng.abort(reqs[5].request_id)
  assert not eng.abort("no-such-request")
  # a device step that raises: the engine fails the in-flight requests and frees their pages
  def boom(*a, **k):  # a runtime error from XLA: a device failure, raised to the caller (EngineThread: fail_all)
    raise jax.errors.JaxRuntimeError("INTERNAL: injected device failure")

  eng.runner.dispatch_verify = boom  # the verify forward of a LinearSS round
  try:
    with pytest.raises(jax.errors.JaxRuntimeError):
      eng.step()
  finally:
    del eng.runner.dispatch_verify
  eng.fail_all("injected")
  assert all(r.finished for r in reqs)
  assert reqs[0].finish_reason == "abort" and reqs[1].finish_reason == "error"
  assert eng.allocator.num_used == 0 and not eng.running and not eng.waiting
  eng.allocator.check()


def test_bad_requests_rejected(tiny_llm):
  eng = tiny_llm.engine
  with pytest.raises(RequestError, match="prompt"):
    eng.add_request([], GREEDY)
  with pytest.raises(RequestError, match="vocabulary"):
    eng.add_request([5, 999], GREEDY)
  with pytest.raises(RequestError, match="max_model_len"):
    eng.add_request([5] * 250, GREEDY)
  for bad in [dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5), dict(top_k=-2),
              dict(logprobs=99), dict(stop=[""])]:
    with pytest.raises(RequestError, match=list(bad)[0]):
      eng.add_request([5, 6], SamplingParams(**bad))
  assert not eng.has_work()


def test_logprobs_and_stats(tiny_llm, ar_outputs):
  prompts, expected = ar_outputs
  tiny_llm.set_policy(LinearStrategy(8))
  tiny_llm.reset_prefix_cache()  # the whole prompt is prefilled (ar_outputs ran it before)
  (out,) = tiny_llm.generate([prompts[3]], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True,
                                                          logprobs=3))
  assert out.outputs[0].token_ids == expected[3][:12]
  assert len(out.outputs[0].logprobs) == 12
  for entry, tok in zip(out.outputs[0].logprobs, out.outputs[0].token_ids):
    assert entry["token_id"] == tok and entry["logprob"] <= 0
    assert len(entry["top_logprobs"]) == 3
    # greedy: the chosen token is the most likely one
    assert max(entry["top_logprobs"].values()) == pytest.approx(entry["logprob"], abs=1e-5)
  s = out.metrics
  assert s["rounds"] == len(s["accepted_lengths"]) and s["ttft_s"] > 0
  assert s["forwards"]["prefill"] == -(-len(prompts[3]) // 16)  # chunked prefill, chunk 16
  assert 1 + sum(s["accepted_lengths"]) >= 12


def test_no_compiles_after_warmup(tiny_model):
  from recguide_jax import LLM
  llm = LLM(model=tiny_model, policy="linear", block_size=8, max_num_seqs=2, max_model_len=128, page_size=8,
            prefill_chunk=16, compile_cache_dir=None)
  prompts = varied_prompts(7, seed=3)
  params = [SamplingParams(max_tokens=20, temperature=t, top_k=k, top_p=p, seed=i)
            for i, (t, k, p) in enumerate([(0, 0, 1), (1.0, 5, 1), (0.7, 0, 0.9), (0, 0, 1), (1.3, 0, 1),
                                           (0, 0, 1), (0.5, 3, 0.5)])]
  counts = {"verify": 0, "read": 0}
  ran_ahead = []  # a draft dispatched while the verify before it is not read back: the pipeline ran

  def on_execute(key, args):
    ran_ahead.append(key.kind == "draft" and counts["verify"] > counts["read"])
    counts["verify"] += key.kind == "verify"

  def read_verify(outs, real=llm.runner.read_verify):
    counts["read"] += 1
    return real(outs)
  llm.runner.before_execute, llm.runner.read_verify = on_execute, read_verify
  llm.generate(prompts, params)
  llm.generate(prompts[:3], params[:3])
  llm.generate(prompts[:2], params[:2])  # nothing waits: the rounds run ahead
  assert llm.runner.compiles_after_warmup == 0
  assert any(ran_ahead)


def _groups(sizes):
  from recguide_jax.decoding import rounds
  from recguide_jax.engine.scheduler import Group
  out = [Group(rounds.LINEAR, b, [object() for _ in range(n)], [b] * n) for b, n in sizes.items()]
  return out + [Group(rounds.AR, 1, [object()], [1])]


def _by_block(groups):
  from recguide_jax.decoding import rounds
  return {g.block: g for g in groups if g.round is rounds.LINEAR}


def test_cost_aware_grouping_of_planned_block_sizes():
  from recguide_jax.decoding import rounds
  from recguide_jax.engine.scheduler import merge_groups

  def merge(groups, cost):
    return merge_groups(groups, rounds.LINEAR, cost)

  # bucketing off: one batch padded to the largest B; smaller plans keep their own B as a cap
  out = merge(_groups({8: 3, 16: 2, 32: 1}), None)
  assert len(out) == 2 and out[0].round is rounds.AR and list(_by_block(out)) == [32]
  assert _by_block(out)[32].planned == [8, 8, 8, 16, 16, 32] and len(_by_block(out)[32].reqs) == 6
  # memory-bound costs (a round costs the same at any batch): merging everything is cheapest
  out = merge(_groups({8: 3, 16: 2, 32: 1}), lambda batch, blk: 1.0 + blk / 64)
  assert list(_by_block(out)) == [32]
  # compute-bound costs (proportional to batch x B): separate buckets are cheapest
  g = _groups({8: 3, 16: 2, 32: 1})
  out = merge(g, lambda batch, blk: float(batch * blk))
  assert sorted(_by_block(out)) == [8, 16, 32]
  assert all(grp.planned == [grp.block] * len(grp.reqs) for grp in out)
  # in between: a round's fixed cost makes padding the lone B=8 request into the B=16 batch pay off
  out = merge(_groups({8: 1, 16: 6, 32: 6}), lambda batch, blk: 10.0 + batch * blk / 4)
  assert sorted(_by_block(out)) == [16, 32]
  assert len(_by_block(out)[16].reqs) == 7 and len(_by_block(out)[32].reqs) == 6
  # no cost model: buckets stay as planned
  g = _groups({8: 2, 16: 2})
  assert merge(g, lambda batch, blk: None) is g


def test_grouping_follows_the_bucketing_option():
  from recguide_jax.decoding import rounds
  from recguide_jax.decoding.strategy import RoundPlan
  from recguide_jax.engine.scheduler import group_plans
  reqs = [object() for _ in range(4)]
  planned = [(reqs[0], RoundPlan(rounds.LINEAR, 8)), (reqs[1], RoundPlan(rounds.AR, 1)),
             (reqs[2], RoundPlan(rounds.LINEAR, 32)), (reqs[3], RoundPlan(rounds.LINEAR, 8))]
  kept = group_plans(planned, True, lambda batch, blk: 1.0)
  assert [(g.round, g.block, len(g.reqs)) for g in kept] == [(rounds.LINEAR, 8, 2), (rounds.AR, 1, 1),
                                                             (rounds.LINEAR, 32, 1)]
  merged = group_plans(planned, False, lambda batch, blk: None)
  assert [(g.round, g.block, g.planned) for g in merged] == [(rounds.AR, 1, [1]), (rounds.LINEAR, 32, [8, 8, 32])]
  # AR rounds never pad: they are not merged whatever the costs
  assert group_plans(planned, "auto", lambda batch, blk: 1.0)[0].round is rounds.AR
