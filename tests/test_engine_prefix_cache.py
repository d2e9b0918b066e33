"""Automatic prefix caching in the engine: every policy's greedy output is the same with and without it, seeded
samples (n > 1) too, prompt logprobs are still computed for every position, cached tokens are counted, and no
page leaks (every page is free again once the requests are done and the cache is reset)."""

import contextlib

import numpy as np
import pytest

from recguide_jax import SamplingParams
from recguide_jax.decoding.builtin import ARStrategy, DiffusionStrategy, LinearStrategy
from recguide_jax.recguide.controller import RecGuideStrategy
from tests.test_recguide_controller import flat_profile

RNG = np.random.default_rng(5)
SYSTEM = [int(t) for t in RNG.integers(4, 128, 37)]  # a shared "system prompt" of four full pages and a bit
PROMPTS = ([SYSTEM + [int(t) for t in RNG.integers(4, 128, k)] for k in (1, 6, 11, 30)]
           + [SYSTEM[:24], SYSTEM[:25], SYSTEM, [int(t) for t in RNG.integers(4, 128, 19)]])
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
POLICIES = {"ar": ARStrategy, "linear": lambda: LinearStrategy(8), "diffusion": lambda: DiffusionStrategy(8),
            "recguide": lambda: RecGuideStrategy(16, delta=0.6, profile=flat_profile())}


@contextlib.contextmanager
def prefix_caching(llm, on: bool):
  alloc = llm.engine.allocator
  alloc.reset_prefix_cache()
  before = alloc.enable_prefix_caching
  alloc.enable_prefix_caching = on
  try:
    yield alloc
  finally:
    alloc.enable_prefix_caching = before


def generate(llm, prompts, params):
  outs = llm.generate(prompts, params, use_tqdm=False)
  alloc = llm.engine.allocator
  alloc.check()
  assert alloc.num_used == 0
  return outs


@pytest.mark.parametrize("policy", list(POLICIES))
def test_greedy_output_is_the_same_with_and_without_prefix_caching(tiny_llm, policy):
  tiny_llm.set_policy(POLICIES[policy]())
  with prefix_caching(tiny_llm, False) as alloc:
    off = [o.outputs[0].token_ids for o in generate(tiny_llm, PROMPTS, GREEDY)]
    assert alloc.num_cached == 0
  totals = tiny_llm.engine.totals
  with prefix_caching(tiny_llm, True) as alloc:
    hits = totals["prefix_cache_hits"]
    # first concurrent (admitted together, few hits), then again with every prompt's full pages cached
    first = [o.outputs[0].token_ids for o in generate(tiny_llm, PROMPTS, GREEDY)]
    again = [o.outputs[0].token_ids for o in generate(tiny_llm, PROMPTS, GREEDY)]
    assert first == off and again == off
    assert alloc.num_cached > 0 and totals["prefix_cache_hits"] - hits >= 5 * 32
    alloc.reset_prefix_cache()
    alloc.check()
    assert alloc.num_free == alloc.num_pages - 1 and alloc.num_cached == 0


def test_samples_and_prompt_logprobs_with_prefix_caching(tiny_llm):
  """Seeded samples (n > 1, sharing a prefill) and prompt logprobs give the same answers from a warm cache: a
  cached prompt's first token is drawn with the key it would have had, and a request scoring its prompt computes
  every position."""
  tiny_llm.set_policy(ARStrategy())
  params = [SamplingParams(max_tokens=8, temperature=0.9, seed=11, n=3),
            SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=2)]
  prompts = [SYSTEM + [9, 8, 7], SYSTEM + [5]]

  def answers():
    outs = generate(tiny_llm, prompts, params)
    sampled = [c.token_ids for c in outs[0].outputs]
    scored = [(e or {}).get("logprob") for e in outs[1].prompt_logprobs]
    return sampled, outs[1].outputs[0].token_ids, scored

  with prefix_caching(tiny_llm, False):
    off = answers()
  with prefix_caching(tiny_llm, True):
    generate(tiny_llm, [SYSTEM + [1]], GREEDY)  # caches the system prompt's pages
    hits = tiny_llm.engine.totals["prefix_cache_hits"]
    on = answers()
    assert tiny_llm.engine.totals["prefix_cache_hits"] - hits == 32  # the sample asking first; not the scoring one
  assert on[0] == off[0] and on[1] == off[1]
  assert len(on[2]) == len(prompts[1]) and on[2][0] is None
  np.testing.assert_allclose(on[2][1:], off[2][1:], atol=1e-5)
