"""Draft heads (model/draft_head.py): an AR model's next-position head drafts through a causal block with the adapter
on mask tokens only, so under greedy decoding its first draft token is always the verifier's own (every verify
accepts at least two tokens, and a continuation branch always guesses the bonus), whatever the adapter; every
decoding path stays lossless."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from pallas_kernels.common import causal_mask
from recguide_jax import LLM, SamplingParams
from recguide_jax.decoding.builtin import LinearStrategy
from recguide_jax.decoding.rounds import draft_signal_rows
from recguide_jax.model import draft_head
from recguide_jax.model.config import LORA_TARGET_MODULES, ConfigError, DraftHead
from recguide_jax.model.nld import NLDModel
from recguide_jax.model.params import flatten_params, unflatten_params

PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


def test_block_mask_adapter_rows_and_alignment():
  np.testing.assert_array_equal(draft_head.block_mask(DraftHead.SAME_POSITION, 4), np.ones((4, 4), bool))
  np.testing.assert_array_equal(draft_head.block_mask(DraftHead.NEXT_POSITION, 4), causal_mask(4))
  tokens = np.array([[7, 3, 3, 9]])
  assert draft_head.adapter_rows(DraftHead.SAME_POSITION, tokens, 3).all()
  np.testing.assert_array_equal(draft_head.adapter_rows(DraftHead.NEXT_POSITION, jnp.asarray(tokens), 3),
                                [[False, True, True, False]])
  h = jnp.arange(2 * 8, dtype=jnp.float32).reshape(1, 8, 2)  # two blocks of 4, position t holds [2t, 2t + 1]
  assert draft_head.align(DraftHead.SAME_POSITION, h, 4) is h
  got = np.asarray(draft_head.align(DraftHead.NEXT_POSITION, h, 4))[0, :, 0] / 2
  np.testing.assert_array_equal(got, [0, 0, 1, 2, 4, 4, 5, 6])  # within each block, from the position before


def test_config_reads_and_names_the_draft_head():
  cfg = tiny_config(draft_head="next_position")
  assert cfg.draft_head is DraftHead.NEXT_POSITION
  assert type(cfg).from_hf_dict(cfg.to_hf_dict()) == cfg
  raw = tiny_config().to_hf_dict()
  raw.pop("draft_head")
  assert type(cfg).from_hf_dict(raw).draft_head is DraftHead.SAME_POSITION  # an NLD config.json has none
  with pytest.raises(ConfigError, match="'draft_head'"):
    tiny_config(draft_head="previous_position")


@pytest.fixture(scope="module")
def next_position_llm():
  """A tiny next-position model with a random adapter on every projection and a random mask row: the draft
  disagrees with the verifier wherever the adapter reaches."""
  cfg = tiny_config(draft_head="next_position", tie_word_embeddings=True, lora_rank=4, lora_alpha=16.0,
                    lora_target_modules=LORA_TARGET_MODULES)
  model = NLDModel(cfg, rngs=nnx.Rngs(5))
  state = nnx.state(model, nnx.Param).to_pure_dict()
  rng = np.random.default_rng(0)
  flat = {k: (jnp.asarray(rng.normal(0, 0.3, v.shape), v.dtype) if k.endswith(("lora_a", "lora_b")) else v)
          for k, v in flatten_params(state).items()}
  emb = flat["embed_tokens.embedding"]
  flat["embed_tokens.embedding"] = emb.at[cfg.mask_token_id].set(jnp.asarray(rng.normal(0, 1.0, emb.shape[1]),
                                                                              emb.dtype))
  nnx.update(model, unflatten_params(state, flat))
  llm = LLM(model=model, policy="ar", max_num_seqs=4, max_model_len=128, page_size=8, prefill_chunk=16,
            block_sizes=(8, 16), warmup=False, compile_cache_dir=None)
  rng = np.random.default_rng(4)
  prompts = [[int(t) for t in rng.integers(4, 128, int(rng.integers(3, 20)))] for _ in range(4)]
  ar = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
  return llm, prompts, ar, model


def _generate(llm, prompts, strategy):
  llm.set_policy(strategy)
  llm.engine.round_log = []
  try:
    outs = [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS, use_tqdm=False)]
    rows = draft_signal_rows(llm.engine.round_log)
  finally:
    llm.engine.round_log = None
  assert llm.engine.allocator.num_used == 0
  return outs, rows


@pytest.mark.parametrize("block", [8, 16])
def test_linear_drafts_accept_the_verifiers_own_token_and_stay_lossless(next_position_llm, block):
  llm, prompts, ar, _ = next_position_llm
  outs, rows = _generate(llm, prompts, LinearStrategy(block))
  assert outs == ar
  assert rows and all(r["accepted"] >= 2 for r in rows), [r["accepted"] for r in rows]
  assert all(r["draft"][1] == r["out"][0] for r in rows)  # the seed's draft is the verifier's greedy token


def test_ragged_rows_accept_the_verifiers_own_token_and_stay_lossless(next_position_llm):
  from test_ragged import MixedBlocks
  llm, prompts, ar, _ = next_position_llm
  outs, rows = _generate(llm, prompts, MixedBlocks((1, 8, 16)))
  assert outs == ar
  assert rows and all(r["accepted"] >= 2 for r in rows if r["block_size"] > 1)


def test_overlap_with_the_next_position_tree_stays_lossless(next_position_llm):
  from recguide_jax.recguide.controller import RecGuideStrategy
  llm, prompts, ar, _ = next_position_llm
  for planner, delta in (("no_p3", 0.0), ("expected_hit", None)):  # delta 0: a continuation in every round
    strategy = RecGuideStrategy(8, planner=planner, delta=delta, fixed_regime="overlap", overlap_slots=3)
    outs, _ = _generate(llm, prompts, strategy)
    assert outs == ar
    assert strategy.overlap_outcomes["continuation_miss"] == 0  # a fully accepted block's bonus is always guessed


def test_fused_continuation_guesses_the_verifiers_bonus(next_position_llm):
  from recguide_jax.cache.kv_cache import PageAllocator
  from recguide_jax.recguide import overlap as ov
  from recguide_jax.runtime.runner import Runner, RunnerConfig
  from recguide_jax.runtime.steps import SamplingArrays
  llm, model = next_position_llm[0], next_position_llm[3]
  cfg, blk = llm.cfg, 8
  alloc = PageAllocator(64, 8, 16)
  alloc.add(0)
  alloc.reserve(0, 64)
  pt = np.asarray(alloc.page_table_row(0, 16))[None]
  runner = Runner(model, RunnerConfig(num_pages=64, page_size=8, max_model_len=120, max_batch=1, block_sizes=(8,),
                                     prefill_chunk=8))
  branches = [ov.Branch(ov.CORRECTION, 3, 77), ov.Branch(ov.CONTINUATION, blk)]
  draft = np.full(blk, 40, np.int32)
  for _ in range(blk):  # Jacobi passes: each fixes one more draft token, until the verifier accepts the whole block
    tokens, pos, mask, lora, write = (np.asarray(x)[None] for x in ov.tree_layout(
        blk, draft, branches, 0, cfg.mask_token_id, head=cfg.draft_head))
    res, br_tok, _ = runner.fused(tokens, pos, mask, lora, write, np.zeros(1, np.int32), pt, SamplingArrays.greedy(1),
                                  blk)
    draft = np.concatenate([draft[:1], res.tokens[0, :blk - 1]]).astype(np.int32)
  assert res.accepted[0] == blk
  assert br_tok[0, 1, 0] == res.tokens[0, blk - 1]  # the continuation's seed is the verifier's bonus token
  assert br_tok[0, 0, 0] == 77  # a correction keeps its alternative


def test_training_attention_reads_a_causal_draft_block():
  from pallas_kernels.common import block_attention_ref
  from recguide_jax.attention.reference import sbd_training_attention
  from recguide_jax.train.objective import sbd_block_diff_mask
  n, blk = 16, 4
  k_q, k_k, k_v = jax.random.split(jax.random.key(0), 3)
  q = jax.random.normal(k_q, (1, 2 * n, 4, 8))
  k, v = jax.random.normal(k_k, (1, 2 * n, 2, 8)), jax.random.normal(k_v, (1, 2 * n, 2, 8))
  mask = sbd_block_diff_mask(n, blk)
  i = np.arange(2 * n)
  noisy_same = (i[:, None] < n) & (i[None, :] < n) & (i[:, None] // blk == i[None, :] // blk)
  mask = mask & ~(noisy_same & (i[None, :] > i[:, None]))  # a noisy query sees its own block up to itself
  want = block_attention_ref(q, k, v, jnp.asarray(mask), scale=0.35)
  got = sbd_training_attention(q, k, v, blk, 0.35, draft_head.block_mask(DraftHead.NEXT_POSITION, blk))
  np.testing.assert_allclose(got, want, atol=1e-5)
