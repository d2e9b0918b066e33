"""RecGuide's sampled output keeps the AR distribution (chi-square over every continuation of a tiny-vocabulary
model), over several rounds: overlap rounds of sampled requests with their branch hits, and the strategy deciding
regimes and block sizes by itself."""

import numpy as np
import pytest
from flax import nnx

from recguide_jax import LLM, SamplingParams
from recguide_jax.model.nld import NLDModel
from recguide_jax.recguide import profile as prof_lib
from recguide_jax.recguide.controller import RecGuideStrategy
from tests.conftest import tiny_config
from tests.test_ragged import _exact
from tests.test_sampling import MASK, PROMPT, VOCAB, chi_square_pvalue

N_TOKENS, N_SAMPLES = 6, 2000  # the prefill samples the first token: 5 decoded


def params(temperature: float) -> SamplingParams:
  return SamplingParams(max_tokens=N_TOKENS, temperature=temperature, ignore_eos=True)


@pytest.fixture(scope="module")
def model():
  cfg = tiny_config(vocab_size=VOCAB, mask_token_id=MASK, eos_token_ids=(0,), bos_token_id=1)
  return NLDModel(cfg, rngs=nnx.Rngs(3))


def sample(model, strategy, temperature: float, max_num_seqs: int):
  """N_SAMPLES seeded continuations of PROMPT, the chi-square p-value against the exact AR distribution, and the
  forward kinds that ran."""
  llm = LLM(model=model, policy=strategy, max_num_seqs=max_num_seqs, max_model_len=32, page_size=4, prefill_chunk=4,
            warmup=False, compile_cache_dir=None)
  llm.engine.forward_log = []
  outs = llm.generate([PROMPT] * N_SAMPLES, [SamplingParams(**{**params(temperature).__dict__, "seed": 9000 + i})
                                             for i in range(N_SAMPLES)], use_tqdm=False)
  assert llm.engine.allocator.num_used == 0
  pvalue = chi_square_pvalue([o.outputs[0].token_ids for o in outs], _exact(model, params(temperature), N_TOKENS))
  return outs, pvalue, {k for k, _, _ in llm.engine.forward_log}


def test_sampled_overlap_rounds_keep_the_ar_distribution(model):
  """Sampled requests in overlap rounds: point-mass drafts accepted by the reference rule, branches reused when the
  sampled correction or bonus token equals their first token."""
  strategy = RecGuideStrategy(8, fixed_regime="overlap", planner="expected_hit", overlap_slots=3,
                              overlap_max_temperature=1.0)
  outs, pvalue, kinds = sample(model, strategy, 0.9, 32)
  assert "fused3" in kinds
  rounds = [o.metrics["rounds"] for o in outs]
  assert np.mean(rounds) >= 3, np.mean(rounds)
  saved = sum(o.metrics["rounds"] - o.metrics["forwards"]["draft"] for o in outs)
  assert saved > 0 and strategy.overlap_outcomes["correction_hit"] > 0  # branches of sampled tokens were reused
  assert pvalue > 0.01, f"sampled overlap continuations deviate from AR (p={pvalue:.2e})"


def test_sampled_output_of_recguide_deciding_keeps_the_ar_distribution(model):
  """RecGuide deciding by itself (B200 table, no wall clock) at two requests at a time: the batch pricing switches
  steps between AR and LinearSS and the adaptive rule picks B = 8 or 16 per request, so requests' rounds mix
  block sizes and regimes."""
  strategy = RecGuideStrategy(16, profile=prof_lib.load_profile("b200_nld8b"), calibrate=False,
                              overlap_max_temperature=1.0)
  outs, pvalue, kinds = sample(model, strategy, 0.4, 2)
  assert {"draft", "verify", "decode"} <= kinds
  assert {8, 16, 1} <= {b for o in outs for b in o.metrics["block_sizes"]}
  assert any(len(set(o.metrics["block_sizes"])) > 1 for o in outs)  # one request's rounds at two block sizes
  assert max(o.metrics["rounds"] for o in outs) >= 3
  assert pvalue > 0.01, f"RecGuide's sampled continuations deviate from AR (p={pvalue:.2e}; {kinds})"


def test_overlap_max_temperature_is_checked():
  with pytest.raises(ValueError, match="overlap_max_temperature"):
    RecGuideStrategy(16, overlap_max_temperature=-0.5)
