"""Shared fixtures: tiny random NLD models and engines built once per test session (compiling step variants is
the slow part on CPU, so tests reuse runners and compile lazily; each module's variants are dropped when it ends),
and the XLA:CPU compile options of the session."""

import atexit
import gc
import importlib.metadata
import importlib.util
import os
import shutil
import sys
import tempfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)


# libtpu (the test extra's TPU compiler, for tests/test_aot.py) would have jax look for a TPU on this host: the suite
# runs on the CPU, and libtpu must never ask a cloud metadata server for a TPU's description
os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
if importlib.util.find_spec("libtpu") and not os.environ.get("JAX_PLATFORMS"):
  os.environ["JAX_PLATFORMS"] = "cpu"


# The suite's persistent compilation cache is its own, made fresh each session and shared with the servers and
# scripts it starts: never a directory that other runs, jaxlibs or hosts wrote into. RECGUIDE_TEST_COMPILE_CACHE
# names a directory to keep between runs instead.
if os.environ.get("RECGUIDE_TEST_COMPILE_CACHE"):
  os.environ["RECGUIDE_COMPILE_CACHE"] = os.environ["RECGUIDE_TEST_COMPILE_CACHE"]
else:
  os.environ["RECGUIDE_COMPILE_CACHE"] = tempfile.mkdtemp(prefix="recguide-test-xla-")
  atexit.register(shutil.rmtree, os.environ["RECGUIDE_COMPILE_CACHE"], ignore_errors=True)


def _cpu_only_jax() -> bool:
  """No accelerator plugin installed (or JAX_PLATFORMS=cpu): every backend this session and its subprocesses
  get is the host CPU. Decided without initializing a backend, since XLA_FLAGS must be set before that."""
  if os.environ.get("JAX_PLATFORMS", "").strip().lower() == "cpu":
    return True
  if os.environ.get("JAX_PLATFORMS"):
    return False
  return not (importlib.metadata.entry_points(group="jax_plugins") or importlib.util.find_spec("jax_plugins")
              or importlib.util.find_spec("libtpu"))


# XLA_FLAGS for the subprocesses of tests whose time is compiling tiny models' variants, not running them (the
# device check, the 8-device mesh and two-process runs, the checkpoint restore). LLVM without optimization and
# XLA:CPU's loop emitters (instead of its fusion emitters) compile a variant ~3x faster and run it ~4x slower; they
# change only the machine code XLA emits, not the HLO programs (results agree with XLA's defaults to float32
# rounding: 6e-6 on the bundled model's logits, same argmax). Not for tests that run many steps (servers,
# benchmarks, the bundled model), which they slow down. CPU-only (an accelerator run keeps its defaults);
# RECGUIDE_TEST_XLA_DEFAULTS=1 keeps XLA's defaults everywhere.
FAST_COMPILE_FLAGS = ("--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true "
                      "--xla_cpu_use_fusion_emitters=false")
COMPILE_FLAGS = (FAST_COMPILE_FLAGS if _cpu_only_jax() and os.environ.get("RECGUIDE_TEST_XLA_DEFAULTS", "") in ("", "0")
                 else "")

import jax  # noqa: E402
from flax import nnx  # noqa: E402

from recguide_jax.model.config import NLDConfig  # noqa: E402
from recguide_jax.model.nld import NLDModel  # noqa: E402


def tiny_config(**overrides) -> NLDConfig:
  base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, mask_token_id=3, bos_token_id=1, eos_token_ids=(2,),
              original_max_position_embeddings=64, rope_factor=4.0, block_size=8)
  base.update(overrides)
  return NLDConfig(**base)


@pytest.fixture(autouse=True, scope="module")
def _release_executables():
  """Drops each module's compiled programs once it is done. XLA:CPU maps every executable's machine code into a few
  memory mappings of its own, and the whole suite's executables alive in one process pass Linux's limit of 65530
  mappings (vm.max_map_count): compilation then crashes the process (SIGSEGV or SIGABRT inside XLA). A variant of
  the tiny model takes ~370 mappings, so the session's shared LLM drops its variants too (the next module that uses
  it compiles what it calls)."""
  yield
  for llm in _SESSION_LLMS:
    llm.runner._compiled.clear()
  jax.clear_caches()
  gc.collect()


_SESSION_LLMS: list = []


@pytest.fixture(scope="session")
def tiny_model() -> NLDModel:
  return NLDModel(tiny_config(), rngs=nnx.Rngs(7))


@pytest.fixture(scope="session")
def tiny_llm(tiny_model):
  """One LLM (runner + engine) over the tiny model for all engine tests; variants compile on first use."""
  from recguide_jax import LLM
  llm = LLM(model=tiny_model, policy="ar", max_num_seqs=8, max_model_len=256, page_size=8, prefill_chunk=16,
            block_sizes=(8, 16, 32), warmup=False, compile_cache_dir=None)
  _SESSION_LLMS.append(llm)
  return llm
