"""Draft LoRA self-distillation: the block layouts match the engine's drafts, a fresh adapter changes nothing, training
moves the draft but never the verifier, resume is exact, the teacher-forced tau counts what LinearSS accepts, target
generation resumes, and an exported base + adapter checkpoint serves lossless LinearSS."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import tiny_config
from recguide_jax.decoding.rounds import draft_signal_rows
from recguide_jax.model import checkpoint as ckpt_lib
from recguide_jax.model.params import flatten_params
from recguide_jax.model.nld import ForwardInputs, NLDModel
from recguide_jax.train import distill

MASK = 3


def test_draft_noise_layouts():
  x0 = jnp.asarray(np.random.default_rng(0).integers(8, 100, size=(4, 64)), jnp.int32)
  for mode_probs, want in (((1, 0, 0), distill.SEEDED), ((0, 1, 0), distill.UNSEEDED), ((0, 0, 1), distill.PARTIAL)):
    xt, masked, mode = distill.draft_noise(jax.random.key(1), x0, 8, MASK, mode_probs)
    xt, masked, mode = map(np.asarray, (xt, masked, mode))
    assert np.all(mode == want)
    first = (np.arange(64) % 8 == 0)[None, :].repeat(4, 0)
    np.testing.assert_array_equal(xt[masked], MASK)
    np.testing.assert_array_equal(xt[~masked], np.asarray(x0)[~masked])
    if want == distill.SEEDED:  # LinearSS draft / correction branch: seed clean, the rest masked
      np.testing.assert_array_equal(masked, ~first)
    elif want == distill.UNSEEDED:  # continuation branch: the bonus slot is masked too
      assert masked.all()
    else:
      assert not masked[first].any() and 0 < masked.mean() < 1


def _rows(n=48, seed=0):
  """Prompt + continuation rows whose continuations follow a simple rule a draft can learn."""
  rng = np.random.default_rng(seed)
  rows = []
  for _ in range(n):
    prompt = [1] + rng.integers(8, 60, size=rng.integers(4, 12)).tolist()
    start = int(rng.integers(60, 100))
    rows.append({"prompt": prompt, "output": [60 + (start + i) % 40 for i in range(int(rng.integers(20, 40)))] + [2]})
  return rows


@pytest.fixture()
def base_dir(tmp_path):
  model = NLDModel(tiny_config(), rngs=nnx.Rngs(3))
  ckpt_lib.save_model(tmp_path / "base", model)
  (tmp_path / "base" / "MODEL_CARD.md").write_text("tiny")
  return tmp_path / "base"


def _trainer(tmp_path, base_dir, name="run", **kw):
  dc = distill.DistillConfig(out_dir=str(tmp_path / name), base_checkpoint=str(base_dir), lora_rank=8,
                             lora_alpha=32.0, seq_len=64, batch_size=2, total_steps=kw.pop("total_steps", 6),
                             warmup_steps=1, lr=3e-3, block_sizes=(8,), block_probs=(1.0,), save_every=2,
                             eval_every=0, val_fraction=0.1, **kw)
  return distill.DraftLoraTrainer(dc, _rows(), progress=False)


def _logits(model, tokens, lora):
  n = tokens.shape[1]
  return model(ForwardInputs(tokens=tokens, positions=jnp.broadcast_to(jnp.arange(n), tokens.shape),
                             block_mask=jnp.ones((n, n), bool),
                             lora_mask=jnp.full(tokens.shape, lora) if lora else None))[0]


def test_fresh_adapter_is_a_no_op_and_training_moves_only_the_draft(tmp_path, base_dir):
  tr = _trainer(tmp_path, base_dir)
  base = ckpt_lib.load_model(base_dir)
  tokens = jnp.asarray(np.random.default_rng(1).integers(8, 100, size=(2, 16)), jnp.int32)
  np.testing.assert_allclose(_logits(tr.model(), tokens, True), _logits(base, tokens, False), atol=1e-6)
  x0, w = tr.batches.weighted_batch(0)
  key = jax.random.key(0)
  loss0, _ = distill.draft_distill_loss(tr.model(), jnp.asarray(x0), jnp.asarray(w), key, 8, MASK, (1, 1, 1))
  for _ in range(6):
    tr.train_step()
  loss1, _ = distill.draft_distill_loss(tr.model(), jnp.asarray(x0), jnp.asarray(w), key, 8, MASK, (1, 1, 1))
  assert float(loss1) < float(loss0)
  # the verifier (adapter off) is bit-identical to the base; the draft (adapter on) is not
  np.testing.assert_array_equal(_logits(tr.model(), tokens, False), _logits(base, tokens, False))
  assert float(jnp.max(jnp.abs(_logits(tr.model(), tokens, True) - _logits(base, tokens, False)))) > 1e-3


def test_resume_reproduces_uninterrupted_run(tmp_path, base_dir):
  straight = _trainer(tmp_path, base_dir, "straight")
  straight.run()
  sliced = _trainer(tmp_path, base_dir, "sliced")
  sliced.run(steps=3)
  resumed = _trainer(tmp_path, base_dir, "sliced")
  resumed.run()
  assert resumed.step == straight.step == 6
  for a, b in zip(jax.tree.leaves(straight.params), jax.tree.leaves(resumed.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert (tmp_path / "sliced" / "loss_curves.png").exists()


class _OneHotModel:
  """Predicts `table[position]` at every noisy position."""

  def __init__(self, table, vocab=16):
    self.table, self.vocab = table, vocab

  def __call__(self, inp):
    n = inp.tokens.shape[1] // 2
    pred = jnp.broadcast_to(self.table[None, :], (inp.tokens.shape[0], n))
    logits = jax.nn.one_hot(jnp.concatenate([pred, pred], 1), self.vocab)
    return logits, None


def test_teacher_forced_tau_counts_leading_matches():
  x0 = jnp.asarray(np.arange(16) % 10 + 4, jnp.int32)[None]
  table = np.asarray(x0[0])
  table = table.copy()
  table[3] = 0  # block 0 (positions 0..7): positions 1, 2 right, 3 wrong -> accepts 1 + 2
  table[9:] = 0  # block 1: position 9 wrong -> accepts 1
  weight = jnp.ones((1, 16))
  total, blocks = distill.seeded_accept_proxy(_OneHotModel(jnp.asarray(table)), x0, weight, 8, MASK)
  assert (int(total), int(blocks)) == (3 + 1, 2)
  # a block that reaches into the prompt (weight 0) is not counted
  total, blocks = distill.seeded_accept_proxy(_OneHotModel(jnp.asarray(table)), x0, weight.at[0, 12].set(0), 8, MASK)
  assert (int(total), int(blocks)) == (3, 1)


def test_generate_targets_resumes_and_rejects_other_prompts(tmp_path, tiny_llm):
  prompts = [[1, 10 + i, 20 + i, 30] for i in range(5)]
  path = tmp_path / "targets.jsonl"
  first = distill.generate_targets(tiny_llm, prompts[:2], path, max_tokens=6, chunk=2, progress=False)
  rows = distill.generate_targets(tiny_llm, prompts, path, max_tokens=6, chunk=2, progress=False)
  assert rows[:2] == first and [r["prompt"] for r in rows] == prompts
  assert len(path.read_text().splitlines()) == 5
  assert all(0 < len(r["output"]) <= 6 for r in rows)
  with pytest.raises(ValueError, match="other prompts"):
    distill.generate_targets(tiny_llm, prompts[1:], path, max_tokens=6, progress=False)
  docs, weights = distill.target_documents(rows)
  assert [len(d) for d in docs] == [len(r["prompt"]) + len(r["output"]) for r in rows]
  assert all(w[:4].sum() == 0 and w[4:].all() for w in weights)


@pytest.mark.parametrize("head", ["same_position", "next_position"])
def test_exported_adapter_checkpoint_serves_lossless(tmp_path, base_dir, head):
  from recguide_jax import LLM
  from recguide_jax import SamplingParams
  from recguide_jax.decoding.builtin import ARStrategy, LinearStrategy
  if head != "same_position":
    base_dir = tmp_path / head
    ckpt_lib.save_model(base_dir, NLDModel(tiny_config(draft_head=head), rngs=nnx.Rngs(3)))
    (base_dir / "MODEL_CARD.md").write_text("tiny")
  tr = _trainer(tmp_path, base_dir)
  tr.run()
  out = tmp_path / "exported"
  tr.export(out)
  cfg = json.loads((out / "config.json").read_text())
  assert cfg["draft_lora"] == {"r": 8, "lora_alpha": 32.0, "target_modules": ["o_proj"]}
  assert (out / "MODEL_CARD.md").exists()
  llm = LLM(out, policy="linear", block_size=8, max_num_seqs=4, max_model_len=128, page_size=8, prefill_chunk=16,
            compile_cache_dir=None)
  assert llm.cfg.lora_rank == 8
  prompts = [r["prompt"] for r in _rows(4, seed=5)]
  params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
  spec = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
  llm.set_policy(ARStrategy())
  ar = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
  assert spec == ar

  # the adapter is trained on the doubled training sequence and served over the paged KV cache: the engine's draft
  # of a block must be the training layout's draft of the same block (a seeded block after a clean prefix)
  prompt = (prompts[0] * 8)[:16]  # a whole number of blocks, so the first drafted block is block-aligned
  llm.set_policy(LinearStrategy(8))
  llm.engine.round_log = []
  served = llm.generate([prompt], params)[0].outputs[0].token_ids
  served_conf = np.asarray(draft_signal_rows(llm.engine.round_log)[0]["conf"])
  llm.engine.round_log = None
  model = ckpt_lib.load_model(out)
  x0 = jnp.asarray([prompt + served[:8]], jnp.int32)
  xt = jnp.where((jnp.arange(24) % 8 == 0)[None], x0, model.cfg.mask_token_id)
  logits = distill.draft_logits(model, xt, x0, 8, model.cfg.mask_token_id, model.cfg.draft_head)[0, 16:24]
  logits = logits.at[:, model.cfg.mask_token_id].set(-jnp.inf)
  trained_conf = np.asarray(jnp.max(jax.nn.softmax(logits, axis=-1), axis=-1))
  np.testing.assert_allclose(served_conf[1:], trained_conf[1:], atol=1e-4)


def test_llama_adapter_on_every_projection_with_a_trained_mask_embedding(tmp_path):
  """A plain Llama's draft adapter (tied head, LoRA on every projection, the mask row trained): the verifier's logits
  stay the base's except the mask token's own (never sampled), and the PEFT export reads back exactly."""
  from recguide_jax.model.config import LORA_TARGET_MODULES
  from recguide_jax.convert import peft
  cfg = tiny_config(tie_word_embeddings=True, rope_type="default", llama_4_scaling_beta=0.0, rope_factor=1.0)
  ckpt_lib.save_model(tmp_path / "base", NLDModel(cfg, rngs=nnx.Rngs(4)))
  dc = distill.DistillConfig(out_dir=str(tmp_path / "run"), base_checkpoint=str(tmp_path / "base"), lora_rank=4,
                             lora_alpha=16.0, lora_target_modules=LORA_TARGET_MODULES, train_mask_embedding=True,
                             seq_len=64, batch_size=2, total_steps=4, warmup_steps=1, lr=3e-3, block_sizes=(8,),
                             block_probs=(1.0,), save_every=4, eval_every=0)
  tr = distill.DraftLoraTrainer(dc, _rows(), progress=False, eval_rows={"a": _rows(8, 1), "b": _rows(8, 2)})
  base = ckpt_lib.load_model(tmp_path / "base")
  tokens = jnp.asarray(np.random.default_rng(1).integers(8, 100, size=(2, 16)), jnp.int32)
  np.testing.assert_allclose(_logits(tr.model(), tokens, True), _logits(base, tokens, False), atol=1e-6)
  tr.run()
  assert set(tr.evaluate()) == {f"eval_tau_{n}_8" for n in "ab"}
  others = np.arange(cfg.vocab_size) != MASK
  np.testing.assert_array_equal(np.asarray(_logits(tr.model(), tokens, False))[..., others],
                                np.asarray(_logits(base, tokens, False))[..., others])
  mask_row = np.asarray(tr.params["mask_embed"])
  assert not np.allclose(mask_row, np.asarray(base.embed_tokens.embedding[...][MASK]))
  tr.export_adapter(tmp_path / "adapter", dtype="float32")
  raw = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
  assert raw["target_modules"] == list(LORA_TARGET_MODULES) and raw["trainable_token_indices"] == [MASK]
  read_cfg, flat, rows = peft.read_adapter(tmp_path / "adapter", cfg)
  assert read_cfg.lora_target_modules == LORA_TARGET_MODULES and read_cfg.lora_rank == 4
  want = flatten_params(tr.params["lora"].to_pure_dict())
  assert set(flat) == set(want) and len(flat) == 2 * len(LORA_TARGET_MODULES)
  for name, value in flat.items():
    np.testing.assert_array_equal(value, np.asarray(want[name]))
  np.testing.assert_array_equal(rows[MASK], mask_row)

