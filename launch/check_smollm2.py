"""Checks the converted SmolLM2-135M-Instruct (launch/get_smollm2.py) against transformers, fp32 on the CPU.
Needs the test extra (torch, transformers): `pip install -e ".[test]"`.

The reference is transformers' LlamaForCausalLM holding the weights transformers' own GGUF loader dequantizes from
the same file (with its own undoing of llama.cpp's Q/K permutation), and its own GGUF tokenizer; so the check covers
our whole conversion, not only the forward. Reported: chat-prompt token ids equal, the max |logit| difference of a
causal forward, greedy tokens of the engine (AR policy) against `generate(do_sample=False)`, and the engine's AR
tokens/s at batch 1 (64 new tokens; for a fair comparison with transformers use launch/bench_peer.py).

  python launch/check_smollm2.py [--model=checkpoints/smollm2-135m-instruct] [--max_tokens=48]

Exits 1 when the prompt ids or greedy tokens differ or the logits differ by more than --atol.
"""

import importlib
import json
import os
import pathlib
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from absl import flags, logging  # noqa: E402

import get_smollm2  # noqa: E402  (beside this file)

_MODEL = flags.DEFINE_string("model", str(get_smollm2.REPO / "checkpoints" / "smollm2-135m-instruct"),
                                  "The converted checkpoint.")
_MAX_TOKENS = flags.DEFINE_integer("max_tokens", 48, "New tokens per prompt.")
_ATOL = flags.DEFINE_float("atol", 1e-3, "Largest |logit| difference accepted (fp32 over 30 layers).")
QUESTIONS = ["Tom has 3 apples and buys 5 more. How many apples does he have?",
             "Write one sentence about the sea."]


def main(argv):
  del argv
  if not flags.FLAGS["verbosity"].present:
    logging.set_verbosity(logging.WARNING)
  import numpy as np
  try:  # by name: the test extra's packages, not the package's dependencies
    torch = importlib.import_module("torch")
    transformers = importlib.import_module("transformers")
    load_gguf_checkpoint = importlib.import_module("transformers.modeling_gguf_pytorch_utils").load_gguf_checkpoint
  except ImportError as e:
    sys.exit(f"error: the check runs Hugging Face transformers; install it with `pip install -e \".[test]\"` ({e})")
  AutoTokenizer, LlamaConfig, LlamaForCausalLM = (transformers.AutoTokenizer, transformers.LlamaConfig,
                                                  transformers.LlamaForCausalLM)

  from recguide_jax import LLM

  from recguide_jax import SamplingParams

  from recguide_jax.model import checkpoint
  from pallas_kernels.common import causal_mask
  from recguide_jax.model.nld import ForwardInputs

  ckpt = pathlib.Path(_MODEL.value)
  gguf_path = get_smollm2.fetch_gguf(pathlib.Path(get_smollm2._CACHE_DIR.value))
  hf_cfg = LlamaConfig(**load_gguf_checkpoint(gguf_path, return_tensors=False)["config"])
  hf_cfg._attn_implementation = "eager"
  with torch.device("meta"):
    ref = LlamaForCausalLM(hf_cfg)
  tensors = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=ref)["tensors"]
  ref = LlamaForCausalLM(hf_cfg).float().eval()
  ref.load_state_dict({k: torch.as_tensor(np.asarray(v, np.float32)) for k, v in tensors.items()}, strict=False)
  ref.tie_weights()
  hf_tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

  llm = LLM(model=ckpt, policy="ar", max_num_seqs=1, max_model_len=512)
  mask_id = llm.model.cfg.mask_token_id
  report, ok = {"prompts": []}, True
  for question in QUESTIONS:
    chat = [{"role": "user", "content": question}]
    ours_ids = llm.tokenizer.encode(llm.tokenizer.apply_chat_template(chat))
    hf_ids = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=False)
    hf_ids = list(hf_ids["input_ids"] if isinstance(hf_ids, dict) else hf_ids)
    got = llm.generate([ours_ids], SamplingParams(max_tokens=_MAX_TOKENS.value, temperature=0.0),
                       use_tqdm=False)[0]
    with torch.no_grad():  # the engine never emits its mask token: the reference may not either
      want = ref.generate(torch.tensor([hf_ids]), max_new_tokens=_MAX_TOKENS.value, do_sample=False,
                          eos_token_id=hf_cfg.eos_token_id, suppress_tokens=[mask_id],
                          pad_token_id=hf_cfg.pad_token_id)[0, len(hf_ids):].tolist()
    same = ours_ids == hf_ids and list(got.outputs[0].token_ids) == want
    ok &= same
    report["prompts"].append({"question": question, "prompt_ids_equal": ours_ids == hf_ids,
                              "greedy_equal": list(got.outputs[0].token_ids) == want, "ours": got.outputs[0].text,
                              "transformers": hf_tok.decode(want, skip_special_tokens=True)})

  model = checkpoint.load_model(ckpt)
  seq = np.asarray(ours_ids + list(got.outputs[0].token_ids), np.int32)
  logits, _ = model(ForwardInputs(tokens=seq[None], positions=np.arange(len(seq), dtype=np.int32)[None],
                                  block_mask=causal_mask(len(seq))))
  with torch.no_grad():
    want_logits = ref(torch.tensor(seq[None].astype(np.int64))).logits[0].numpy()
  report["max_abs_logit_diff"] = float(np.abs(np.asarray(logits[0]) - want_logits).max())
  report["max_abs_logit"] = float(np.abs(want_logits).max())
  ok &= report["max_abs_logit_diff"] <= _ATOL.value

  # AR tokens/s at batch 1: a fixed number of new tokens (ignore_eos), after the warm-up above
  n = 64
  params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
  start = time.perf_counter()
  llm.generate([ours_ids], params, use_tqdm=False)
  report["ours_ar_tok_s"] = round(n / (time.perf_counter() - start), 1)
  report["prompt_tokens"] = len(ours_ids)
  print(json.dumps(report, indent=2))
  if not ok:
    print("error: the converted model differs from transformers (see above)", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  from recguide_jax.benchmarks import cli
  cli.run(main)
