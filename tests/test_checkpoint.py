"""Checkpoint format: stacked layer weights, old per-layer checkpoints stacked on load, errors that name the tensor,
and restores that land on the running devices whatever device the files recorded at save time."""

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from conftest import COMPILE_FLAGS, tiny_config
from recguide_jax.model import checkpoint as ckpt_lib
from recguide_jax.model.params import flatten_params
from recguide_jax.model.nld import NLDModel, with_kernel_layout, with_layer_loop

ROOT = pathlib.Path(__file__).resolve().parent.parent
BUNDLED = ROOT / "checkpoints" / "nld-tiny-gsm8k"


def _flat(model) -> dict[str, np.ndarray]:
  return {k: np.asarray(v) for k, v in flatten_params(nnx.state(model, nnx.Param).to_pure_dict()).items()}


def _legacy_flat(flat: dict, num_layers: int) -> dict[str, np.ndarray]:
  """The pre-stack layout of a stacked flat dict: `layers.<suffix>` [L, ...] -> `layers.<i>.<suffix>`."""
  out = {}
  for name, value in flat.items():
    if name.startswith("layers."):
      for i in range(num_layers):
        out[f"layers.{i}.{name[len('layers.'):]}"] = value[i]
    else:
      out[name] = value
  return out


@pytest.fixture(scope="module")
def model():
  return NLDModel(tiny_config(lora_rank=4, lora_alpha=8.0), rngs=nnx.Rngs(3))


def test_saved_layout_is_stacked_and_round_trips(model, tmp_path):
  ckpt_lib.save_model(tmp_path, model)
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(tmp_path / ckpt_lib.PARAMS_DIR)
  stored = meta.item_metadata if hasattr(meta, "item_metadata") else meta
  assert "layers.self_attn.q_proj.kernel" in stored and not ckpt_lib.is_legacy_layout(stored)
  assert tuple(stored["layers.mlp.down_proj.kernel"].shape) == (2, 128, 64)
  assert not (tmp_path / ckpt_lib.PARAMS_DIR / "_sharding").exists()  # no save-time device in the files
  want, got = _flat(model), _flat(ckpt_lib.load_model(tmp_path))
  assert want.keys() == got.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_a_model_arranged_for_the_cpu_saves_in_the_checkpoint_form(model, tmp_path):
  """The runner's CPU arrangement (one module per layer, [out, in] kernels) never reaches the files."""
  ckpt_lib.save_model(tmp_path, with_kernel_layout(with_layer_loop(model, "unrolled"), "out_in"))
  want, got = _flat(model), _flat(ckpt_lib.load_model(tmp_path))
  assert want.keys() == got.keys()
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_distinct_layers_get_distinct_weights(model):
  q = np.asarray(model.layers.self_attn.q_proj.kernel[...])
  assert q.shape[0] == 2 and not np.array_equal(q[0], q[1])


def test_legacy_per_layer_checkpoint_is_stacked_on_load(model, tmp_path):
  want = _flat(model)
  ckpt_lib.save_params(tmp_path, _legacy_flat(want, 2))
  model.cfg.save_json(tmp_path / ckpt_lib.CONFIG_FILE)
  got = _flat(ckpt_lib.load_model(tmp_path))
  for name in want:
    np.testing.assert_array_equal(got[name], want[name], err_msg=name)


def test_legacy_checkpoint_missing_a_layer_tensor_is_named(model, tmp_path):
  legacy = _legacy_flat(_flat(model), 2)
  del legacy["layers.1.mlp.up_proj.kernel"]
  ckpt_lib.save_params(tmp_path, legacy)
  model.cfg.save_json(tmp_path / ckpt_lib.CONFIG_FILE)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"missing tensor 'layers\.1\.mlp\.up_proj\.kernel'"):
    ckpt_lib.load_model(tmp_path)


def test_stacked_checkpoint_errors_name_the_tensor(model, tmp_path):
  flat = _flat(model)
  flat["layers.self_attn.k_proj.kernel"] = flat["layers.self_attn.k_proj.kernel"][:1]  # one layer short
  ckpt_lib.save_params(tmp_path, flat)
  model.cfg.save_json(tmp_path / ckpt_lib.CONFIG_FILE)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"tensor 'layers\.self_attn\.k_proj\.kernel' has shape"):
    ckpt_lib.load_model(tmp_path)
  # a config with more layers than the checkpoint holds
  model.cfg.replace(num_hidden_layers=3).save_json(tmp_path / ckpt_lib.CONFIG_FILE)
  with pytest.raises(ckpt_lib.CheckpointError, match=r"tensor 'layers\."):
    ckpt_lib.load_model(tmp_path)


def test_bad_dtype_is_refused_by_name(tmp_path):
  with pytest.raises(ckpt_lib.CheckpointError, match="dtype must be one of"):
    ckpt_lib.load_model(BUNDLED, dtype="float8")


def test_bundled_checkpoint_is_stacked():
  with ocp.StandardCheckpointer() as ckptr:
    meta = ckptr.metadata(BUNDLED.absolute() / ckpt_lib.PARAMS_DIR)
  stored = meta.item_metadata if hasattr(meta, "item_metadata") else meta
  assert not ckpt_lib.is_legacy_layout(stored)
  assert not (BUNDLED / ckpt_lib.PARAMS_DIR / "_sharding").exists()


# ---- portable restore: two host devices in a fresh process (this one may have initialised jax already) ---------

_PORTABLE = textwrap.dedent("""
    import json, pathlib, sys
    import jax, numpy as np, orbax.checkpoint as ocp
    from flax import nnx
    sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[1] + "/tests")
    from conftest import tiny_config
    from recguide_jax.model import checkpoint as ckpt_lib
    from recguide_jax.model.params import flatten_params
    from recguide_jax.model.nld import NLDModel, with_kernel_layout, with_layer_loop
    tmp = pathlib.Path(sys.argv[2])
    d0, d1 = jax.devices()[:2]
    cfg = tiny_config(lora_rank=4, lora_alpha=8.0)
    with jax.default_device(d0):
      model = NLDModel(cfg, rngs=nnx.Rngs(5))
    flat = flatten_params(nnx.state(model, nnx.Param).to_pure_dict())
    assert all(v.sharding.device_set == {d0} for v in flat.values())
    out = {}

    def where(m):
      return sorted({str(d) for v in flatten_params(nnx.state(m, nnx.Param).to_pure_dict()).values()
                     for d in v.sharding.device_set})

    def same(m):
      got = flatten_params(nnx.state(m, nnx.Param).to_pure_dict())
      return all(np.array_equal(np.asarray(got[k]), np.asarray(v)) for k, v in flat.items())

    # 1. our save path, from arrays on device 0, restored with device 1 as the target
    ckpt_lib.save_model(tmp / "ours", model)
    m = ckpt_lib.load_model(tmp / "ours", sharding=jax.sharding.SingleDeviceSharding(d1))
    out["ours"] = (where(m), same(m))
    # 2. files that DO record the save-time device (written by orbax straight from device-0 arrays, the layout of
    #    older exports), that device then renamed to one this process lacks: the restore must not consult it
    legacy = {}
    for k, v in flat.items():
      if k.startswith("layers."):
        for i in range(cfg.num_hidden_layers):
          legacy[f"layers.{i}.{k[7:]}"] = v[i]
      else:
        legacy[k] = v
    with ocp.StandardCheckpointer() as ckptr:
      ckptr.save((tmp / "old" / "params").absolute(), legacy)
    cfg.save_json(tmp / "old" / "config.json")
    sharding_file = tmp / "old" / "params" / "_sharding"
    recorded = sharding_file.read_text()
    assert "cpu:0" in recorded
    sharding_file.write_text(recorded.replace("cpu:0", "tpu:7"))
    m = ckpt_lib.load_model(tmp / "old", sharding=jax.sharding.SingleDeviceSharding(d1))
    out["old"] = (where(m), same(m))
    # 3. a per-tensor target (how a mesh will place tensors): the embedding on device 1, the rest on device 0
    spec = lambda name, shape: jax.sharding.SingleDeviceSharding(d1 if name.startswith("embed") else d0)
    m = ckpt_lib.load_model(tmp / "ours", sharding=spec)
    out["per_tensor"] = [str(d) for d in m.embed_tokens.embedding[...].sharding.device_set] + [
        str(d) for d in m.norm.weight[...].sharding.device_set]
    # 4. the bundled checkpoint under a different default device
    with jax.default_device(d1):
      m = ckpt_lib.load_model(sys.argv[1] + "/checkpoints/nld-tiny-gsm8k")
    out["bundled"] = where(m)
    out["devices"] = [str(d0), str(d1)]
    print("RESULT " + json.dumps(out))
""")


def test_restore_targets_the_running_device_not_the_saved_one(tmp_path):
  env = dict(os.environ, XLA_FLAGS=f"{COMPILE_FLAGS} --xla_force_host_platform_device_count=2".strip(),
             JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-c", _PORTABLE, str(ROOT), str(tmp_path)], env=env, capture_output=True,
                        text=True, timeout=600)
  lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
  assert proc.returncode == 0 and lines, proc.stderr[-3000:]
  out = json.loads(lines[-1][len("RESULT "):])
  d0, d1 = out["devices"]
  assert out["ours"] == [[d1], True]
  assert out["old"] == [[d1], True]
  assert out["per_tensor"] == [d1, d0]
  assert out["bundled"] == [d1]
