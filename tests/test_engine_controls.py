"""vLLM's sampling controls (penalties, min_p, min_tokens, logit_bias) in the engine: every decoding path gives AR's
greedy output with them on, a verify whose drafts are all accepted processes each position as AR would after the
draft prefix before it, min_tokens never ends an output early, and bad values are refused naming the field."""

import jax
import numpy as np
import pytest

from pallas_kernels.common import causal_mask
from recguide_jax import SamplingParams
from recguide_jax.decoding.builtin import ARStrategy, DiffusionStrategy, LinearStrategy
from recguide_jax.decoding.rounds import verified_output
from recguide_jax.decoding.strategy import Round, RoundKind, RoundPlan, StepPlan, Strategy
from recguide_jax.engine.requests import RequestError
from recguide_jax.runtime.step_key import StepKind
from recguide_jax.recguide.controller import RecGuideStrategy
from tests.test_engine import varied_prompts
from tests.test_recguide_controller import flat_profile

CONTROLS = dict(repetition_penalty=1.4, presence_penalty=0.6, frequency_penalty=0.4, logit_bias={17: 1.5, 40: -2.0},
                min_tokens=6)
GREEDY = SamplingParams(max_tokens=33, temperature=0.0, **CONTROLS)


def generate(llm, policy, prompts, params):
  llm.set_policy(policy)
  outs = llm.generate(prompts, params, use_tqdm=False)
  assert llm.engine.allocator.num_used == 0
  llm.engine.allocator.check()
  return outs


@pytest.fixture(scope="module")
def prompts():
  return varied_prompts(n=6, seed=3)


@pytest.fixture(scope="module")
def ar_reference(tiny_llm, prompts):
  outs = generate(tiny_llm, ARStrategy(), prompts, GREEDY)
  plain = generate(tiny_llm, ARStrategy(), prompts, SamplingParams(max_tokens=33, temperature=0.0))
  tokens = [o.outputs[0].token_ids for o in outs]
  assert tokens != [o.outputs[0].token_ids for o in plain]  # the controls change the output
  return tokens


@pytest.mark.parametrize("policy", ["linear8", "recguide"])  # recguide: overlap (fused) and adaptive 8/16/32
def test_greedy_output_with_controls_equals_ar(tiny_llm, prompts, ar_reference, policy):
  pol = {"linear8": lambda: LinearStrategy(8),
         "recguide": lambda: RecGuideStrategy(16, delta=0.6, profile=flat_profile())}[policy]()
  outs = generate(tiny_llm, pol, prompts, GREEDY)
  assert [o.outputs[0].token_ids for o in outs] == ar_reference


class OracleRound(Round):
  """Drafts the AR reference's next tokens and verifies them (VERIFY against one-hot draft distributions, or the
  fused GVERIFY of host-given drafts): every draft is accepted iff each verify position is processed exactly as AR
  decoding processed it, penalty counts and min_tokens including the draft prefix before it."""
  kind = RoundKind.LINEAR

  def __init__(self, reference: dict, path: str):
    self.reference, self.path = reference, path

  def run(self, runner, batch):
    reqs, blk, b, n = batch.reqs, batch.block, batch.b, batch.n
    tokens = np.zeros((b, blk), np.int32)
    tokens[:, 0] = batch.seed
    for i, r in enumerate(reqs):
      nxt = self.reference[tuple(r.prompt_ids)][len(r.output_ids):][:blk - 1]
      tokens[i, 1:1 + len(nxt)] = nxt
    if self.path == "verify":
      q = np.asarray(jax.nn.one_hot(tokens, runner.cfg.vocab_size), np.float32)
      res = runner.verify(tokens, q, batch.live, batch.prefix_len, batch.page_table, batch.samp)
      kind = StepKind.VERIFY
    else:
      positions = batch.prefix_len[:, None] + np.arange(blk)[None, :]
      mask = np.broadcast_to(causal_mask(blk), (b, blk, blk)).copy()
      res, _, _ = runner.fused(tokens, positions, mask, np.zeros((b, blk), bool),
                               np.broadcast_to(batch.live[:, None], (b, blk)).copy(), batch.prefix_len,
                               batch.page_table, batch.samp, blk)
      kind = StepKind.GVERIFY
    accepted = res.accepted[:n].astype(np.int64)
    return verified_output(self.kind, res, batch, accepted, [(kind, blk, n)], {StepKind.VERIFY: np.ones((n,), np.int64)})


class OracleStrategy(Strategy):
  name = "oracle"

  def __init__(self, reference, path):
    self.round = OracleRound(reference, path)

  def plan_step(self, view):
    return StepPlan(tuple(RoundPlan(self.round, 8) for _ in view.requests))

  def block_sizes(self):
    return (8,)

  def step_kinds(self):
    return ("prefill", "verify")


@pytest.mark.parametrize("path", ["verify", "gverify"])
def test_fully_accepted_blocks_process_each_position_as_ar(tiny_llm, prompts, ar_reference, path):
  reference = {tuple(p): out for p, out in zip(prompts, ar_reference)}
  outs = generate(tiny_llm, OracleStrategy(reference, path), prompts, GREEDY)
  assert [o.outputs[0].token_ids for o in outs] == ar_reference
  for o in outs:  # every block but a request's last is accepted whole
    assert all(a == 8 for a in o.metrics["accepted_lengths"][:-1]), o.metrics["accepted_lengths"]


@pytest.mark.parametrize("policy", ["ar", "linear8"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_never_ends_early(tiny_llm, policy, temperature):
  """EOS (2) and a stop token id (9) carry a bias that makes them certain: they are held back for min_tokens
  tokens, then end the output at once."""
  pol = ARStrategy() if policy == "ar" else LinearStrategy(8)
  for stop_ids, bias in (((), {2: 100.0}), ((9,), {9: 100.0})):
    params = [SamplingParams(max_tokens=20, temperature=temperature, seed=s, min_tokens=m, stop_token_ids=list(stop_ids),
                             logit_bias=bias) for s, m in ((1, 0), (2, 1), (3, 7), (4, 20))]
    outs = generate(tiny_llm, pol, [[5, 6, 7]] * len(params), params)
    for p, (o,) in zip(params, (out.outputs for out in outs)):
      stop = list(bias)[0]
      if p.min_tokens == p.max_tokens:
        assert len(o.token_ids) == 20 and stop not in o.token_ids and o.finish_reason == "length"
      else:
        assert o.token_ids == o.token_ids[:p.min_tokens] + [stop] and o.finish_reason == "stop", o.token_ids
        assert len(o.token_ids) == p.min_tokens + 1 and stop not in o.token_ids[:-1]


def test_bad_controls_are_refused_naming_the_field(tiny_llm):
  eng = tiny_llm.engine
  tiny_llm.set_policy(ARStrategy())
  for field, value in [("logit_bias", {128: 1.0}), ("logit_bias", {"5": 1.0}), ("presence_penalty", 3.0),
                       ("repetition_penalty", -1.0), ("min_p", -0.1), ("min_tokens", 100)]:
    with pytest.raises(RequestError) as e:
      eng.add_request([5, 6], SamplingParams(max_tokens=10, **{field: value}))
    assert e.value.param == field and field in str(e.value)
  tiny_llm.set_policy(DiffusionStrategy(8))
  with pytest.raises(RequestError, match="min_p is not available with the diffusion policy") as e:
    eng.add_request([5, 6], SamplingParams(max_tokens=10, min_p=0.1))
  assert e.value.param == "min_p"
  assert not eng.has_work()


def test_a_request_with_controls_waits_for_its_variants_while_the_others_run(tiny_model, prompts, ar_reference):
  """A server compiles sampling-control variants on first use on its background compiler (warm-up never plans
  them): the request that needs one waits, a request without controls keeps decoding meanwhile (it used to wait
  for the compile too), and the waiting one then gives AR's output at one control length throughout."""
  import threading

  from recguide_jax import LLM
  llm = LLM(model=tiny_model, policy="ar", max_num_seqs=2, max_model_len=128, page_size=8, prefill_chunk=16,
            compile_cache_dir=None, background_compile=True)
  runner, eng = llm.runner, llm.engine
  try:
    assert runner.wait_background(timeout=600)
    go = threading.Event()
    compile_one = runner._background._compile_one
    runner._background._compile_one = lambda key: (go.wait(600), compile_one(key))
    plain = eng.add_request(prompts[1], SamplingParams(max_tokens=20, temperature=0.0))
    controlled = eng.add_request(prompts[0], GREEDY)
    for _ in range(200):
      if plain.finished:
        break
      eng.step()
    assert plain.finished and len(plain.output_ids) == 20  # ran to the end while the compile was held
    assert not controlled.output_ids and not controlled.finished and runner._deferred
    assert all(k.controls for k in runner._deferred)
    go.set()
    eng.run_until_done()
    assert controlled.output_ids == ar_reference[0]
    assert len({k.controls for k in runner._deferred}) == 1  # its list length was fixed from the start
    assert runner.compiles_after_warmup == len(runner._deferred)  # /metrics' compilations_after_warmup
    assert eng.allocator.num_used == 0
    eng.allocator.check()
  finally:
    go.set()
    runner.close()
