"""The server on a device mesh, one per mesh flag: `launch/serve.py --data_parallel_size=2`,
`--tensor_parallel_size=2` and `--mesh=dp=2,tp=4` on 8 simulated CPU devices (subprocesses: this process's jax already
has its one device) answer greedy completions, two at once (one per dp group), token for token as one device does
offline; /metrics counts every group's requests and KV pages."""

import concurrent.futures
import os
import sys

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # server_fixtures lives next to this file

import server_fixtures as sf  # noqa: E402
from conftest import COMPILE_FLAGS  # noqa: E402

from recguide_jax import LLM

from recguide_jax import SamplingParams  # noqa: E402

MAX_MODEL_LEN = 128
# the same policy, block size, pages and layer programs as the offline reference below; one sequence per group
SERVER_ARGS = ("--max_num_seqs=1", f"--max_model_len={MAX_MODEL_LEN}", "--page_size=8", "--policy=linear",
               "--block_size=8", "--layer_loop=scan", "--kernel_layout=in_out", "--nobackground_compile",
               "--log_stats_interval=0")
PROMPTS = ["The quick brown fox", "How many clips did Natalia sell?"]
MAX_TOKENS = 12
MESHES = {"dp2": ("--data_parallel_size=2",), "tp2": ("--tensor_parallel_size=2",), "dp2_tp4": ("--mesh=dp=2,tp=4",)}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return sf.build_checkpoint(tmp_path_factory.mktemp("mesh") / "nld-mesh")


@pytest.fixture(scope="module")
def servers(ckpt, tmp_path_factory):
  """The servers start at once, so their warm-ups overlap with each other and with the offline reference."""
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = f"{COMPILE_FLAGS} --xla_force_host_platform_device_count=8".strip()
  env["JAX_PLATFORMS"] = "cpu"
  procs = {}
  for name, mesh in MESHES.items():
    tmp = tmp_path_factory.mktemp(name)
    procs[name] = sf.ServerProcess(ckpt, tmp / "server.log", *SERVER_ARGS, *mesh, "--compile_cache_dir=", env=env)
  yield procs
  for p in procs.values():
    p.kill()


@pytest.fixture(scope="module")
def expected(ckpt, servers):
  llm = LLM(ckpt, "linear", 8, max_num_seqs=1, max_model_len=MAX_MODEL_LEN, page_size=8, layer_loop="scan",
            kernel_layout="in_out", warmup=False, compile_cache_dir=None)
  params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
  return [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]


def complete(base: str, prompt: str) -> dict:
  body = {"model": "nld-mesh", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
  r = httpx.post(base + "/v1/completions", json=body, timeout=300)
  assert r.status_code == 200, r.text
  return r.json()


@pytest.mark.parametrize("name", list(MESHES))
def test_mesh_server_answers_as_one_device(servers, expected, name):
  server = servers[name]
  server.wait_ready(timeout=900)
  with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:  # at once: each dp group takes one (tp2: in turn)
    outs = list(pool.map(lambda p: complete(server.base, p), PROMPTS))
  assert [o["choices"][0]["text"] for o in outs] == expected, server.log()[-3000:]
  assert all(o["usage"]["completion_tokens"] == MAX_TOKENS for o in outs)
  families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.base + "/metrics").text)}
  finished = {s.labels["finished_reason"]: s.value for s in families["recguide:request_success"].samples
              if s.name.endswith("_total")}
  assert finished["length"] == len(PROMPTS)
  assert families["recguide:kv_cache_usage_perc"].samples[0].value == 0.0  # every request finished: no page held


def test_both_engines_implement_the_serving_protocol():
  """Every method of `ServingEngine` has the protocol's signature on `Engine` and on `DataParallelEngine` (the
  server calls `add_request` with positional arguments that a narrower signature once refused)."""
  import inspect

  from recguide_jax.parallel.data_parallel import DataParallelEngine
  from recguide_jax.engine.core import Engine
  from recguide_jax.engine.protocol import ServingEngine
  methods = [n for n, v in vars(ServingEngine).items() if inspect.isfunction(v) and not n.startswith("_")]
  assert {"add_request", "abort", "finish", "fail_all", "step", "kv_pages"} <= set(methods)
  for cls in (Engine, DataParallelEngine):
    for name in methods:
      ours = inspect.signature(getattr(cls, name))
      assert list(ours.parameters) == list(inspect.signature(getattr(ServingEngine, name)).parameters), (cls, name)
    for name in ("waiting", "running", "totals", "accepted_per_position", "block_size_choices"):
      assert hasattr(cls, name) or name in inspect.getsource(cls.__init__), (cls, name)
