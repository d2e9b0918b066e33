"""Training: the sbd mask against its brute-force definition, the structured training attention against the
masked reference, the loss normalisation, one step lowering the loss, and exact resume."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.common import block_attention_ref
from recguide_jax.attention.reference import sbd_training_attention
from recguide_jax.model.nld import ForwardInputs
from recguide_jax.train import data as data_lib
from recguide_jax.train import objective
from recguide_jax.train.trainer import TrainConfig, Trainer


def brute_force_mask(n, blk):
  m = np.zeros((2 * n, 2 * n), bool)
  for q in range(2 * n):
    for k in range(2 * n):
      qn, kn = q < n, k < n
      bq, bk = (q % n) // blk, (k % n) // blk
      if qn and kn:
        m[q, k] = bq == bk
      elif qn and not kn:
        m[q, k] = bk < bq
      elif not qn and not kn:
        m[q, k] = k <= q
  return m


@pytest.mark.parametrize("n,blk", [(8, 4), (16, 8), (32, 8), (24, 8)])
def test_sbd_mask_matches_definition(n, blk):
  np.testing.assert_array_equal(objective.sbd_block_diff_mask(n, blk), brute_force_mask(n, blk))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (8, 2)])
def test_structured_training_attention_equals_masked_reference(hq, hkv):
  rng = np.random.default_rng(hq + hkv)
  b, n, d, blk = 2, 32, 8, 8
  q = jnp.asarray(rng.normal(size=(b, 2 * n, hq, d)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(b, 2 * n, hkv, d)), jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, 2 * n, hkv, d)), jnp.float32)
  got = sbd_training_attention(q, k, v, blk, 0.35)
  want = block_attention_ref(q, k, v, jnp.asarray(objective.sbd_block_diff_mask(n, blk)), scale=0.35)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5)


def test_noise_rate_and_loss_normalisation(tiny_model):
  x0 = jnp.asarray(np.random.default_rng(0).integers(4, 128, size=(3, 16)), jnp.int32)
  key = jax.random.key(0)
  xt, masked, p = objective.noise(key, x0, 3)
  assert np.all(np.asarray(xt)[np.asarray(masked)] == 3)
  assert np.all((np.asarray(p) >= objective.EPS) & (np.asarray(p) <= 1))
  loss, m = objective.joint_loss(tiny_model, x0, key, 8, 3)
  # recompute the global average by hand from the two CE terms
  n_masked = float(np.sum(np.asarray(masked)))
  n_ar = 3 * 15
  logits, _ = tiny_model(ForwardInputs(
      tokens=jnp.concatenate([xt, x0], 1), positions=jnp.tile(jnp.concatenate([jnp.arange(16)] * 2), (3, 1)),
      block_mask=jnp.asarray(objective.sbd_block_diff_mask(16, 8)),
      scale_positions=jnp.tile(jnp.arange(32), (3, 1))))
  lp = np.asarray(jax.nn.log_softmax(logits, -1))
  x = np.asarray(x0)
  diff = sum(-lp[b, i, x[b, i]] / float(p[b]) for b in range(3) for i in range(16) if masked[b, i])
  ar = sum(-lp[b, 16 + i, x[b, i + 1]] for b in range(3) for i in range(15))
  assert float(loss) == pytest.approx((0.3 * diff + ar) / (n_masked + n_ar), rel=1e-4)


def make_trainer(tmp_path, **kw):
  texts = ["The farmer has 12 cows and buys 7 more, so he has 19 cows.", "She pays $3 for 4 apples."] * 20
  tok = data_lib.train_tokenizer(texts, 300)
  docs = [np.asarray(tok.encode(t).ids + [2], np.int32) for t in texts]
  tc = TrainConfig(out_dir=str(tmp_path), vocab_size=300, hidden_size=32, num_layers=2, num_heads=4,
                   num_kv_heads=2, head_dim=8, intermediate_size=64, seq_len=32, batch_size=2, total_steps=8,
                   ar_steps=2, warmup_steps=1, lr=3e-3, save_every=3, eval_every=0,
                   **({"block_sizes": (8,), "block_probs": (1.0,)} | kw))
  return Trainer(tc, docs=docs, tokenizer=tok, eval_docs=docs[:4], progress=False)


def test_training_step_lowers_loss(tmp_path):
  tr = make_trainer(tmp_path)
  tr.step = tr.tc.ar_steps  # joint stage
  x0 = jnp.asarray(tr.batches.batch(0))
  rng = jax.random.key(1)
  fn = tr._train_step_fn("joint", 8)
  model_loss = lambda p: float(objective.joint_loss(__import__("flax").nnx.merge(tr.graphdef, p), x0, rng, 8,
                                                    tr.cfg.mask_token_id)[0])
  before = model_loss(tr.params)
  for _ in range(3):
    tr.params, tr.opt_state, _ = fn(tr.params, tr.opt_state, x0, rng)
  assert model_loss(tr.params) < before


def test_resume_reproduces_uninterrupted_run(tmp_path):
  full = make_trainer(tmp_path / "full")
  full.run()
  part = make_trainer(tmp_path / "part")
  part.run(steps=4)  # stops after 4 steps (checkpointed at 3 and 4)
  resumed = make_trainer(tmp_path / "part")
  resumed.run()
  assert resumed.step == full.step == 8
  for a, b in zip(jax.tree.leaves(full.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (tmp_path / "full" / "loss_curves.png").exists()
  full.export(tmp_path / "export")
  from recguide_jax import LLM
  from recguide_jax import SamplingParams
  llm = LLM(tmp_path / "export", policy="linear", block_size=8, max_num_seqs=1, max_model_len=64, page_size=8,
            prefill_chunk=16, warmup=False, compile_cache_dir=None)
  out = llm.generate("The farmer has", SamplingParams(max_tokens=5, temperature=0))
  assert len(out[0].outputs[0].token_ids) >= 1 and isinstance(out[0].outputs[0].text, str)
