"""The default policy of `LLM` and serve.py is RecGuide with the bundled model's shipped tables and profile, and on
a short held-load run (C requests in flight, closed loop) it is never behind AR by more than noise: judged by the
price of its forward ledger under the shipped profile (the benchmark's own pricing), never by this machine's
clock. The controller decides with that profile too (calibrate=False) so that its choices do not follow the load
other processes put on this CPU; the calibrated default is checked lossless on the same run."""

import pytest

from recguide_jax import LLM

from recguide_jax import SamplingParams

from recguide_jax import benchmarks as bench

from recguide_jax.decoding.registry import make_strategy
from recguide_jax.llm import BUNDLED_CHECKPOINT, DEFAULT_POLICY, recguide_defaults
from recguide_jax.recguide.profile import load_profile

PROMPTS = ["Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many "
           "clips did Natalia sell altogether in April and May?",
           "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. How much did "
           "she earn?",
           "Betty is saving money for a new wallet which costs $100. Betty has only half of the money she needs. How "
           "much more money does Betty need?",
           "James writes a 3-page letter to 2 different friends twice a week. How many pages does he write a year?",
           "Tom has 3 apples and buys 5 more. How many apples does he have?",
           "A robe takes 2 bolts of blue fiber and half that much white fiber. How many bolts in total does it take?"]
CONCURRENCY = 3
NOISE = 0.05  # the priced ledgers are deterministic; this only absorbs a tie decided the other way


@pytest.fixture(scope="module")
def llm():
  return LLM(max_num_seqs=CONCURRENCY, max_model_len=256, warmup=False, compile_cache_dir=None)


def _run(llm, policy, prompts):
  llm.set_policy(policy)
  llm.engine.forward_log = []
  reqs, _ = bench.run_concurrent(llm.engine, prompts, SamplingParams(max_tokens=40, temperature=0.0), CONCURRENCY)
  log, llm.engine.forward_log = llm.engine.forward_log, None
  return [r.output_ids for r in reqs], log


def test_the_default_is_recguide_with_the_shipped_tables(llm):
  assert DEFAULT_POLICY == "recguide" and llm.strategy.name == "recguide"
  shipped = recguide_defaults(BUNDLED_CHECKPOINT)["tables"]
  assert llm.strategy.tables is not None and llm.strategy.tables.to_json() == shipped.to_json()


def test_the_default_is_not_behind_ar_by_its_price_on_held_load(llm):
  prompts = [llm.get_tokenizer().encode(p) for p in PROMPTS]
  profile = load_profile(BUNDLED_CHECKPOINT / "profile.json")
  ar_out, ar_log = _run(llm, make_strategy("ar", 16), prompts)
  priced = make_strategy("recguide", 16, **recguide_defaults(BUNDLED_CHECKPOINT), calibrate=False)
  rg_out, rg_log = _run(llm, priced, prompts)
  assert rg_out == ar_out  # lossless: greedy RecGuide is greedy AR token for token
  tokens = sum(len(o) for o in ar_out)
  ar_rate, rg_rate = tokens / bench.priced_ms(ar_log, profile), tokens / bench.priced_ms(rg_log, profile)
  assert rg_rate >= (1 - NOISE) * ar_rate, (rg_rate, ar_rate)
  calibrated_out, _ = _run(llm, make_strategy("recguide", 16, **recguide_defaults(BUNDLED_CHECKPOINT)),
                           prompts)
  assert calibrated_out == ar_out
