"""Does the TPU compiler's `cost_analysis()` price a step? Compiles variants at several layer counts, scanned (as
served) and unrolled, and writes flops / bytes accessed / optimal_seconds per device (docs/aot/cost_analysis.md).

  python launch/aot_cost_analysis.py --preset nld-8b --layers 2,4,8 --layer_loop scan
  python launch/aot_cost_analysis.py --preset nld-8b --layers 1,2,4 --layer_loop unrolled
"""

import dataclasses
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from recguide_jax.aot import targets  # noqa: E402

targets.prepare_environment()  # before jax starts a backend

from absl import flags  # noqa: E402

_TARGET = flags.DEFINE_string("target", "v5e:2x2", "TPU slice (CHIP:AxB).")
_TP = flags.DEFINE_integer("tensor_parallel_size", 2, "Devices of the tp group.")
_PRESET = flags.DEFINE_string("preset", "nld-8b", "Model shapes: a preset or a checkpoint directory.")
_LAYERS = flags.DEFINE_list("layers", ["2", "4", "8"], "Layer counts to compile.")
_LOOP = flags.DEFINE_enum("layer_loop", "scan", ["scan", "unrolled"], "How the layers run.")
_VARIANTS = flags.DEFINE_list("variants", ["decode/1/4", "verify/16/4"], "kind/block/batch of each variant.")
_NUM_PAGES = flags.DEFINE_integer("num_pages", 64, "KV pages.")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", os.path.join(ROOT, "runs", "aot"),
                                  "Where cost_analysis.json goes (aot_compile.py's folder).")


def main(argv):
  del argv
  from recguide_jax.attention import dispatch as attention_dispatch
  from recguide_jax.aot.compile import policy_runner_config, shapes_config, target_mesh
  from recguide_jax.cache.memory_plan import _abstract_runner
  from recguide_jax.runtime.step_key import StepKey
  target = targets.parse_target(_TARGET.value)
  _, rc, _, _ = policy_runner_config("recguide", block_size=16, max_num_seqs=32, max_model_len=256, page_size=16,
                                     prefill_chunk=64)
  rc = dataclasses.replace(rc, num_pages=_NUM_PAGES.value, layer_loop=_LOOP.value)
  out = {}
  with attention_dispatch.target_platform("tpu"):
    for layers in map(int, _LAYERS.value):
      cfg = shapes_config(_PRESET.value, 16).replace(num_hidden_layers=layers)
      runner = _abstract_runner(cfg, "bfloat16", rc, "pallas", target_mesh(target, _TP.value))
      for name in _VARIANTS.value:
        kind, blk, b = name.split("/")
        cost = runner.compiled(StepKey.parse(kind, int(blk), int(b))).cost_analysis()
        cost = cost[0] if isinstance(cost, (list, tuple)) else cost
        row = {k: float(cost[k]) for k in ("flops", "bytes accessed", "transcendentals", "optimal_seconds")
               if k in cost}
        out[f"{name}@L{layers}"] = row
        print(f"{_LOOP.value} L={layers} {name}: {row}", flush=True)
  os.makedirs(_OUTPUT_DIR.value, exist_ok=True)
  with open(os.path.join(_OUTPUT_DIR.value, "cost_analysis.json"), "w") as f:
    json.dump(out, f, indent=1)


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(main)
