"""The frozen engine configuration: errors name the option, and the runner's configuration derives from it (other
RunnerConfig fields pass through by name)."""

import dataclasses

import pytest

from recguide_jax.engine.config import EngineConfig


@pytest.mark.parametrize("field,value", [("max_num_seqs", 0), ("max_model_len", -1), ("page_size", True),
                                         ("max_queue", 0), ("num_pages", 1), ("block_sizes", (1, 8)),
                                         ("attention", "flash"), ("bucketing", "sometimes"), ("bucketing", 1)])
def test_bad_options_name_the_field(field, value):
  with pytest.raises(ValueError, match=field):
    EngineConfig(**{field: value})


def test_runner_config_derives_and_passes_runner_options():
  cfg = EngineConfig(max_num_seqs=4, max_model_len=256, page_size=8, prefill_chunk=16, compile_cache_dir=None,
                     runner_options={"background_compile": True})
  rc = cfg.runner_config((8, 16), num_pages=40)
  assert (rc.max_batch, rc.max_model_len, rc.page_size, rc.block_sizes, rc.num_pages) == (4, 256, 8, (8, 16), 40)
  assert rc.background_compile is True
  with pytest.raises(dataclasses.FrozenInstanceError):
    cfg.max_num_seqs = 8
  with pytest.raises(ValueError, match="not RunnerConfig fields"):
    EngineConfig(runner_options={"warp_speed": 9}).runner_config((8,), 40)
  with pytest.raises(ValueError, match="engine options"):
    EngineConfig(runner_options={"page_size": 9})
