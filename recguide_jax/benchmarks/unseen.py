"""Prompt sets the bundled RecGuide tables were not fitted on, so that a benchmark can show a controller that only
works on its fitting set.

The tables and overlap priors are fitted on GSM8K train questions 0..95 (launch/shadow_trace.py, 96 prompts) and
0..63 (launch/fit_delta.py); the priced benchmark's main table runs GSM8K test. Two sets outside both:

- `word_problems`: arithmetic word problems written for this repository (data/word_problems.jsonl, SVAMP-style: short,
  one to three operations; shorter and plainer than GSM8K's questions);
- `gsm8k_train_unseen`: GSM8K train questions from UNSEEN_TRAIN_OFFSET on, far past the fitted ones."""

from __future__ import annotations

import pathlib

from recguide_jax.benchmarks import gsm8k

WORD_PROBLEMS = pathlib.Path(__file__).resolve().parent / "data" / "word_problems.jsonl"
FITTED_TRAIN_PROMPTS = 96  # GSM8K train questions 0..95 fitted the bundled tables (launch/shadow_trace.py)
UNSEEN_TRAIN_OFFSET = 2000  # well past them, so a later refit on a few hundred more does not reach it


def prompt_sets(n: int, tokenizer, gsm8k_dir: str | None = None) -> dict[str, list[list[int]]]:
  """{name: the first `n` prompts (fewer where the set is smaller)} of each set; GSM8K train is left out when its
  file is missing (the word problems ship with the package)."""
  sets = {"word_problems": gsm8k.gsm8k_prompts(WORD_PROBLEMS, n, tokenizer)}
  train = pathlib.Path(gsm8k.gsm8k_file("train", gsm8k_dir))
  if train.exists():
    sets["gsm8k_train_unseen"] = gsm8k.gsm8k_prompts(train, n, tokenizer, offset=UNSEEN_TRAIN_OFFSET)
  return sets
