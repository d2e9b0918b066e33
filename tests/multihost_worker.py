"""One process of tests/test_multiprocess.py: two of these, 4 CPU devices each, joined by jax.distributed into one
8-device tp mesh. Process 0 leads (runs the engine and publishes each step), process 1 follows (runs the same
steps). Process 0 also decodes the prompt on one local device and writes both token lists as JSON.

  python tests/multihost_worker.py PROCESS_ID PORT OUT_JSON
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def main(pid: int, port: int, out: str) -> int:
  os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=4".strip()
  import jax
  jax.config.update("jax_platforms", "cpu")
  from flax import nnx

  from recguide_jax import LLM

  from recguide_jax import SamplingParams

  from recguide_jax.parallel import multihost as distributed
  from recguide_jax.model.config import NLDConfig
  from recguide_jax.model.nld import NLDModel
  distributed.initialize(f"localhost:{port}", 2, pid)
  assert (jax.process_count(), len(jax.devices()), len(jax.local_devices())) == (2, 8, 4)
  cfg = NLDConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=2, head_dim=8, mask_token_id=3, bos_token_id=1, eos_token_ids=(2,),
                  original_max_position_embeddings=256, rope_factor=4.0, block_size=8, lora_rank=8, lora_alpha=16.0)
  model = NLDModel(cfg, rngs=nnx.Rngs(1))  # the same seed in both processes: the same weights
  prompt, params = [5, 17, 99, 42, 7, 130, 61], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
  kwargs = dict(policy="linear", block_size=8, max_num_seqs=1, max_model_len=64, page_size=8, prefill_chunk=8,
                warmup=False, compile_cache_dir=None)
  llm = LLM(model=model, mesh="tp=8", **kwargs)  # 2 KV heads replicated over 8 devices on two processes
  if pid != 0:
    steps = distributed.follow(llm.runner, timeout_s=600)
    print(f"follower ran {steps} steps", flush=True)
    return 0
  leader = distributed.lead(llm.runner)
  try:
    tokens = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
  finally:
    leader.stop()
  ref = LLM(model=model, **kwargs).generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
  with open(out, "w") as f:
    json.dump({"tokens": list(tokens), "one_device": list(ref), "steps": leader.step}, f)
  return 0


if __name__ == "__main__":
  sys.exit(main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]))
