"""The memory planner (recguide_jax/cache/memory_plan.py): arithmetic and refusals with stated device sizes (no device
needed), the activation probe on a micro model, the plan inside `LLM`, the server's refusal, and the shipped
docs/memory_plans.json against the planner."""

from __future__ import annotations

import json
import math
import pathlib
import subprocess
import sys

import pytest

from recguide_jax.cache import kv_cache, memory_plan as mp
from recguide_jax.model.config import PRESETS, NLDConfig
from recguide_jax.runtime.runner import RunnerConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
GB = mp.GB
MICRO = NLDConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=8, mask_token_id=3, bos_token_id=1, eos_token_ids=(2,),
                  original_max_position_embeddings=64, rope_factor=4.0, block_size=8)


def _plan(cfg=PRESETS["nld-8b"], **kw):
  args = dict(dtype="bfloat16", page_size=16, max_model_len=8192, max_num_seqs=32, max_block=64, device="test",
              device_bytes=int(141 * GB), fraction=0.9)
  args.update(kw)
  return mp.plan_memory(cfg, **args)


# ---- sizes ------------------------------------------------------------------------------------------------------

def test_param_count_is_the_models():
  import jax
  from flax import nnx

  from recguide_jax.model.nld import NLDModel
  every = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
  for cfg in (MICRO, MICRO.replace(lora_rank=4, lora_alpha=8.0),
              MICRO.replace(lora_rank=4, lora_alpha=8.0, lora_target_modules=every)):
    abstract = nnx.eval_shape(lambda: NLDModel(cfg, rngs=nnx.Rngs(0)))
    assert mp.param_count(cfg) == sum(math.prod(x.shape) for x in jax.tree.leaves(nnx.state(abstract, nnx.Param)))
  assert mp.weights_bytes(MICRO, "bfloat16") == 2 * mp.param_count(MICRO)


@pytest.mark.parametrize("preset", ["nld-8b", "nld-14b"])
def test_sizes_of_presets(preset):
  cfg = PRESETS[preset]
  assert mp.weights_bytes(cfg, "bfloat16") == 2 * cfg.num_params()  # no draft LoRA in the presets
  # K and V, every layer, 16 tokens, 8 KV heads of 128
  assert mp.kv_page_bytes(cfg, 16, "bfloat16") == 2 * cfg.num_hidden_layers * 16 * 8 * 128 * 2
  # the runner's own pledge per sequence
  rc = RunnerConfig(max_model_len=8192, page_size=16, block_sizes=(8, 16, 32), prefill_chunk=64)
  assert kv_cache.pages_per_seq(8192, rc.max_block, 16) == rc.pages_per_seq


def test_plan_fills_the_budget_exactly():
  act = mp.ActivationProfile(base_bytes=int(3 * GB), per_page_bytes=1000.0, variants={}, probe_pages=1,
                             compile_seconds=0.0, backend="test")
  plan = _plan(activation=act)
  budget = int(0.9 * 141 * GB)
  used = lambda pages: plan.weights_bytes + act.at(pages) + pages * plan.kv_page_bytes
  assert plan.sized_by == "memory" and plan.budget_bytes == budget
  assert used(plan.num_pages) <= budget < used(plan.num_pages + 1)  # as many pages as fit, not one more
  assert plan.activation_bytes == act.at(plan.num_pages)
  assert plan.kv_tokens == (plan.num_pages - 1) * 16
  assert plan.max_seqs_at_max_len == (plan.num_pages - 1) // plan.pages_per_seq
  assert plan.total_bytes <= budget
  for words in ("weights", "activations", "KV cache", "pages", "tokens", "sequences of max_model_len 8192"):
    assert words in plan.summary()


def test_flag_sized_plan_without_device_memory():
  plan = _plan(device_bytes=None, fraction=None, max_num_seqs=4)
  assert plan.sized_by == "flags" and plan.budget_bytes is None and plan.activation_bytes is None
  assert plan.num_pages == 4 * plan.pages_per_seq + 1 and plan.max_seqs_at_max_len == 4
  assert _plan(device_bytes=None, fraction=None, num_pages=1000).num_pages == 1000


def test_refuses_weights_that_do_not_fit():
  with pytest.raises(mp.MemoryPlanError) as e:  # 14B in fp32 (54 GB) on a 24 GB L4
    _plan(PRESETS["nld-14b"], dtype="float32", device_bytes=int(24 * GB))
  msg = str(e.value)
  assert "weights 54.02 GB exceed" in msg and "21.60 GB" in msg and "--gpu_memory_utilization" in msg
  assert "--dtype bfloat16" in msg


def test_refuses_a_cache_smaller_than_one_sequence():
  with pytest.raises(mp.MemoryPlanError, match=r"one sequence of --max_model_len 262144 .*lower --max_model_len"):
    _plan(device_bytes=int(24 * GB), max_model_len=262144)


def test_refuses_fixed_pages_over_budget_and_names_the_most_that_fit():
  with pytest.raises(mp.MemoryPlanError, match=r"--num_pages 60000") as e:
    _plan(num_pages=60000)
  room = int(str(e.value).split("at most ")[1].split()[0])
  assert _plan(num_pages=room).num_pages == room  # the figure in the message is right: it fits,
  with pytest.raises(mp.MemoryPlanError):
    _plan(num_pages=room + 1)  # and one page more does not
  assert room == _plan().num_pages  # the same number the fraction alone would plan


class _DeviceInUse:
  """A device whose allocator reports `limit` bytes, `in_use` of them handed out."""
  platform = "gpu"
  id = 0
  device_kind = "test GPU"

  def __init__(self, limit, in_use):
    self.stats = {"bytes_limit": int(limit), "bytes_in_use": int(in_use)}

  def memory_stats(self):
    return self.stats


def test_refuses_a_plan_beside_memory_another_engine_holds():
  # a second LLM in one process used to plan 0.9 of the whole device and fail at its first step (seen on an H200)
  dev = _DeviceInUse(100 * GB, 50 * GB)
  plan = _plan(device_bytes=int(100 * GB))
  with pytest.raises(mp.MemoryPlanError, match=r"held by other arrays.*at most 0\.50"):
    mp.check_free(plan, dev)
  mp.check_free(plan, dev, resident=int(45 * GB))  # the plan's own weights, already loaded, are not "other"
  mp.check_free(plan, _DeviceInUse(100 * GB, 5 * GB))  # small holdings (constants, prompts) leave room
  mp.check_free(_plan(device_bytes=None, fraction=None, num_pages=1000), dev)  # unknown memory: unchecked
  with pytest.raises(mp.MemoryPlanError, match="held by other arrays"):  # before any probe compile
    mp.plan_for_device(PRESETS["nld-8b"], dtype="bfloat16", runner_config=RunnerConfig(max_model_len=4096),
                       kinds=("verify",), block_sizes=(16,), device=dev, measure=False)
  # a stated device size is the user's own account: not checked against the allocator
  mp.plan_for_device(PRESETS["nld-8b"], dtype="bfloat16", runner_config=RunnerConfig(max_model_len=4096),
                     kinds=("verify",), block_sizes=(16,), device=dev, measure=False, device_memory_gb=100)


def test_bad_options_are_named():
  with pytest.raises(mp.MemoryPlanError, match="--gpu_memory_utilization must be in"):
    _plan(fraction=1.5)
  with pytest.raises(mp.MemoryPlanError, match="--dtype"):
    _plan(dtype="int8")


def test_tensor_parallel_plans_per_device():
  cfg = PRESETS["nld-8b"]
  one, four = _plan(), _plan(tp=4)
  # each tensor's shard by sharding.py's rules: 1/4 of the split ones, the norms and the LoRA's B whole
  assert one.weights_bytes / 4 < four.weights_bytes < 1.001 * one.weights_bytes / 4
  assert four.kv_page_bytes == one.kv_page_bytes // 4  # 8 KV heads -> 2 per device
  assert four.num_pages > 4 * one.num_pages  # weights shrink too, so more than 4x the pages per device
  assert mp.kv_page_bytes(cfg, 16, "bfloat16", tp=16) == mp.kv_page_bytes(cfg, 16, "bfloat16", tp=8)  # replicated
  with pytest.raises(mp.MemoryPlanError, match="--tensor_parallel_size 3 must divide the model's 8 KV heads"):
    _plan(tp=3)
  with pytest.raises(mp.MemoryPlanError, match=r"per device, tp=2"):
    _plan(PRESETS["nld-14b"], dtype="float32", device_bytes=int(24 * GB), tp=2)


# ---- the activation probe -----------------------------------------------------------------------------------------

def test_probe_measures_the_largest_variants_from_abstract_shapes():
  rc = RunnerConfig(num_pages=2, page_size=8, max_model_len=32, max_batch=3, block_sizes=(4, 8), prefill_chunk=8)
  act = mp.measure_activation(MICRO, "float32", rc, ("draft", "verify"), (4, 8), attention="reference")
  # the largest bucket (3) and block (8) of each kind, nothing smaller (AR decode, a block of 1, may come with verify)
  assert {"draft/8/3", "verify/8/3"} <= set(act.variants) <= {"draft/8/3", "verify/8/3", "decode/1/3"}
  # a draft's [b, B, V] fp32 distributions outlive it (the verify reads them): they count, on both sides
  q_bytes = 3 * 8 * MICRO.vocab_size * 4
  assert act.variants["draft/8/3"] >= q_bytes and act.variants["verify/8/3"] >= q_bytes
  assert act.per_page_bytes >= 0 and act.base_bytes >= max(act.variants.values()) - act.per_page_bytes * act.probe_pages
  assert act.probe_pages == rc.pages_per_seq + 1


def test_llm_plans_before_loading(monkeypatch):
  from recguide_jax.model import checkpoint
  from recguide_jax import llm as llm_lib

  def no_load(*a, **k):
    raise AssertionError("the weights were loaded before the plan was checked")
  monkeypatch.setattr(checkpoint, "load_model", no_load)
  with pytest.raises(mp.MemoryPlanError, match="--gpu_memory_utilization"):
    llm_lib.LLM(device_memory_gb=0.001, warmup=False, compile_cache_dir=None)
  with pytest.raises(mp.MemoryPlanError, match="--device_memory_gb"):  # CPU reports no memory: say what to pass
    llm_lib.LLM(gpu_memory_utilization=0.5, warmup=False, compile_cache_dir=None)
  with pytest.raises(ValueError, match=r"max_model_len=100000 exceeds the model's max_position_embeddings \(4096\)"):
    llm_lib.LLM(max_model_len=100000, warmup=False, compile_cache_dir=None)  # the bundled model's limit
  with pytest.raises(ValueError, match="dtype must be one of"):
    llm_lib.LLM(dtype="float64", warmup=False, compile_cache_dir=None)


def test_llm_sizes_its_cache_from_the_plan():
  from flax import nnx

  from recguide_jax import SamplingParams
  from recguide_jax.llm import LLM
  from recguide_jax.model.nld import NLDModel
  model = NLDModel(MICRO, rngs=nnx.Rngs(0))
  llm = LLM(model=model, policy="ar", max_num_seqs=2, max_model_len=32, page_size=8, prefill_chunk=8,
            device_memory_gb=0.02, warmup=False, compile_cache_dir=None)
  plan = llm.memory_plan
  assert plan.sized_by == "memory" and plan.max_num_seqs == 2 and plan.dtype == "float32"
  assert llm.runner_config.num_pages == plan.num_pages > 2 * plan.pages_per_seq
  assert plan.total_bytes <= 0.9 * 0.02 * GB
  out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3, temperature=0.0))
  assert len(out[0].outputs[0].token_ids) == 3


def test_server_refuses_a_plan_that_does_not_fit():
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  proc = subprocess.run([sys.executable, str(REPO / "launch" / "serve.py"), "--device_memory_gb=0.005",
                         f"--port={port}", "--max_num_seqs=2", "--compile_cache_dir="], cwd=REPO, capture_output=True,
                        text=True, timeout=300)
  assert proc.returncode == 1, proc.stderr[-2000:]
  errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
  assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
  assert "memory plan does not fit" in errors[0] and "--gpu_memory_utilization 0.90 of 5.0 MB" in errors[0]


# ---- the shipped figures ------------------------------------------------------------------------------------------

def test_docs_figures_match_the_planner():
  path = REPO / "docs" / "memory_plans.json"
  rows = json.loads(path.read_text())
  assert {(r["preset"], r["device"]) for r in rows} >= {(p, d[0]) for p in ("nld-8b", "nld-14b")
                                                         for d in mp.DEVICES.values()}
  for r in rows:
    a = r["activation_probe"]
    act = None if a is None else mp.ActivationProfile(a["base_bytes"], a["per_page_bytes"], a["variants"], 0, 0.0,
                                                      a["backend"])
    kw = dict(dtype=r["dtype"], page_size=r["page_size"], max_model_len=r["max_model_len"],
              max_num_seqs=r["max_num_seqs"], max_block=max(r["block_sizes"] + [64]),
              device=f"stated {r['device']} {r['device_gb']:g} GB", device_bytes=int(r["device_gb"] * GB),
              fraction=r["fraction"], activation=act, tp=r.get("tp", 1))
    if r["refused"]:
      with pytest.raises(mp.MemoryPlanError):
        mp.plan_memory(PRESETS[r["preset"]], **kw)
    else:
      assert mp.plan_memory(PRESETS[r["preset"]], **kw).as_dict() == r["plan"]


def test_server_flags_of_the_plan_are_checked_at_once():
  for args, flag in [(["--gpu_memory_utilization=1.5"], "--gpu_memory_utilization"),
                     (["--gpu-memory-utilization=0"], "--gpu_memory_utilization"),  # vLLM's dashed spelling
                     (["--device_memory_gb=-1"], "--device_memory_gb"), (["--dtype=int8"], "--dtype"),
                     (["--max-num-seqs", "0"], "--max_num_seqs"),
                     (["--max_model_len=100000"], "--max_model_len: 100000 exceeds the model's max_position_embeddings 4096")]:
    proc = subprocess.run([sys.executable, str(REPO / "launch" / "serve.py"), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1 and lines[0].startswith("error:") and flag in lines[0], (
        args, proc.stderr)
  help_text = subprocess.run([sys.executable, str(REPO / "launch" / "serve.py"), "--help"], cwd=REPO,
                             capture_output=True, text=True, timeout=120)
  assert help_text.returncode == 0
  for flag in ("--gpu_memory_utilization", "--max_num_seqs", "--dtype", "--device_memory_gb", "--model",
               "--tensor_parallel_size", "--data_parallel_size", "--served_model_name", "--max_model_len"):
    assert flag in help_text.stdout


class _FakeCompiled:
  def __init__(self, temp):
    self.temp = temp

  def memory_analysis(self):
    from types import SimpleNamespace
    return SimpleNamespace(temp_size_in_bytes=self.temp, argument_size_in_bytes=0, output_size_in_bytes=0,
                           alias_size_in_bytes=0)


class _FakeRunner:
  """An abstract runner's interface to the plan: variants, and a compiled program's memory analysis per variant (here
  a function of the variant and the cache size)."""
  compiles: list = []

  def __init__(self, num_pages, temp_of):
    self.num_pages, self.temp_of, self.state, self.cache = num_pages, temp_of, {}, {}

  def compiled(self, v):
    _FakeRunner.compiles.append((v.name, self.num_pages))
    return _FakeCompiled(self.temp_of(v, self.num_pages))


def test_fit_activation_plans_again_when_a_smaller_bucket_needs_more_than_the_largest():
  """NLD-8B on two H100s: linear's batch-1 decode needs 1.02 GB, more than the 0.89 GB of the batch-32 variants the
  first reserve comes from. The plan is made again with the most any variant needs at the plan's own cache size."""
  import functools
  from recguide_jax.runtime.step_key import StepKey, StepKind
  variants = [StepKey(StepKind.DECODE, 1, b) for b in (1, 8, 32)] + [StepKey(StepKind.VERIFY, 16, 32)]
  temp = {"decode/1/1": 1.02e9, "decode/1/8": 0.5e9, "decode/1/32": 0.89e9, "verify/16/32": 0.7e9}
  plan = functools.partial(mp.plan_memory, PRESETS["nld-8b"], dtype="bfloat16", page_size=16, max_model_len=4096,
                           max_num_seqs=32, max_block=64, device="h100", device_bytes=80 * 2 ** 30, fraction=0.9,
                           tp=2)
  _FakeRunner.compiles = []
  fitted = mp.fit_activation(plan, lambda n: _FakeRunner(n, lambda v, n: int(temp[v.name])), lambda r: variants,
                             workers=1)
  assert fitted.probe.base_bytes == mp.reserve_bytes(int(0.89e9))  # the largest of each kind: decode/1/32
  assert fitted.rounds and fitted.rounds[0][1] == "decode/1/1"
  assert fitted.plan.activation_bytes == mp.reserve_bytes(int(1.02e9)) >= max(fitted.transients.values())
  assert {v.name for v in fitted.transients} == set(temp)
  assert all(n == fitted.plan.num_pages for _, n in _FakeRunner.compiles[-len(variants):])  # at the final size
  assert fitted.plan.num_pages < plan(activation=fitted.probe).num_pages
  # a reserve that leaves no KV page for one sequence: the plan is refused, naming the figures
  with pytest.raises(mp.MemoryPlanError, match="does not fit"):
    mp.fit_activation(plan, lambda n: _FakeRunner(n, lambda v, n: int(80e9 if v.batch == 1 else 1e9)),
                      lambda r: variants, workers=1)
