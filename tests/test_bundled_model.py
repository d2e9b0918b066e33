"""The model shipped in checkpoints/: it loads with its tokenizer and chat template, stays small, and its greedy
LinearSS and RecGuide outputs equal its greedy AR output token for token."""

import pathlib

import pytest

from recguide_jax import LLM

from recguide_jax import SamplingParams

from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
from recguide_jax.llm import BUNDLED_CHECKPOINT
from recguide_jax.recguide.controller import RecGuideStrategy

QUESTIONS = [
    "Tom has 3 boxes with 12 apples in each box. He gives away 9 apples. How many apples does he have left?",
    "A train travels 60 miles per hour for 3 hours and then 40 miles per hour for 2 hours. How far does it go?",
    "Sara buys 4 notebooks at $2 each and a pen for $3. She pays with a $20 bill. How much change does she get?",
    "There are 25 students in a class. 40% of them are boys. How many girls are in the class?",
    "Mike reads 15 pages a day. How many days does he need to finish a 180 page book?",
    "A baker makes 48 cookies and puts them into bags of 6. He sells each bag for $4. How much does he earn?",
]


@pytest.fixture(scope="module")
def bundled():
  return LLM(policy="ar", block_sizes=(8, 16, 32), max_num_seqs=2, max_model_len=512, warmup=False,
             compile_cache_dir=None)


def test_bundled_checkpoint_is_small_and_complete():
  files = [p for p in pathlib.Path(BUNDLED_CHECKPOINT).rglob("*") if p.is_file()]
  names = {p.name for p in files}
  assert {"config.json", "tokenizer.json", "tokenizer_config.json", "MODEL_CARD.md"} <= names
  assert sum(p.stat().st_size for p in files) < 25 * 2**20


def test_bundled_checkpoint_ships_its_draft_lora(bundled):
  """The self-distilled draft adapter is part of the checkpoint and the engine routes it to draft tokens only."""
  assert bundled.cfg.lora_rank > 0 and bundled.cfg.lora_scale > 0


def test_bundled_greedy_speculation_equals_ar(bundled):
  params = SamplingParams(max_tokens=64, temperature=0.0)
  convs = [[{"role": "user", "content": q}] for q in QUESTIONS]
  bundled.set_policy(ARStrategy())
  ar = bundled.chat(convs, params)
  assert all(o.outputs[0].text for o in ar)
  for policy in (LinearStrategy(16), LinearStrategy(32), RecGuideStrategy(16, fixed_regime="overlap"),
                 RecGuideStrategy(16)):
    bundled.set_policy(policy)
    outs = bundled.chat(convs, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ar], policy.name
    assert [o.outputs[0].text for o in outs] == [o.outputs[0].text for o in ar]
  # the trained drafter is worth speculating with: several tokens per LinearSS round on average
  bundled.set_policy(LinearStrategy(16))
  outs = bundled.chat(convs, params)
  accepted = [a for o in outs for a in o.metrics["accepted_lengths"]]
  assert sum(accepted) / len(accepted) > 1.5
