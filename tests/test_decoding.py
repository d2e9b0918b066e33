"""The decoding-strategy seam: a strategy registered from outside the library (its own round kind, composed of the
generic rounds) runs losslessly without any engine change, and the registry refuses bad names."""

import numpy as np
import pytest

from recguide_jax import SamplingParams
from recguide_jax.decoding import registry, rounds
from recguide_jax.decoding.builtin import ARStrategy
from recguide_jax.decoding.strategy import Batch, Round, RoundOutput, RoundPlan, StepPlan, StepView, Strategy

PARAMS = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 9, [33, 34]]


class LinearThenVerify(Round):
  """A toy round composed of runner calls: LinearSS at the batch's block, then one AR decode of the new seed (whose
  K/V it writes right after the accepted tokens), all in one `RoundOutput`."""
  kind = "linear+verify"

  def reserve(self, block, steps):
    return block + 1

  def run(self, runner, batch: Batch) -> RoundOutput:
    n = batch.n
    res = rounds.draft_verify(runner, batch.block, batch)
    acc = np.minimum(res.accepted[:n], batch.planned)
    seed = np.zeros_like(batch.seed)
    seed[:n] = res.tokens[np.arange(n), acc - 1]
    nxt = batch.sub(range(n), key_offset=1)
    nxt.prefix_len[:n] += acc
    dec = runner.verify(seed[:, None], None, nxt.live, nxt.prefix_len, nxt.page_table, nxt.samp)
    tokens = np.zeros((n, batch.block + 1), np.int32)
    logprobs = np.zeros((n, batch.block + 1), np.float32)
    for i in range(n):
      tokens[i, :acc[i]], logprobs[i, :acc[i]] = res.tokens[i, :acc[i]], res.logprobs[i, :acc[i]]
      tokens[i, acc[i]], logprobs[i, acc[i]] = dec.tokens[i, 0], dec.logprobs[i, 0]
    ones = np.ones((n,), np.int64)
    return RoundOutput(self.kind, tokens, acc + 1, logprobs, acc + 1, batch.planned.copy(), acc + 1,
                       [("draft", batch.block, n), ("verify", batch.block, n), ("decode", 1, n)],
                       {"draft": ones, "verify": ones, "decode": ones}, speculative=False, key_rounds=2, verify=res)


class ToyStrategy(Strategy):
  """Always B = 8 with one extra verify; counts what the engine tells it."""
  name = "toy"

  def __init__(self):
    self.round = LinearThenVerify()
    self.views: list[StepView] = []
    self.observed = 0
    self.labels = set()

  def plan_step(self, view: StepView) -> StepPlan:
    self.views.append(view)
    return StepPlan.uniform(RoundPlan(self.round, 8), len(view.requests))

  def observe(self, outcome):
    self.observed += outcome.batch.n * outcome.output.rounds
    self.labels.add(outcome.output.label)

  def block_sizes(self):
    return (8,)

  def step_kinds(self):
    return ("prefill", "draft", "verify", "decode")


def test_a_registered_toy_strategy_runs_losslessly(tiny_llm):
  registry.register_strategy("toy", lambda block_size, threshold, **kw: ToyStrategy(), replace=True)
  assert "toy" in registry.strategy_names()
  tiny_llm.set_policy(ARStrategy())
  ar = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
  toy = registry.make_strategy("toy")
  tiny_llm.set_policy(toy)
  outs = tiny_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
  assert [o.outputs[0].token_ids for o in outs] == ar
  assert toy.labels == {"linear+verify"} and toy.observed == sum(o.metrics["rounds"] for o in outs)
  for o in outs:  # every toy round ran a draft, its verify and the extra AR decode
    f = o.metrics["forwards"]
    assert f["draft"] == f["verify"] == f["decode"] > 0
    assert set(o.metrics["block_sizes"]) == {8}
  assert all(v.max_block >= 8 and v.decoding >= 1 for v in toy.views)
  assert tiny_llm.engine.allocator.num_used == 0


def test_registry_refuses_duplicates_and_unknown_names():
  with pytest.raises(ValueError, match="already registered"):
    registry.register_strategy("linear", lambda block_size, threshold, **kw: ARStrategy())
  with pytest.raises(ValueError, match="unknown policy 'nope'"):
    registry.make_strategy("nope")
  with pytest.raises(ValueError, match="non-empty string"):
    registry.register_strategy("", lambda *a, **k: ARStrategy())
  assert isinstance(registry.make_strategy("linear", 16), Strategy)
