"""Speculative sampling keeps the AR distribution: chi-square goodness of fit of sampled continuations against
the exact AR distribution of a tiny-vocabulary model, for plain AR sampling and both acceptance rules. The top-k /
top-p filter, which searches its cuts without sorting, keeps exactly the tokens a sorted reference keeps, and no
compiled step sorts the vocabulary."""

import itertools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from pallas_kernels.common import causal_mask
from recguide_jax import LLM

from recguide_jax import SamplingParams
from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
from recguide_jax.runtime import sampling
from recguide_jax.benchmarks.stats import pooled_chisquare_pvalue
from recguide_jax.model.nld import ForwardInputs, NLDModel
from tests.conftest import tiny_config

VOCAB = 6
MASK = 5
PROMPT = [1, 4, 2]
N_TOKENS = 3
N_SAMPLES = 2000


@pytest.fixture(scope="module")
def small_vocab_model():
  # eos id 0 is ignored (ignore_eos) so every continuation has exactly N_TOKENS tokens
  cfg = tiny_config(vocab_size=VOCAB, mask_token_id=MASK, eos_token_ids=(0,), bos_token_id=1)
  return NLDModel(cfg, rngs=nnx.Rngs(3))


def exact_distribution(model, params: SamplingParams):
  """P(continuation) for every continuation of N_TOKENS tokens, from one batched causal forward."""
  usable = [t for t in range(VOCAB) if t != MASK]
  conts = list(itertools.product(usable, repeat=N_TOKENS))
  seqs = jnp.asarray([PROMPT + list(c) for c in conts])
  b, n = seqs.shape
  logits, _ = model(ForwardInputs(tokens=seqs, positions=jnp.broadcast_to(jnp.arange(n), (b, n)),
                                  block_mask=causal_mask(n)))
  probs = {}
  if params.has_controls:  # the controls depend on each continuation's own history: vLLM's formulas, in numpy
    logits = np.asarray(logits)
    for i, cont in enumerate(conts):
      probs[cont] = float(np.prod([reference_probs(logits[i, len(PROMPT) - 1 + j], PROMPT, cont[:j], params)[tok]
                                   for j, tok in enumerate(cont)]))
    return probs
  p = np.asarray(sampling.processed_probs(logits, jnp.full((b,), params.temperature), jnp.full((b,), params.top_k),
                                          jnp.full((b,), params.top_p), MASK))
  for i, cont in enumerate(conts):
    probs[cont] = float(np.prod([p[i, len(PROMPT) - 1 + j, tok] for j, tok in enumerate(cont)]))
  return probs


def reference_logits(logits, prompt, output, params: SamplingParams, stop_ids=(0,), mask=MASK):
  """vLLM's processing of one position's logits [V] (float64 numpy), written from its sampler: min_tokens holds the
  stop ids back, logit_bias is added, then repetition (prompt + output), frequency and presence penalties."""
  v = logits.shape[-1]
  x = np.array(logits, np.float64)
  x[mask] = -np.inf
  if len(output) < params.min_tokens:
    x[list(stop_ids)] = -np.inf
  for t, bias in (params.logit_bias or {}).items():
    x[t] += min(100.0, max(-100.0, bias))
  counts = np.bincount(np.asarray(output, int), minlength=v).astype(np.float64)
  seen = counts > 0
  seen_any = seen | (np.bincount(np.asarray(prompt, int), minlength=v) > 0)
  rep = np.where(seen_any, params.repetition_penalty, 1.0)
  x = np.where(x > 0, x / rep, x * rep)
  return x - params.frequency_penalty * counts - params.presence_penalty * seen


def reference_probs(logits, prompt, output, params: SamplingParams, **kw):
  """The sampled distribution: processed logits, temperature, then min-p relative to the most likely token."""
  x = reference_logits(logits, prompt, output, params, **kw) / params.temperature
  p = np.exp(x - x.max())
  p = np.where(p >= params.min_p * p.max(), p, 0.0)
  return p / p.sum()


def chi_square_pvalue(samples, exact):
  keys = list(exact)
  expected = np.array([exact[k] for k in keys])
  expected = expected / expected.sum() * len(samples)
  counts = {k: 0 for k in keys}
  for s in samples:
    counts[tuple(s)] += 1
  observed = np.array([counts[k] for k in keys], float)
  assert observed.sum() == len(samples), "a sample fell outside the support"
  return pooled_chisquare_pvalue(observed, expected)


@pytest.fixture(scope="module")
def samplers(small_vocab_model):
  out = {}
  for name, rule, policy in [("ar", "leviathan", ARStrategy()),
                             ("leviathan", "leviathan", LinearStrategy(8)),
                             ("reference", "reference", LinearStrategy(8))]:
    out[name] = LLM(model=small_vocab_model, policy=policy, max_num_seqs=32, max_model_len=32, page_size=4,
                    prefill_chunk=4, rule=rule, warmup=False, compile_cache_dir=None)
  return out


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=N_TOKENS, temperature=1.0, ignore_eos=True),
                                    SamplingParams(max_tokens=N_TOKENS, temperature=0.7, top_k=4, top_p=0.9,
                                                   ignore_eos=True),
                                    # min_tokens holds EOS (0) back for two tokens even with ignore_eos, as in vLLM
                                    SamplingParams(max_tokens=N_TOKENS, temperature=0.8, repetition_penalty=1.6,
                                                   presence_penalty=0.5, frequency_penalty=0.4, min_p=0.08,
                                                   min_tokens=2, logit_bias={2: 0.7, 3: -0.5}, ignore_eos=True)],
                         ids=["t1", "t0.7-topk-topp", "controls"])
def test_speculative_sampling_matches_ar(small_vocab_model, samplers, params):
  exact = exact_distribution(small_vocab_model, params)
  assert abs(sum(exact.values()) - 1) < 1e-4
  results = {}
  for name, llm in samplers.items():
    plist = [SamplingParams(**{**params.__dict__, "seed": 1000 + i}) for i in range(N_SAMPLES)]
    outs = llm.generate([PROMPT] * N_SAMPLES, plist)
    samples = [o.outputs[0].token_ids for o in outs]
    assert all(len(s) == N_TOKENS for s in samples)
    results[name] = (chi_square_pvalue(samples, exact),
                     np.mean([np.mean(o.metrics["accepted_lengths"]) for o in outs]))
  for name, (pvalue, _) in results.items():
    assert pvalue > 0.001, f"{name}: sampled continuations deviate from AR (p={pvalue:.2e})"
  # the min(1, p/q) rule accepts at least as much as the independent-sample rule
  assert results["leviathan"][1] >= results["reference"][1] - 0.05


@pytest.mark.parametrize("special", [None, "ties", "nan", "nan_after_max", "all_neg_inf", "inf"])
def test_argmax_is_jnp_argmax(special):
  """The CPU's two-pass argmax names the same index as jnp.argmax: the first maximum, the first NaN of a row that
  holds one (wherever the maximum is), index 0 of an all -inf row; other platforms lower XLA's argmax itself."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal((3, 4, 37)).astype(np.float32)
  rows = x.reshape(-1, 37)
  if special == "ties":
    rows[:, 20] = rows[:, 6] = rows.max(-1) + 1
  elif special == "nan":
    rows[1, [30, 8]] = np.nan
  elif special == "nan_after_max":
    rows[2, 5] = 100.0
    rows[2, 36] = np.nan
  elif special == "all_neg_inf":
    rows[0] = -np.inf
  elif special == "inf":
    rows[3, [9, 2]] = np.inf
  got = jax.jit(sampling.argmax)(x)
  assert got.dtype == jnp.int32
  np.testing.assert_array_equal(np.asarray(got), np.asarray(jnp.argmax(x, axis=-1)))


def test_argmax_lowers_to_one_reduction_off_the_cpu():
  for platform, reductions in (("cpu", 3), ("cuda", 1), ("tpu", 1)):
    text = jax.jit(sampling.argmax).trace(jnp.zeros((2, 8))).lower(lowering_platforms=(platform,)).as_text()
    assert text.count("stablehlo.reduce") == reductions, (platform, text)


def test_accept_greedy_is_leading_argmax_match():
  rng = np.random.default_rng(0)
  b, blk, v = 4, 6, 10
  logits = jnp.asarray(rng.normal(size=(b, blk, v)), jnp.float32)
  p = sampling.processed_probs(logits, jnp.zeros(b), jnp.zeros(b, jnp.int32), jnp.ones(b), mask_token_id=9)
  ar = np.asarray(jnp.argmax(p, -1))
  draft = np.array(rng.integers(0, 9, size=(b, blk)), np.int32)
  draft[0, 1:] = ar[0, :-1]  # fully accepted row
  draft[1, 1:3] = ar[1, :2]  # two accepted then a rejection (unless lucky)
  q = jax.nn.one_hot(draft, v)
  for rule in sampling.RULES:
    acc, out = sampling.accept(rule, jnp.zeros((b, 2), jnp.uint32), p, q, jnp.asarray(draft))
    acc, out = np.asarray(acc), np.asarray(out)
    for r in range(b):
      m = 0
      while m < blk - 1 and draft[r, m + 1] == ar[r, m]:
        m += 1
      assert acc[r] == m + 1
      assert list(out[r, :m + 1]) == list(ar[r, :m + 1])
    assert acc[0] == blk


def test_top_k_top_p_filter():
  logits = jnp.asarray([[[3.0, 2.0, 1.0, 0.0, -1.0, 5.0]]])
  probs = sampling.processed_probs(logits, jnp.ones(1), jnp.asarray([2]), jnp.ones(1), mask_token_id=5)
  assert np.count_nonzero(np.asarray(probs)) == 2 and float(probs[0, 0, 5]) == 0.0
  probs = sampling.processed_probs(logits, jnp.ones(1), jnp.zeros(1, jnp.int32), jnp.asarray([0.5]), 5)
  # softmax of [3,2,1,0,-1]: the top entry already holds > 0.5 of the mass
  assert np.count_nonzero(np.asarray(probs)) == 1


def test_processed_probs_of_a_mixed_batch_match_its_rows_alone():
  # the all-greedy batch skips the softmax; a mixed batch takes the full path; every row is what it is alone
  rng = np.random.default_rng(1)
  logits = jnp.asarray(rng.normal(size=(3, 2, 12)), jnp.float32)
  temperature, top_k, top_p = jnp.asarray([0.0, 0.7, 0.0]), jnp.asarray([0, 3, 0]), jnp.asarray([1.0, 0.9, 1.0])
  mixed = np.asarray(sampling.processed_probs(logits, temperature, top_k, top_p, mask_token_id=4))
  for r in range(3):
    alone = sampling.processed_probs(logits[r:r + 1], temperature[r:r + 1], top_k[r:r + 1], top_p[r:r + 1], 4)
    np.testing.assert_array_equal(mixed[r], np.asarray(alone)[0])
  greedy = np.asarray(sampling.processed_probs(logits, jnp.zeros(3), top_k, top_p, mask_token_id=4))
  np.testing.assert_array_equal(greedy, np.asarray(jax.nn.one_hot(jnp.argmax(
    sampling.exclude_token(logits, 4), -1), 12)))


def test_raw_logprobs_skip_the_top_entries_only_when_no_row_asks():
  rng = np.random.default_rng(2)
  logits = jnp.asarray(rng.normal(size=(2, 3, 16)), jnp.float32)
  tokens = jnp.asarray(rng.integers(0, 16, size=(2, 3)), jnp.int32)
  always = sampling.raw_logprobs(logits, tokens, 7)
  asked = sampling.raw_logprobs(logits, tokens, 7, jnp.asarray([0, 2], jnp.int32))
  most = sampling.raw_logprobs(logits, tokens, 7, jnp.asarray([20, 2], jnp.int32))
  unasked = sampling.raw_logprobs(logits, tokens, 7, jnp.zeros(2, jnp.int32))
  for a, b, c in zip(always, asked, most):  # asking for at most 2 computes only those; the rest are zeros
    np.testing.assert_array_equal(np.asarray(a)[..., :2], np.asarray(b)[..., :2])
    np.testing.assert_array_equal(np.asarray(a), np.asarray(c))
  assert not np.any(np.asarray(asked[1])[..., 2:]) and not np.any(np.asarray(asked[2])[..., 2:])
  np.testing.assert_array_equal(np.asarray(unasked[0]), np.asarray(always[0]))  # the chosen tokens' logprobs stay
  assert not np.any(np.asarray(unasked[1])) and not np.any(np.asarray(unasked[2]))
  assert np.asarray(always[2]).shape == (2, 3, sampling.NUM_TOP_LOGPROBS) and np.all(np.asarray(always[2]) != 7)


def test_top_n_orders_by_value_then_smaller_id_as_top_k_does():
  rng = np.random.default_rng(5)
  x = rng.integers(-3, 3, size=(4, 2, 9)).astype(np.float32)  # many ties
  x[0, 0, 2:] = -np.inf  # fewer finite entries than asked: the rest count as -inf
  values, ids = jax.jit(sampling.top_n, static_argnums=1)(jnp.asarray(x), 7)
  ref_values, ref_ids = jax.lax.top_k(jnp.asarray(x), 7)  # stable: ties keep the smaller id first
  np.testing.assert_array_equal(np.asarray(values), np.asarray(ref_values))
  np.testing.assert_array_equal(np.asarray(ids)[1:], np.asarray(ref_ids)[1:])
  np.testing.assert_array_equal(np.asarray(ids)[0, 1], np.asarray(ref_ids)[0, 1])
  traced = jax.jit(lambda x, n: sampling.top_n(x, n, 7))(jnp.asarray(x), jnp.int32(3))  # a traced count
  np.testing.assert_array_equal(np.asarray(traced[0])[..., :3], np.asarray(ref_values)[..., :3])
  assert not np.any(np.asarray(traced[0])[..., 3:]) and not np.any(np.asarray(traced[1])[..., 3:])


def filter_ref(logits: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
  """The kept (drawable) tokens [b, T, V] by sorting, in float64: top_k 0 or >= V and top_p >= 1 are off; the top-k
  cut is the k-th largest logit, the top-p cut the smallest logit of the sorted prefix whose mass before each entry
  is < top_p (mass over the whole distribution); every finite logit at or above both cuts is kept (ties at a cut
  kept whole)."""
  x = logits.astype(np.float64)
  srt = -np.sort(-x, axis=-1)
  vocab = x.shape[-1]
  k = np.where((top_k > 0) & (top_k < vocab), top_k, vocab)
  kth = np.take_along_axis(srt, np.broadcast_to((k - 1)[:, None, None], srt.shape[:-1] + (1,)), axis=-1)
  probs = np.exp(srt - srt[..., :1])
  probs /= probs.sum(-1, keepdims=True)
  before = np.cumsum(probs, axis=-1) - probs  # mass strictly before each sorted entry
  kept = (before < top_p[:, None, None]) | (top_p[:, None, None] >= 1)
  kept[..., 0] = True
  pth = np.min(np.where(kept, srt, np.inf), axis=-1, keepdims=True)
  return (x >= np.maximum(kth, pth)) & (x > -np.inf)  # a -inf logit is never a token that can be drawn


def top_p_margin(logits: np.ndarray, top_p: np.ndarray) -> float:
  """The least relative distance between top_p and the mass strictly above a distinct logit of a filtered row: the
  float32 sums of the filter can decide a row differently only when this is ~1e-6 or less."""
  out = np.inf
  for (i, t), row in np.ndenumerate(logits[..., 0]):
    del row
    if top_p[i] >= 1:
      continue
    x = logits[i, t].astype(np.float64)
    p = np.exp(x - x.max())
    p /= p.sum()
    values = np.unique(x[np.isfinite(x)])
    above = np.array([p[x > v].sum() for v in values])
    out = min(out, float(np.min(np.abs(above - top_p[i]) / np.maximum(above, top_p[i]))))
  return out


def kept_by_filter(logits, top_k, top_p) -> np.ndarray:
  out = jax.jit(sampling._filter_top_k_top_p)(jnp.asarray(logits), jnp.asarray(top_k, jnp.int32),
                                               jnp.asarray(top_p, jnp.float32))
  return np.asarray(out) > -np.inf


@pytest.mark.parametrize("scale,seed", [(0.3, 4), (4.0, 40), (60.0, 600)])
def test_filter_keeps_the_sorted_references_tokens(scale, seed):
  # logits rounded to a coarse grid (ties at every cut), a few -inf, from near-uniform rows to near one-hot ones
  rng = np.random.default_rng(seed)
  b, T, V = 8, 6, 97
  x = np.round(rng.standard_normal((b, T, V)) * scale, 1).astype(np.float32)
  x[:, :, rng.integers(0, V, 3)] = -np.inf
  x[0, 0] = 0.0  # one row of a single tie
  x[1, 1, :4] = x[1, 1].max()  # a tie at the maximum
  top_k = np.array([1, 0, 5, V, V + 3, 40, 3, 0], np.int32)
  top_p = np.array([1.0, 1e-6, 0.3, 0.9, 0.5, 1.0, 0.95, 0.999], np.float32)
  assert top_p_margin(x, top_p) > 1e-5  # the reference's float64 sums decide every row by a clear margin
  got, want = kept_by_filter(x, top_k, top_p), filter_ref(x, top_k, top_p)
  np.testing.assert_array_equal(got, want)
  assert np.all(got.sum(-1) >= 1) and np.all(got[1, 1, :4]) and np.all(got[0, 0] == np.isfinite(x[0, 0]))
  for i in range(b):  # each filter alone, and a batch with only one kind of filter
    np.testing.assert_array_equal(kept_by_filter(x[i:i + 1], top_k[i:i + 1], np.ones(1)),
                                  filter_ref(x[i:i + 1], top_k[i:i + 1], np.ones(1)))
    np.testing.assert_array_equal(kept_by_filter(x[i:i + 1], np.zeros(1), top_p[i:i + 1]),
                                  filter_ref(x[i:i + 1], np.zeros(1, np.int32), top_p[i:i + 1]))


def test_filter_orders_extreme_floats_and_signed_zeros():
  # the bit-pattern order spans the whole float32 range; -0.0 ties with +0.0 (subnormals left out: XLA flushes
  # them to zero, so a device compares them equal to 0)
  x = np.array([[[-0.0, 0.0, -3e38, 3e38, 1e-37, -1e-37, -np.inf, 2.5, -2.5, 1e-30, -1e-30]]], np.float32)
  order = np.argsort(-x[0, 0].astype(np.float64), kind="stable")
  for k in range(1, x.shape[-1] + 1):
    got = kept_by_filter(x, [k], [1.0])[0, 0]
    np.testing.assert_array_equal(got, filter_ref(x, np.array([k]), np.ones(1))[0, 0])
    assert got[order[:min(k, 10)]].all()  # the k largest (the last, -inf, is never drawable)
  assert kept_by_filter(x, [5], [1.0])[0, 0, :2].all()  # the 5th largest is a zero: both zeros stay
  assert kept_by_filter(x, [1], [0.5])[0, 0].sum() == 1  # 3e38 holds all the mass


def test_filtered_samples_follow_the_reference_distribution():
  """Chi-square of draws from processed_probs (top-k and top-p together, at a temperature) against the softmax of
  the reference's kept logits, with no draw outside them."""
  rng = np.random.default_rng(5)
  V, n = 40, 20000
  logits = np.round(rng.standard_normal((3, 1, V)) * 2, 1).astype(np.float32)
  temperature = np.array([0.8, 1.3, 1.0], np.float32)
  top_k, top_p = np.array([12, 0, 7], np.int32), np.array([0.85, 0.7, 1.0], np.float32)
  probs = sampling.processed_probs(jnp.asarray(logits), jnp.asarray(temperature), jnp.asarray(top_k),
                                   jnp.asarray(top_p), mask_token_id=V - 1)
  keys = jax.random.split(jax.random.key(0), n)
  draws = np.asarray(jax.jit(jax.vmap(lambda k: sampling.sample(k, probs)))(keys))[:, :, 0]  # [n, 3]
  for r in range(3):
    scaled = (np.where(np.arange(V) == V - 1, -np.inf, logits[r, 0]) / temperature[r]).astype(np.float32)
    kept = filter_ref(scaled[None, None], top_k[r:r + 1], top_p[r:r + 1])[0, 0]
    ref = np.where(kept, np.exp(scaled.astype(np.float64) - scaled.max()), 0.0)
    ref /= ref.sum()
    counts = np.bincount(draws[:, r], minlength=V)
    assert not np.any(counts[~kept]), "a draw outside the kept tokens"
    pvalue = pooled_chisquare_pvalue(counts[kept], ref[kept] * n)
    assert pvalue > 0.01, (r, pvalue)


def test_greedy_rows_ignore_their_filters():
  rng = np.random.default_rng(6)
  logits = jnp.asarray(rng.standard_normal((3, 4, 50)), jnp.float32)
  probs = np.asarray(sampling.processed_probs(logits, jnp.asarray([0.0, 1.0, 0.0]), jnp.asarray([3, 2, 1]),
                                              jnp.asarray([0.2, 0.5, 0.9]), mask_token_id=7))
  want = np.asarray(jax.nn.one_hot(jnp.argmax(sampling.exclude_token(logits, 7), -1), 50))
  np.testing.assert_array_equal(probs[[0, 2]], want[[0, 2]])


def test_no_step_sorts_the_vocabulary():
  """The compiled verify, decode and draft steps of a tiny model hold no sort (nor top-k), and neither does the
  sampling program lowered for GPU and TPU."""
  from recguide_jax.runtime.runner import Runner, RunnerConfig
  from recguide_jax.runtime.step_key import StepKey, StepKind
  model = NLDModel(tiny_config(), rngs=nnx.Rngs(1))
  runner = Runner(model, RunnerConfig(num_pages=8, page_size=8, max_model_len=32, max_batch=2, block_sizes=(8,),
                                      prefill_chunk=8, compile_cache_dir=None))
  sorts = re.compile(r"\b(sort|topk|top-k|TopK)\b", re.IGNORECASE)
  for key in (StepKey(StepKind.VERIFY, 8, 2), StepKey(StepKind.DECODE, 1, 2), StepKey(StepKind.DRAFT, 8, 2)):
    text = runner.lower(key).compile().as_text()
    assert "exponential" in text and not sorts.search(text), key
  b, vocab = 2, 1024
  args = (jnp.zeros((b, 8, vocab)), jnp.ones(b), jnp.full(b, 5, jnp.int32), jnp.full(b, 0.9), 3)
  for platform in ("cuda", "tpu"):
    text = jax.jit(sampling.processed_probs, static_argnums=4).trace(*args).lower(
      lowering_platforms=(platform,)).as_text()
    assert "stablehlo.exponential" in text and not sorts.search(text), platform


def test_each_use_of_a_round_key_draws_from_its_own_stream():
  """Distinct streams per use (the draft's and leviathan's uniforms once coincided); the streams AR sampling reads
  are the keys split(key, n) gave them before, so seeded AR output stays what it was."""
  keys = jnp.asarray([[7, 0], [7, 1], [123456, 9]], jnp.uint32)
  streams = (sampling.PREFILL_STREAM, sampling.RESIDUAL_STREAM, sampling.VERIFIER_STREAM, sampling.DRAFT_STREAM,
             sampling.UNIFORM_STREAM)
  data = [np.asarray(jax.random.key_data(sampling.stream_keys(keys, s))) for s in streams]
  assert len({d.tobytes() for d in data}) == len(streams) and len({tuple(r) for d in data for r in d}) == 15
  split = jax.vmap(lambda k: jax.random.split(k, 3))(jax.random.wrap_key_data(keys))
  for stream, i in ((sampling.PREFILL_STREAM, 0), (sampling.RESIDUAL_STREAM, 1), (sampling.VERIFIER_STREAM, 2)):
    np.testing.assert_array_equal(data[streams.index(stream)], np.asarray(jax.random.key_data(split[:, i])))


def control_case(seed=0, b=3, t=5, v=13):
  """Random logits, drafts and per-row controls for a batch (numpy), and the rows' SamplingParams."""
  rng = np.random.default_rng(seed)
  logits = rng.normal(0, 2, size=(b, t, v)).astype(np.float32)
  params, prompts, outputs = [], [], []
  for r in range(b):
    params.append(SamplingParams(temperature=1.0, repetition_penalty=[1.0, 1.7, 0.6][r % 3],
                                 presence_penalty=[0.0, 0.5, -1.0][r % 3], frequency_penalty=[0.3, 0.0, 1.1][r % 3],
                                 min_p=[0.0, 0.1, 0.3][r % 3], min_tokens=[0, 4, 6][r % 3],
                                 logit_bias={int(rng.integers(v)): float(rng.normal(0, 3))}, max_tokens=10))
    prompts.append([int(x) for x in rng.integers(0, v, 6)])
    outputs.append([int(x) for x in rng.integers(0, v, int(rng.integers(0, 4)))])
  drafts = rng.integers(0, v, size=(b, t)).astype(np.int32)
  return logits, params, prompts, outputs, drafts


def device_controls(params, prompts, outputs, vocab, stop_ids=(0,)):
  """The engine's control arrays for requests in the given state."""
  from recguide_jax.engine.core import control_arrays
  from recguide_jax.engine.requests import Request, sampling_row

  reqs = []
  for i, (p, prompt, out) in enumerate(zip(params, prompts, outputs)):
    r = Request(str(i), prompt, p, output_ids=list(out))
    r.sampling = sampling_row(p, 0, prompt, stop_ids)
    reqs.append(r)
  return control_arrays(reqs, len(reqs), vocab)


def test_controls_follow_vllms_definitions_at_every_verify_position():
  """Each verify position j is processed as AR decoding processes it after the draft tokens 1..j were emitted:
  vLLM's min_tokens, logit_bias, repetition / frequency / presence penalties and min-p, checked against a numpy
  transcription of vLLM's sampler."""
  logits, params, prompts, outputs, drafts = control_case()
  b, t, v = logits.shape
  ctl = device_controls(params, prompts, outputs, v)
  assert ctl.ids.shape[1] >= 64 and (ctl.ids[:, -1] == v).all()  # padded with the dropped id
  got = np.asarray(sampling.processed_probs(jnp.asarray(logits), jnp.ones(b), jnp.zeros(b, jnp.int32), jnp.ones(b),
                                            MASK, sampling.Controls(*ctl), jnp.asarray(drafts[:, 1:])))
  for r in range(b):
    for j in range(t):
      want = reference_probs(logits[r, j], prompts[r], outputs[r] + list(drafts[r, 1:j + 1]), params[r])
      np.testing.assert_allclose(got[r, j], want, rtol=2e-5, atol=1e-6, err_msg=f"row {r} position {j}")
  # greedy rows take the argmax of the processed logits (penalties change it; min-p never does)
  greedy = np.asarray(sampling.processed_probs(jnp.asarray(logits), jnp.zeros(b), jnp.zeros(b, jnp.int32),
                                               jnp.ones(b), MASK, sampling.Controls(*ctl), jnp.asarray(drafts[:, 1:])))
  for r in range(b):
    for j in range(t):
      want = reference_logits(logits[r, j], prompts[r], outputs[r] + list(drafts[r, 1:j + 1]), params[r])
      assert greedy[r, j].argmax() == want.argmax() and greedy[r, j].max() == 1.0


def test_multi_step_decode_counts_the_tokens_of_earlier_steps():
  """A multi-step decode's step s sees the s tokens the earlier steps sampled (extra, offset s), and min_tokens
  counts them."""
  logits, params, prompts, outputs, drafts = control_case(seed=1, t=1)
  b, _, v = logits.shape
  ctl = sampling.Controls(*device_controls(params, prompts, outputs, v))
  for s in range(3):
    got = np.asarray(sampling.processed_probs(jnp.asarray(logits), jnp.ones(b), jnp.zeros(b, jnp.int32), jnp.ones(b),
                                              MASK, ctl, jnp.asarray(drafts[:, :3]), s))
    for r in range(b):
      want = reference_probs(logits[r, 0], prompts[r], outputs[r] + list(drafts[r, :s]), params[r])
      np.testing.assert_allclose(got[r, 0], want, rtol=2e-5, atol=1e-6)


def test_sampling_controls_are_validated_naming_the_field():
  from recguide_jax.engine.requests import RequestError

  for field, value, match in [("presence_penalty", 2.5, "in \\[-2, 2\\]"), ("frequency_penalty", float("nan"), "in"),
                              ("repetition_penalty", 0.0, "greater than zero"), ("min_p", 1.5, "in \\[0, 1\\]"),
                              ("min_tokens", 20, "at most max_tokens"), ("min_tokens", -1, "non-negative"),
                              ("logit_bias", {VOCAB: 1.0}, "invalid token id 6 \\(the vocabulary is \\[0, 6\\)\\)"),
                              ("logit_bias", {-1: 1.0}, "invalid token id"), ("logit_bias", {1: float("inf")}, "finite"),
                              ("logit_bias", [1, 2], "mapping")]:
    with pytest.raises(RequestError, match=match) as e:
      SamplingParams(max_tokens=10, **{field: value}).validate(VOCAB)
    assert e.value.param == field and str(e.value).startswith(field)
  ok = SamplingParams(max_tokens=10, presence_penalty=-2, frequency_penalty=2, repetition_penalty=3.0, min_p=1.0,
                      min_tokens=10, logit_bias={0: -100, 5: 1e6})
  assert ok.validate(VOCAB) is ok and ok.has_controls and not SamplingParams(logit_bias={}, min_p=0).has_controls
