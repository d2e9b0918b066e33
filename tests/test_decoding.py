"""The decoding-strategy seam: a strategy registered from outside the library (its own round kind, composed of the
generic rounds) runs losslessly without any engine change, and the registry refuses bad names."""

import pytest

from recguide_jax import SamplingParams
from recguide_jax.decoding import registry, rounds
from recguide_jax.decoding.builtin import ARStrategy
from recguide_jax.decoding.strategy import Group, Round, RoundPlan, StepView, Strategy

PARAMS = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13], [20] * 9, [33, 34]]


class LinearThenVerify(Round):
  """A toy round: LinearSS at the group's block, then one extra verify (an AR decode) of the new seed."""
  kind = "linear+verify"

  def run(self, ctx, group: Group) -> str:
    rounds.LINEAR.run(ctx, group)
    live = [r for r in group.reqs if not r.finished]
    if live:
      rounds.AR.run(ctx, Group(rounds.AR, 1, live, [1] * len(live)))
    return self.kind


class ToyStrategy(Strategy):
  """Always B = 8 with one extra verify; counts what the engine tells it."""
  name = "toy"

  def __init__(self):
    self.round = LinearThenVerify()
    self.views: list[StepView] = []
    self.observed = 0
    self.labels = set()

  def plan(self, req, view: StepView) -> RoundPlan:
    self.views.append(view)
    return RoundPlan(self.round, 8)

  def observe(self, req, block_size, accepted, result, row):
    self.observed += 1

  def observe_round(self, kind, block_size, rows, seconds):
    self.labels.add(kind)

  def block_sizes(self):
    return (8,)

  def step_kinds(self):
    return ("prefill", "draft", "verify")


def test_a_registered_toy_strategy_runs_losslessly(tiny_llm):
  registry.register_strategy("toy", lambda block_size, threshold, **kw: ToyStrategy(), replace=True)
  assert "toy" in registry.strategy_names()
  tiny_llm.set_policy(ARStrategy())
  ar = [o.token_ids for o in tiny_llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
  toy = registry.make_strategy("toy")
  tiny_llm.set_policy(toy)
  outs = tiny_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
  assert [o.token_ids for o in outs] == ar
  assert toy.labels == {"linear+verify"} and toy.observed == sum(o.stats["rounds"] for o in outs)
  for o in outs:  # every toy round ran a draft, its verify and the extra AR verify (until the last one)
    f = o.stats["forwards"]
    assert f["draft"] == f["verify"] and f["decode"] >= f["draft"] - 1 > 0
    assert 8 in o.stats["block_sizes"] and 1 in o.stats["block_sizes"]
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
