"""bfloat16 serving against transformers' fp32 Ministral3 (the NLD backbone): the shipped default dtype.

fp32 is token-exact (test_convert_parity.py). bf16 rounds weights, activations and the KV cache to 8 mantissa bits,
so its logits are close, not equal, and its greedy choice may differ where the fp32 choice is a near-tie. The tests
state both: the logits within TOL_REL of the fp32 logit scale, and the greedy choice equal to fp32's at every
position whose fp32 top-1/top-2 margin exceeds MARGIN_REL of that scale (twice the logit tolerance: no rounding
within tolerance can flip such a position), with at least MIN_DECISIVE of the positions decisive so the check is
never vacuous. A real NLD checkpoint is converted fp32 -> ours and served with `--dtype bfloat16` (the load-time
override), both teacher-forced (one causal forward) and through the engine (paged bf16 KV cache, AR and LinearSS).
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # hf_reference lives next to this file

import hf_reference as ref  # noqa: E402

from recguide_jax import SamplingParams

from recguide_jax.model import checkpoint  # noqa: E402
from pallas_kernels.common import causal_mask  # noqa: E402
from recguide_jax.convert.hf import convert_hf_checkpoint  # noqa: E402
from recguide_jax.cache.kv_cache import storage_dtype  # noqa: E402
from recguide_jax.llm import LLM  # noqa: E402
from recguide_jax.model.nld import ForwardInputs  # noqa: E402

TOL_REL = 0.03  # max |bf16 - fp32| logit error, relative to the fp32 logits' max |value| (seen: ~1 %)
MARGIN_REL = 2 * TOL_REL  # fp32 top-1/top-2 margins above this (same scale) are decisive: bf16 must agree there
MIN_DECISIVE = 0.4  # at least this share of the positions must be decisive
SEQ = 48
# heavier than the fp32 parity cases (4 layers, GQA 4, 256 vocab) so that rounding has room to accumulate; HF's
# default-scale weights (std 0.05), closer to a trained model's logit scale than the sharp parity cases
NLD = ref.nld_config_dict(vocab=256, hidden=128, inter=256, layers=4, heads=8, kv_heads=2, head_dim=32, theta=1.0e6,
                          factor=4.0)
RESULTS: dict[str, str] = {}


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
  root = tmp_path_factory.mktemp("bf16")
  torch_model = ref.build_model(NLD, seed=5, std=0.05)
  hf_dir = ref.write_hf_dir(root / "hf", NLD, ref.nld_state_dict(torch_model))
  convert_hf_checkpoint(hf_dir, root / "ours", dtype="float32", progress=False)
  (root / "ours" / "tokenizer.json").unlink()  # a stub: the engine is driven with token ids
  yield torch_model, root / "ours"
  if RESULTS:
    print("\nbf16 vs fp32 transformers: " + "; ".join(f"{k}: {v}" for k, v in RESULTS.items()))


def _margins(logits: np.ndarray) -> np.ndarray:
  top2 = np.sort(logits, axis=-1)[..., -2:]
  return top2[..., 1] - top2[..., 0]


def _check_agreement(what: str, got_choice: np.ndarray, want_logits: np.ndarray) -> None:
  scale = float(np.abs(want_logits).max())
  decisive = _margins(want_logits) > MARGIN_REL * scale
  agree = got_choice == want_logits.argmax(-1)
  RESULTS[f"{what} greedy"] = (f"{agree.mean():.0%} of {len(agree)} positions agree, {agree[decisive].mean():.0%} of "
                               f"the {decisive.sum()} decisive ones")
  assert decisive.mean() >= MIN_DECISIVE, f"{what}: only {decisive.mean():.0%} of positions are decisive"
  bad = np.flatnonzero(decisive & ~agree)
  assert not len(bad), f"{what}: bf16 greedy differs from fp32 at decisive positions {bad.tolist()}"


def test_bf16_logits_and_greedy_choices_teacher_forced(converted):
  torch_model, ours = converted
  model = checkpoint.load_model(ours, dtype="bfloat16")
  assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(jnp.bfloat16)}
  tokens = np.random.RandomState(0).randint(0, NLD["vocab_size"], size=SEQ)
  want = ref.torch_logits(torch_model, tokens)
  got, _ = nnx.jit(lambda m, arrays: m(ForwardInputs(**arrays), None))(model, dict(
      tokens=np.asarray(tokens, np.int32)[None], positions=np.arange(SEQ, dtype=np.int32)[None],
      block_mask=causal_mask(SEQ)))
  got = np.asarray(got[0], np.float32)
  scale = float(np.abs(want).max())
  err = float(np.abs(got - want).max())
  RESULTS["logits"] = f"max |err| {err:.3g} = {err / scale:.2%} of max |logit| {scale:.3g}"
  assert err <= TOL_REL * scale, RESULTS["logits"]
  assert err > 0  # really bf16: fp32 is exact to 1e-4
  _check_agreement("causal forward", got.argmax(-1), want)


def test_bf16_serving_greedy_agrees_with_fp32_away_from_near_ties(converted):
  torch_model, ours = converted
  llm = LLM(ours, policy="linear", block_size=8, dtype="bfloat16", max_num_seqs=1, max_model_len=64,
            compile_cache_dir=None)
  # a bf16 cache (on the CPU its bits, as uint16: kv_cache.storage_dtype)
  assert {x.dtype for x in jax.tree.leaves(llm.runner.cache)} == {storage_dtype(jnp.bfloat16, llm.runner.platform)}
  assert llm.memory_plan.dtype == "bfloat16"
  rng = np.random.RandomState(1)
  for policy in ("ar", "linear"):
    llm.set_policy(policy, block_size=8)
    choices, wants = [], []
    for _ in range(2):
      prompt = [int(t) for t in rng.randint(0, NLD["vocab_size"], size=12) if t != NLD["mask_token_id"]]
      out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))[0]
      seq = prompt + out.outputs[0].token_ids
      want = ref.torch_logits(torch_model, seq)[len(prompt) - 1:-1]  # the fp32 logits each output was chosen from
      want[:, NLD["mask_token_id"]] = want.min(-1)  # the engine never emits the mask token
      choices.append(np.asarray(out.outputs[0].token_ids))
      wants.append(want)
    _check_agreement(f"engine {policy}", np.concatenate(choices), np.concatenate(wants))
