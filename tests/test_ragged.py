"""Ragged steps (issue 36): LinearSS rows at their own blocks and AR rows in one draft and one verify forward,
compiled per packed-token bucket. Lossless: the same tokens as bucketed and padded grouping, and as AR."""

import zlib

import numpy as np
import pytest

from recguide_jax import SamplingParams
from recguide_jax.decoding.builtin import ARStrategy
from recguide_jax.decoding import rounds
from recguide_jax.decoding.strategy import RoundPlan, Strategy

PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
MIXES = {  # per-request block choices a step draws from (1: an AR row)
  "linear": (8, 16, 32),
  "linear_ar": (1, 8, 16, 32),
  "ar_heavy": (1, 1, 1, 8),
}


class MixedBlocks(Strategy):
  """Plans each request at a block drawn per (request, step) from `choices`: every step mixes block sizes."""
  name = "mixed"

  def __init__(self, choices):
    self.choices = choices

  def plan(self, req, view):
    blk = self.choices[(zlib.crc32(req.request_id.encode()) + 7 * view.step) % len(self.choices)]
    return RoundPlan(rounds.AR if blk == 1 else rounds.LINEAR, blk)

  def block_sizes(self):
    return tuple(b for b in self.choices if b > 1)

  def step_kinds(self):
    return ("prefill", "draft", "verify", "ragged")


def prompts(n, seed):
  rng = np.random.default_rng(seed)
  return [[int(t) for t in np.tile(rng.integers(4, 128, int(rng.integers(1, 4))), 20)[:int(rng.integers(2, 30))]]
          for _ in range(n)]


@pytest.fixture(scope="module")
def ar_reference(tiny_llm):
  ps = prompts(8, 5)
  tiny_llm.set_policy(ARStrategy())
  return ps, [o.token_ids for o in tiny_llm.generate(ps, PARAMS)]


def run(llm, ps, strategy, bucketing, concurrency, params=PARAMS):
  from recguide_jax import benchmarks as bench
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


def test_ragged_variants_do_not_grow_with_block_sizes(tiny_llm):
  runner = tiny_llm.engine.runner
  few = [v for v in runner.variants(["ragged"], (8, 32)) if v.kind.ragged]
  assert few == [v for v in runner.variants(["ragged"], (8, 12, 16, 24, 32)) if v.kind.ragged]
  assert len(few) == 2 * len(runner.config.ragged_buckets)


def test_ragged_sampling_keeps_the_ar_distribution():
  """Sampled ragged steps over several rounds whose rows switch between AR and LinearSS at blocks 2 and 3 from step
  to step: the continuations follow the exact AR distribution (chi-square over every continuation)."""
  from flax import nnx
  from recguide_jax import LLM
  from recguide_jax.model.nld import NLDModel
  from tests.conftest import tiny_config
  from tests.test_sampling import MASK, PROMPT, VOCAB, chi_square_pvalue
  n_tokens, n_samples = 5, 2000
  cfg = tiny_config(vocab_size=VOCAB, mask_token_id=MASK, eos_token_ids=(0,), bos_token_id=1)
  model = NLDModel(cfg, rngs=nnx.Rngs(3))
  llm = LLM(model=model, policy=MixedBlocks((1, 2, 3)), max_num_seqs=32, max_model_len=32, page_size=4,
            prefill_chunk=4, block_sizes=(2, 3), warmup=False, compile_cache_dir=None, bucketing="ragged")
  params = SamplingParams(max_tokens=n_tokens, temperature=0.9, ignore_eos=True)
  llm.engine.forward_log = []
  outs = llm.generate([PROMPT] * n_samples, [params.__class__(**{**params.__dict__, "seed": 7000 + i})
                                              for i in range(n_samples)])
  kinds = {k for k, _, _ in llm.engine.forward_log}
  assert {"ragged_draft", "ragged_verify"} <= kinds
  rounds = [len(o.stats["block_sizes"]) for o in outs]
  assert np.mean(rounds) >= 3 and min(rounds) >= 2, np.mean(rounds)
  assert all(len(set(o.stats["block_sizes"])) > 1 for o in outs[:50])  # each request's rows switch blocks
  exact = _exact(model, params, n_tokens)
  pvalue = chi_square_pvalue([o.token_ids for o in outs], exact)
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
                                  block_mask=jnp.tril(jnp.ones((n, n), bool))))
  p = np.asarray(sampling.processed_probs(logits, jnp.full((b,), params.temperature), jnp.full((b,), params.top_k),
                                          jnp.full((b,), params.top_p), MASK))
  rows = np.arange(b)[:, None]
  cols = len(PROMPT) - 1 + np.arange(n_tokens)[None, :]
  probs = np.prod(p[rows, cols, np.asarray(conts)], axis=1)
  return dict(zip(conts, probs.tolist()))
