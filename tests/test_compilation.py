"""The persistent compilation cache: XLA:CPU executables are kept per CPU model."""

import os
import subprocess
import sys

from recguide_jax.runtime.compilation import compile_cache_path, host_cpu_fingerprint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_cpu_executables_are_kept_per_cpu_model_and_accelerator_ones_are_not(tmp_path):
  one, other = tmp_path / "one", tmp_path / "other"
  one.write_text("processor\t: 0\nmodel name\t: CPU A\nflags\t\t: fpu sse2 avx2\n\nprocessor\t: 1\nflags\t: x\n")
  other.write_text("processor\t: 0\nmodel name\t: CPU A\nflags\t\t: fpu sse2 avx2 avx512f\n")
  assert host_cpu_fingerprint(str(one)) != host_cpu_fingerprint(str(other))
  assert host_cpu_fingerprint(str(one)) == host_cpu_fingerprint(str(one))
  assert host_cpu_fingerprint(str(tmp_path / "absent"))  # a host without /proc/cpuinfo still gets a directory
  assert compile_cache_path(tmp_path, "cpu") == str(tmp_path / f"cpu-{host_cpu_fingerprint()}")
  for accelerator in ("gpu", "tpu"):  # jax's own key names the device kind there
    assert compile_cache_path(tmp_path, accelerator) == str(tmp_path)


def test_a_cached_cpu_executable_lands_in_this_hosts_directory_and_is_read_back(tmp_path):
  script = ("import jax, jax.numpy as jnp\n"
            "from recguide_jax.runtime.compilation import enable_compile_cache\n"
            "hits = []\n"
            "jax.monitoring.register_event_listener(lambda event, **_: hits.append(event))\n"
            f"enable_compile_cache({str(tmp_path)!r})\n"
            "print(float(jax.jit(lambda x: jnp.sin(x) * 3)(jnp.float32(1.0))))\n"
            "print(hits.count('/jax/compilation_cache/cache_hits'))\n")
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=REPO)
  outs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
          for _ in range(2)]
  for out in outs:
    assert out.returncode == 0, out.stderr[-2000:]
  (value0, hits0), (value1, hits1) = (out.stdout.split() for out in outs)
  assert value0 == value1 and hits0 == "0" and int(hits1) >= 1
  entries = os.listdir(compile_cache_path(tmp_path, "cpu"))
  assert any(e.endswith("-cache") for e in entries), entries
  assert sorted(os.listdir(tmp_path)) == [f"cpu-{host_cpu_fingerprint()}"]


def test_a_compile_near_the_memory_mapping_limit_is_refused_with_the_remedy(tmp_path, monkeypatch):
  import pytest
  from recguide_jax.runtime import compilation
  maps, limit = tmp_path / "maps", tmp_path / "max_map_count"
  limit.write_text("65530\n")
  maps.write_text("m\n" * 1000)
  compilation.check_mapping_headroom(str(maps), str(limit))  # far from the limit: nothing
  assert compilation.mapping_room(str(maps), str(limit)) == 65530 - 6553 - 1000
  maps.write_text("m\n" * 60000)
  assert compilation.mapping_room(str(maps), str(limit)) < 0
  with pytest.raises(compilation.MappingLimitError, match=r"60000 memory mappings of the 65530.*vm.max_map_count"):
    compilation.check_mapping_headroom(str(maps), str(limit))
  compilation.check_mapping_headroom(str(tmp_path / "absent"), str(limit))  # off Linux: nothing to check
  assert compilation.mapping_room(str(tmp_path / "absent"), str(limit)) is None

  # the runner checks before every XLA:CPU compile, so an engine gets the error, not a crash inside XLA
  from conftest import tiny_config
  from flax import nnx
  from recguide_jax.model.nld import NLDModel
  from recguide_jax.runtime.runner import Runner, RunnerConfig
  from recguide_jax.runtime.step_key import StepKey, StepKind
  runner = Runner(NLDModel(tiny_config(), rngs=nnx.Rngs(0)), RunnerConfig(max_batch=1, max_model_len=64, page_size=8))
  monkeypatch.setattr(compilation, "MAPPINGS", str(maps))
  monkeypatch.setattr(compilation, "MAX_MAP_COUNT", str(limit))
  with pytest.raises(compilation.MappingLimitError):
    runner.compiled(StepKey(StepKind.DECODE, 1, 1))
