"""The runtime's step keys and its background compiler: warm-up with `background` compiles only the largest batch
bucket, routing never picks a bucket whose variants are not built, background compiles do not count as compiles
after warm-up, and a batch padded into a larger bucket decodes the same tokens."""

import dataclasses
import pickle

import numpy as np
import pytest

from recguide_jax.runtime.runner import Runner, RunnerConfig
from recguide_jax.runtime.step_key import fused_kind, fused_slots
from recguide_jax.runtime.steps import SamplingArrays
from recguide_jax.engine.requests import MAX_TOP_LOGPROBS
from recguide_jax.runtime.step_key import StepKey, StepKind
from recguide_jax.runtime.step_key import parse_kind_label


def test_step_key_labels_round_trip():
  assert StepKey.parse("fused2", 16, 4) == StepKey(StepKind.FUSED, 16, 4, 2)
  assert StepKey(StepKind.FUSED, 8, 1, 3).label == "fused3" and fused_kind(2) == "fused2"
  with pytest.raises(ValueError, match="fused<N>"):
    StepKey.parse("fused", 8, 1)  # a fused label names its slot count
  assert fused_slots(fused_kind(5)) == 5
  assert StepKey(StepKind.VERIFY, 16, 8).name == "verify/16/8"
  assert StepKey(StepKind.FUSED, 8, 2, 2).query_tokens == 24
  key = StepKey(StepKind.PREFILL, 64, 2)
  assert pickle.loads(pickle.dumps(key)) == key  # it crosses to multi-host followers
  assert StepKind.VERIFY == "verify" and StepKey("verify", 8, 1).kind is StepKind.VERIFY
  assert StepKind.DRAFT.writes_cache is False and StepKind.DECODE.writes_cache is True
  assert StepKey(StepKind.SCORE, 64, 2).name == "score/64/2" and StepKind.SCORE.writes_cache
  multi = StepKey(StepKind.DECODE, 1, 8, steps=4)  # four AR steps per call: its own variant, one row per step
  assert multi.name == "decode/1/8x4" and multi.query_tokens == 1 and multi != StepKey(StepKind.DECODE, 1, 8)
  assert pickle.loads(pickle.dumps(multi)) == multi


@pytest.mark.parametrize("bad", [("decode", 4, 1), ("verify", 8, 0)])
def test_step_key_refuses_impossible_shapes(bad):
  with pytest.raises(ValueError):
    StepKey.parse(*bad)
  with pytest.raises(ValueError, match="several steps"):
    StepKey(StepKind.VERIFY, 8, 1, steps=2)
  with pytest.raises(ValueError, match="several steps"):
    StepKey(StepKind.DECODE, 1, 1, steps=0)


def test_decode_steps_option_is_bounded_by_what_a_request_may_write_past_its_end(tiny_model):
  with pytest.raises(ValueError, match="decode_steps must be positive"):
    RunnerConfig(decode_steps=0)
  # a request's pages hold one block (or prefill chunk) past its last token: a decode call may not write further
  with pytest.raises(ValueError, match="decode_steps must be at most 32"):
    RunnerConfig(block_sizes=(8, 32), prefill_chunk=16, decode_steps=33)
  runner = Runner(tiny_model, RunnerConfig(num_pages=8, page_size=8, max_model_len=32, max_batch=2, block_sizes=(8,),
                                           prefill_chunk=8, decode_steps=4))
  decodes = [k for k in runner.variants(("prefill", "verify")) if k.kind == StepKind.DECODE]
  assert sorted((k.batch, k.steps) for k in decodes) == [(1, 1), (1, 4), (2, 1), (2, 4)]


@pytest.mark.parametrize("label", ["fusedx", "fused0", "sample"])
def test_unknown_kind_labels_are_refused(label):
  with pytest.raises(ValueError, match="step kind"):
    parse_kind_label(label)


def test_background_warmup_routes_only_to_built_buckets(tiny_model):
  runner = Runner(tiny_model, RunnerConfig(num_pages=24, page_size=8, max_model_len=64, max_batch=4,
                                           block_sizes=(8,), prefill_chunk=16, compile_cache_dir=None))
  try:
    seconds = runner.warmup(("verify",), (8,), progress=False, workers=2, background=True)
    assert {k.batch for k in seconds} == {4}  # only the largest bucket before warm-up returns
    # until bucket 1's variants are built, one request runs padded in the largest bucket
    if runner.background_pending:
      assert runner.bucket_for(1) in (1, 2, 4)
    got_padded = _decode_one(runner, bucket=4)
    assert runner.wait_background(timeout=300)
    assert runner.bucket_for(1) == 1 and runner.bucket_for(3) == 4
    got_exact = _decode_one(runner, bucket=1)
    assert runner.compiles_after_warmup == 0  # neither the background compiles nor the routed calls count
    assert got_padded == got_exact
  finally:
    runner.close()


def test_bucket_for_without_warmup_compiles_on_demand(tiny_model):
  runner = Runner(tiny_model, RunnerConfig(num_pages=24, page_size=8, max_model_len=64, max_batch=4,
                                           block_sizes=(8,), prefill_chunk=16, compile_cache_dir=None))
  assert [runner.bucket_for(n) for n in (1, 2, 3, 4)] == [1, 2, 4, 4]
  with pytest.raises(ValueError, match="max_batch"):
    runner.bucket_for(5)


def test_a_call_passes_the_weights_as_a_flat_list_of_the_states_arrays(tiny_model):
  """A call's weights are the leaves of the model's nnx.State as a plain list: flattening the State's Variables
  again on every call cost milliseconds of host time per call at hundreds of weights."""
  import jax
  runner = Runner(tiny_model, RunnerConfig(num_pages=24, page_size=8, max_model_len=64, max_batch=1,
                                           block_sizes=(8,), prefill_chunk=16, compile_cache_dir=None))
  assert isinstance(runner.weights, list) and all(isinstance(x, jax.Array) for x in runner.weights)
  assert all(a is b for a, b in zip(runner.weights, jax.tree.leaves(runner.state), strict=True))
  weights_arg = runner.lower(StepKey.parse("decode", 1, 1)).args_info[0][0]
  assert jax.tree.structure(weights_arg) == jax.tree.structure(list(runner.weights))


def _decode_one(runner: Runner, bucket: int) -> int:
  """One AR decode step of a single real row (token 5 at position 0, page 1) padded to `bucket` rows; the
  padding rows write the trash page."""
  P = runner.config.pages_per_seq
  tokens = np.zeros((bucket, 1), np.int32)
  tokens[0, 0] = 5
  write = np.zeros(bucket, bool)
  page_table = np.zeros((bucket, P), np.int32)
  page_table[0, 0] = 1
  res = runner.verify(tokens, None, write, np.zeros(bucket, np.int32), page_table, SamplingArrays.greedy(bucket))
  return int(res.tokens[0, 0])


def test_score_prefill_compiles_on_first_use_and_writes_what_prefill_writes(tiny_model):
  """The SCORE variant (prompt logprobs) is not part of a warm-up that did not ask for it; its first use compiles
  it (counted: that request waited); it samples the same token and writes the same K/V as PREFILL, and returns
  the targets' logprobs [b, chunk] and top entries [b, chunk, K] only."""
  runner = Runner(tiny_model, RunnerConfig(num_pages=8, page_size=8, max_model_len=32, max_batch=1,
                                           block_sizes=(8,), prefill_chunk=16, compile_cache_dir=None))
  assert StepKey(StepKind.SCORE, 16, 1) in runner.variants(("prefill", "score"))  # warmed only when asked for
  seconds = runner.warmup(("prefill",), (8,), progress=False, workers=1)
  assert {k.kind for k in seconds} == {StepKind.PREFILL}
  tokens = np.random.default_rng(0).integers(4, 128, (1, 16)).astype(np.int32)
  valid, prefix, last = np.ones((1, 16), bool), np.zeros(1, np.int32), np.full(1, 15, np.int32)
  pages = lambda a, b: np.array([[a, b] + [0] * (runner.config.pages_per_seq - 2)], np.int32)
  plain = runner.prefill(tokens, valid, prefix, pages(1, 2), last, SamplingArrays.greedy(1))
  assert runner.compiles_after_warmup == 0
  scored = runner.prefill(tokens, valid, prefix, pages(3, 4), last, SamplingArrays.greedy(1),
                          targets=np.roll(tokens, -1, axis=1))
  assert runner.compiles_after_warmup >= 1
  assert int(scored[0][0]) == int(plain[0][0])
  k = np.asarray(runner.cache.k)
  np.testing.assert_allclose(k[:, 3:5], k[:, 1:3], atol=1e-6)
  assert scored[4].shape == (1, 16) and scored[5].shape == scored[6].shape == (1, 16, MAX_TOP_LOGPROBS)
  assert np.all(scored[4] <= 0) and np.all(scored[5][..., :1] >= scored[4][..., None] - 1e-6)


def test_a_bf16_runner_on_the_cpu_keeps_its_cache_as_bits_and_never_converts_it():
  """XLA:CPU cannot gather or scatter bf16, so a bf16 cache was converted to f32 whole, per layer and step. The
  runner's CPU cache holds the bf16 bits as uint16 instead: the prefill writes exactly the bits a bf16 float cache
  gets and samples the same token, a decode program holds no f32 array of the cache's shape, and with the memory
  scheduler its temporaries (the f32 copies of the weights XLA:CPU multiplies with) are fewer than XLA's default
  scheduler keeps live at once."""
  import jax
  import jax.numpy as jnp
  from flax import nnx

  from conftest import tiny_config
  from pallas_kernels.common import causal_mask
  from recguide_jax.model.nld import ForwardInputs, NLDModel
  model = NLDModel(tiny_config(), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16, rngs=nnx.Rngs(7))
  runner = Runner(model, RunnerConfig(num_pages=8, page_size=8, max_model_len=32, max_batch=1, block_sizes=(8,),
                                      prefill_chunk=16, compile_cache_dir=None))
  assert runner.platform == "cpu" and runner.cache.k.dtype == jnp.uint16
  tokens = np.random.default_rng(0).integers(4, 128, (1, 16)).astype(np.int32)
  page_table = np.zeros((1, runner.config.pages_per_seq), np.int32)
  page_table[0, :2] = (1, 2)
  sampled = runner.prefill(tokens, np.ones((1, 16), bool), np.zeros(1, np.int32), page_table, np.full(1, 15, np.int32),
                           SamplingArrays.greedy(1))
  inp = ForwardInputs(tokens=jnp.asarray(tokens), positions=jnp.arange(16)[None], block_mask=causal_mask(16),
                      prefix_len=jnp.zeros(1, jnp.int32), page_table=jnp.asarray(page_table),
                      kv_write=jnp.ones((1, 16), bool))
  logits, cache = nnx.jit(lambda m, c: m(inp, c))(model, model.new_cache(8, 8))
  assert cache.k.dtype == jnp.bfloat16
  for floats, bits in ((cache.k, runner.cache.k), (cache.v, runner.cache.v)):
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(floats, jnp.uint16)), np.asarray(bits))
  assert int(sampled[0][0]) == int(jnp.argmax(logits[0, 15]))
  decode = runner.compiled(StepKey(StepKind.DECODE, 1, 1))
  assert f"f32[{','.join(map(str, runner.cache.k.shape))}]" not in decode.as_text()
  default = Runner(model, dataclasses.replace(runner.config, compiler_options={
      "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_DEFAULT"})).compiled(StepKey(StepKind.DECODE, 1, 1))
  assert decode.memory_analysis().temp_size_in_bytes < default.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("rule", ["leviathan", "reference"])
def test_a_verified_block_built_in_position_slices_equals_one_pass(tiny_model, monkeypatch, rule):
  """With large logits a draft and a verify build their sampling pipelines a position slice at a time (issue 33:
  eight [b, B, V / tp] float32 arrays were live at once); each position is decided on its own, so draft tokens,
  distributions and signals, and the verify's tokens, acceptance, logprobs, top entries and entropy equal the
  one-pass steps', for sampled rows under top-k / top-p / penalties and a greedy row in the same batch."""
  from recguide_jax.cache.kv_cache import PageAllocator
  from recguide_jax.runtime import steps
  cfg = tiny_model.cfg
  b, blk, v = 4, 8, cfg.vocab_size
  alloc = PageAllocator(64, 8, 16)
  for r in range(b):
    alloc.add(r)
    alloc.reserve(r, 64)
  page_table = np.stack([alloc.page_table_row(r, 16) for r in range(b)])
  prefix = np.asarray([13, 21, 5, 30], np.int32)
  seed = np.asarray([7, 11, 19, 23], np.int32)
  controls = steps.empty_controls(b, 4, v)
  controls = controls._replace(presence=np.asarray([0.5, 0, 0, 0.2], np.float32),
                               repetition=np.asarray([1, 1.3, 1, 1], np.float32),
                               ids=np.asarray([[7, 9, v, v], [11, 3, 3, v], [v] * 4, [23, 40, 41, v]], np.int32),
                               counts=np.ones((b, 4), np.float32))
  samp = SamplingArrays(np.asarray([0.9, 0.7, 0.0, 1.2], np.float32), np.asarray([0, 5, 0, 0], np.int32),
                        np.asarray([1.0, 0.9, 1.0, 0.8], np.float32),
                        np.random.default_rng(5).integers(0, 2 ** 32, (b, 2), dtype=np.uint32),
                        np.asarray([3, 0, 0, 5], np.int32), controls)

  def run():
    runner = Runner(tiny_model, RunnerConfig(num_pages=64, page_size=8, max_model_len=120, max_batch=b,
                                             block_sizes=(blk,), prefill_chunk=8, rule=rule))
    tokens, q, signals = runner.draft(seed, prefix, page_table, blk, samp)
    return runner.verify(tokens, q, np.ones(b, bool), prefix, page_table, samp), np.asarray(tokens), q, signals

  one, one_draft, one_q, one_signals = run()
  assert steps.position_slices(b, blk, v) == 1
  monkeypatch.setattr(steps, "LOGITS_SLICE_BYTES", b * 2 * v * 4)  # slices of two positions
  monkeypatch.setattr(steps, "MIN_SLICE_ROWS", 1)
  assert steps.position_slices(b, blk, v) == 4
  sliced, sliced_draft, sliced_q, sliced_signals = run()
  np.testing.assert_array_equal(sliced_draft, one_draft)  # the draft is built in the same slices
  np.testing.assert_allclose(sliced_q, one_q, atol=1e-6)
  np.testing.assert_allclose(sliced_signals, one_signals, atol=1e-6)
  np.testing.assert_array_equal(sliced.accepted, one.accepted)
  for r, n in enumerate(one.accepted):
    np.testing.assert_array_equal(sliced.tokens[r, :n], one.tokens[r, :n])
    np.testing.assert_allclose(sliced.logprobs[r, :n], one.logprobs[r, :n], atol=1e-5)
  np.testing.assert_allclose(sliced.top_logprobs[:, :, :5], one.top_logprobs[:, :, :5], atol=1e-5)
  np.testing.assert_array_equal(sliced.top_ids[:, :, :5], one.top_ids[:, :, :5])
  np.testing.assert_allclose(sliced.entropy, one.entropy, atol=1e-5)
  assert one.accepted.min() >= 1 and (one.accepted < blk).any()  # some row rejects inside its block


@pytest.mark.parametrize("rule", ["leviathan", "reference"])
def test_each_verify_slice_sees_the_draft_tokens_before_its_positions(monkeypatch, rule):
  """Under the sampling controls verify position j sees draft tokens 1..j, whatever slice holds it: with each
  position's previous draft token made the favourite and a presence penalty taking it away, greedy rows accept
  their whole block only if every slice counts the tokens before it."""
  import types
  import jax
  import jax.numpy as jnp
  from recguide_jax.runtime import sampling, steps
  b, blk, v = 3, 8, 64
  cfg = types.SimpleNamespace(mask_token_id=v - 1, vocab_size=v)
  rng = np.random.default_rng(0)
  draft = rng.permutation(v - 1)[:b * blk].reshape(b, blk).astype(np.int32)
  logits = rng.normal(size=(b, blk, v)).astype(np.float32)
  rows, cols = np.arange(b)[:, None], np.arange(blk - 1)[None, :]
  logits[rows, cols, draft[:, 1:]] += 8.0  # position j predicts draft[j + 1] ...
  logits[rows, cols + 1, draft[:, 1:]] += 9.0  # ... but favours draft[j], which the presence penalty takes away
  q = jax.nn.one_hot(draft, v)
  controls = steps.empty_controls(b, 2, v)._replace(presence=np.full(b, 6.0, np.float32))
  samp = SamplingArrays(np.asarray([0.0, 0.0, 1.0], np.float32), np.zeros(b, np.int32), np.ones(b, np.float32),
                        rng.integers(0, 2 ** 32, (b, 2), dtype=np.uint32), np.asarray([2, 0, 0], np.int32),
                        sampling.Controls(*map(jnp.asarray, controls)))
  run = lambda: jax.jit(lambda lg, d, q_: steps.verified_block(cfg, rule, lambda x: x, lg, d, q_, samp))(
      jnp.asarray(logits), jnp.asarray(draft), q)
  one = jax.device_get(run())
  assert (one[0][:2] == blk).all()  # the greedy rows accept every draft token
  monkeypatch.setattr(steps, "LOGITS_SLICE_BYTES", b * 2 * v * 4)
  monkeypatch.setattr(steps, "MIN_SLICE_ROWS", 1)
  assert steps.position_slices(b, blk, v) == 4
  sliced = jax.device_get(run())
  for got, want in zip(sliced, one):
    np.testing.assert_allclose(got, want, atol=1e-5)
