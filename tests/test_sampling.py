"""Speculative sampling keeps the AR distribution: chi-square goodness of fit of sampled continuations against
the exact AR distribution of a tiny-vocabulary model, for plain AR sampling and both acceptance rules."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from recguide_jax import LLM, SamplingParams
from recguide_jax import policies, sampling
from recguide_jax.benchmarks.stats import pooled_chisquare_pvalue
from recguide_jax.model import ForwardInputs, NLDModel
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
                                  block_mask=jnp.tril(jnp.ones((n, n), bool))))
  p = np.asarray(sampling.processed_probs(logits, jnp.full((b,), params.temperature), jnp.full((b,), params.top_k),
                                          jnp.full((b,), params.top_p), MASK))
  probs = {}
  for i, cont in enumerate(conts):
    probs[cont] = float(np.prod([p[i, len(PROMPT) - 1 + j, tok] for j, tok in enumerate(cont)]))
  return probs


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
  for name, rule, policy in [("ar", "leviathan", policies.ARPolicy()),
                             ("leviathan", "leviathan", policies.LinearPolicy(8)),
                             ("reference", "reference", policies.LinearPolicy(8))]:
    out[name] = LLM(model=small_vocab_model, policy=policy, max_num_seqs=32, max_model_len=32, page_size=4,
                    prefill_chunk=4, rule=rule, warmup=False, compile_cache_dir=None)
  return out


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=N_TOKENS, temperature=1.0, ignore_eos=True),
                                    SamplingParams(max_tokens=N_TOKENS, temperature=0.7, top_k=4, top_p=0.9,
                                                   ignore_eos=True)], ids=["t1", "t0.7-topk-topp"])
def test_speculative_sampling_matches_ar(small_vocab_model, samplers, params):
  exact = exact_distribution(small_vocab_model, params)
  assert abs(sum(exact.values()) - 1) < 1e-4
  results = {}
  for name, llm in samplers.items():
    plist = [SamplingParams(**{**params.__dict__, "seed": 1000 + i}) for i in range(N_SAMPLES)]
    outs = llm.generate([PROMPT] * N_SAMPLES, plist)
    samples = [o.token_ids for o in outs]
    assert all(len(s) == N_TOKENS for s in samples)
    results[name] = (chi_square_pvalue(samples, exact),
                     np.mean([np.mean(o.stats["accepted_lengths"]) for o in outs]))
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
  unasked = sampling.raw_logprobs(logits, tokens, 7, jnp.zeros(2, jnp.int32))
  for a, b in zip(always, asked):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  np.testing.assert_array_equal(np.asarray(unasked[0]), np.asarray(always[0]))  # the chosen tokens' logprobs stay
  assert not np.any(np.asarray(unasked[1])) and not np.any(np.asarray(unasked[2]))
  assert np.asarray(always[2]).shape == (2, 3, sampling.NUM_TOP_LOGPROBS) and np.all(np.asarray(always[2]) != 7)
