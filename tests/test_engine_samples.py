"""Prompt logprobs (the SCORE prefill) and n > 1 samples sharing one prefill, in the engine and the offline API.

Covers: prompt logprobs equal a plain full forward of the model (every chunk boundary, top entries included) and
do not change the generated tokens, under every decoding policy; max_tokens=0 scores only; n samples share the
prompt's full pages (the prompt is computed once, plus each sibling's last partial page) with greedy samples equal
to n=1 and seeded samples equal to the per-index seeds' n=1 answers; no page leaks when a sibling is aborted, and
a sibling whose source is aborted before sharing prefills on its own.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import causal_mask
from recguide_jax import SamplingParams

from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy

from recguide_jax.decoding.registry import make_strategy
from recguide_jax.model.nld import ForwardInputs
from recguide_jax.engine.requests import RequestError, seed_of_sample

# 37 tokens: three prefill chunks of 16 (tiny_llm) and five pages of 8, the last one partial
PROMPT = [int(t) for t in np.random.default_rng(3).integers(4, 128, 37)]


def reference_logprobs(model, prompt):
  """log_softmax of a plain causal forward over the whole prompt, mask token excluded (the raw distribution)."""
  n = len(prompt)
  logits, _ = model(ForwardInputs(tokens=jnp.asarray([prompt]), positions=jnp.arange(n)[None],
                                  block_mask=causal_mask(n)))
  logits = logits[0].at[:, model.cfg.mask_token_id].set(-jnp.inf)
  return np.asarray(jax.nn.log_softmax(logits, axis=-1))


def generate(llm, policy, prompt, params):
  llm.set_policy(policy)
  (out,) = llm.generate([prompt], params, use_tqdm=False)
  assert llm.engine.allocator.num_used == 0
  llm.engine.allocator.check()
  return out


@pytest.mark.parametrize("policy", [ARStrategy(), LinearStrategy(8)], ids=["ar", "linear"])
def test_prompt_logprobs_equal_the_reference_forward(tiny_llm, tiny_model, policy):
  ref = reference_logprobs(tiny_model, PROMPT)
  plain = generate(tiny_llm, policy, PROMPT, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
  out = generate(tiny_llm, policy, PROMPT,
                 SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, prompt_logprobs=3))
  assert plain.prompt_logprobs is None
  assert out.outputs[0].token_ids == plain.outputs[0].token_ids  # scoring the prompt leaves the generated tokens alone
  lps = out.prompt_logprobs
  assert len(lps) == len(PROMPT) and lps[0] is None
  for pos in range(1, len(PROMPT)):
    entry = lps[pos]
    assert entry["token_id"] == PROMPT[pos]
    np.testing.assert_allclose(entry["logprob"], ref[pos - 1, PROMPT[pos]], atol=2e-5)
    top = sorted(entry["top_logprobs"].items(), key=lambda kv: -kv[1])
    want = np.argsort(-ref[pos - 1])[:3]
    assert [t for t, _ in top] == [int(t) for t in want]
    np.testing.assert_allclose([v for _, v in top], ref[pos - 1, want], atol=2e-5)


def test_prompt_logprobs_with_recguide_and_max_tokens_zero(tiny_llm, tiny_model):
  ref = reference_logprobs(tiny_model, PROMPT)
  shared = tiny_llm.engine.totals["prompt_tokens_shared"]
  out = generate(tiny_llm, make_strategy("recguide", 8), PROMPT,
                 SamplingParams(max_tokens=0, prompt_logprobs=0, n=2))
  assert [o.token_ids for o in out.outputs] == [[], []] and out.outputs[0].finish_reason == "length"
  # the second sample took the scored prompt's pages before the first finished right after its prefill
  assert tiny_llm.engine.totals["prompt_tokens_shared"] - shared == 32
  assert "top_logprobs" not in out.prompt_logprobs[1]
  np.testing.assert_allclose([e["logprob"] for e in out.prompt_logprobs[1:]],
                             ref[np.arange(len(PROMPT) - 1), PROMPT[1:]], atol=2e-5)
  with pytest.raises(RequestError, match="max_tokens"):  # generating nothing is only for scoring
    SamplingParams(max_tokens=0).validate()


def test_n_greedy_samples_share_one_prefill(tiny_llm):
  eng = tiny_llm.engine
  params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
  one = generate(tiny_llm, ARStrategy(), PROMPT, params)
  tiny_llm.reset_prefix_cache()  # the first sample computes its whole prompt, not a cached prefix
  before = dict(eng.totals)
  out = generate(tiny_llm, ARStrategy(), PROMPT, SamplingParams(**{**vars(params), "n": 3}))
  delta = {k: eng.totals[k] - before.get(k, 0) for k in ("prompt_tokens", "prompt_tokens_shared",
                                                         "forwards_prefill")}
  assert [o.index for o in out.outputs] == [0, 1, 2]
  assert all(o.token_ids == one.outputs[0].token_ids for o in out.outputs)
  # the prompt is computed once; each sibling takes its 4 full pages (32 tokens) and computes the last 5 itself,
  # all siblings in one prefill forward after the first sample's 3 chunks
  assert delta == {"prompt_tokens": 37 + 2 * 5, "prompt_tokens_shared": 2 * 32, "forwards_prefill": 3 + 1}


def test_n_sampled_samples_use_the_per_index_seeds(tiny_llm):
  params = SamplingParams(max_tokens=10, temperature=1.0, seed=11, ignore_eos=True, n=3, prompt_logprobs=1)
  out = generate(tiny_llm, LinearStrategy(8), PROMPT, params)
  for i, sample in enumerate(out.outputs):
    alone = generate(tiny_llm, LinearStrategy(8), PROMPT,
                     SamplingParams(max_tokens=10, temperature=1.0, seed=seed_of_sample(11, i), ignore_eos=True))
    assert sample.token_ids == alone.outputs[0].token_ids, i
  assert len({tuple(o.token_ids) for o in out.outputs}) > 1
  assert len(out.prompt_logprobs) == len(PROMPT)


def test_aborted_samples_free_only_their_own_pages(tiny_llm):
  eng = tiny_llm.engine
  tiny_llm.set_policy(ARStrategy())
  params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
  first = eng.add_request(PROMPT, params)
  second = eng.add_request(PROMPT, params, prefill_source=first.request_id)
  third = eng.add_request(PROMPT, params, prefill_source=first.request_id)
  while not second.output_ids:
    eng.step()
  assert eng.allocator.num_shared == 4  # the prompt's full pages, owned by all three
  eng.abort(second.request_id)
  eng.allocator.check()
  assert eng.allocator.num_shared == 4  # still owned by two
  eng.abort(first.request_id)  # the source goes first: its shared pages stay with the third
  eng.allocator.check()
  assert eng.allocator.num_shared == 0 and len(eng.allocator.pages(third.request_id)) >= 5
  eng.run_until_done()
  assert eng.allocator.num_used == 0
  eng.allocator.check()
  alone = generate(tiny_llm, ARStrategy(), PROMPT, params)
  assert third.output_ids == alone.outputs[0].token_ids
  # a source aborted before its prompt is cached: the sibling prefills on its own
  tiny_llm.reset_prefix_cache()
  first = eng.add_request(PROMPT, params)
  second = eng.add_request(PROMPT, params, prefill_source=first.request_id)
  eng.step()
  eng.abort(first.request_id)
  eng.run_until_done()
  assert second.output_ids == alone.outputs[0].token_ids and second.shared_prompt_tokens == 0
  assert eng.allocator.num_used == 0
  eng.allocator.check()
  with pytest.raises(RequestError, match="n"):
    eng.add_request(PROMPT, SamplingParams(n=2))
