"""The offline API as vLLM users call it: `LLM(model=<checkpoint dir>)`, `generate(prompts, sampling_params=...)`,
`get_tokenizer()`, a progress bar that counts prompts (not their n samples), and vLLM's SamplingParams fields that
this engine does not implement, accepted at their neutral value and refused (naming the field) otherwise."""

import re

import pytest

from recguide_jax import LLM

from recguide_jax import SamplingParams
from recguide_jax.llm import BUNDLED_CHECKPOINT
from recguide_jax.engine.requests import UNIMPLEMENTED_FIELDS, RequestError


@pytest.fixture(scope="module")
def bundled_llm():
  return LLM(model=str(BUNDLED_CHECKPOINT), policy="ar", max_num_seqs=4, max_model_len=64, page_size=16,
             warmup=False, compile_cache_dir=None)


def test_model_is_the_checkpoint_directory_and_the_tokenizer_is_exposed(bundled_llm):
  tok = bundled_llm.get_tokenizer()
  ids = tok.encode("What is 12 * 7?")
  assert ids and tok.decode(ids).endswith("What is 12 * 7?")
  with pytest.raises(TypeError, match="model must be a checkpoint directory or an NLDModel, got int"):
    LLM(model=123, warmup=False, compile_cache_dir=None)
  with pytest.raises(FileNotFoundError, match="no-such-dir"):
    LLM(model="no-such-dir", warmup=False, compile_cache_dir=None)


def test_generate_takes_sampling_params_and_the_bar_counts_prompts(bundled_llm, capsys):
  params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, n=2)
  outs = bundled_llm.generate(["Hello", "What is 2 + 2?"], sampling_params=params, use_tqdm=True)
  assert [len(o.outputs) for o in outs] == [2, 2]
  assert all(len(c.token_ids) == 3 for o in outs for c in o.outputs)
  bar = capsys.readouterr().err
  counts = re.findall(r"(\d+)/(\d+) \[", bar)
  assert counts and counts[-1] == ("2", "2"), bar  # two prompts, four samples
  (chat,) = bundled_llm.chat([{"role": "user", "content": "Hi"}], sampling_params=SamplingParams(max_tokens=2),
                             use_tqdm=False)
  assert len(chat.outputs[0].token_ids) == 2


@pytest.mark.parametrize("field", sorted(UNIMPLEMENTED_FIELDS))
def test_unimplemented_sampling_fields_are_refused_only_when_set(field):
  neutral = SamplingParams(**{field: (None, *UNIMPLEMENTED_FIELDS[field])[-1]})
  assert neutral.validate() is neutral
  active = {"presence_penalty": 0.5, "frequency_penalty": -0.2, "repetition_penalty": 1.2, "min_p": 0.1,
            "min_tokens": 4, "logit_bias": {5: 3.0}, "bad_words": ["x"], "allowed_token_ids": [1, 2],
            "spaces_between_special_tokens": False}[field]
  with pytest.raises(RequestError, match=f"SamplingParams.{field}=.* is not implemented"):
    SamplingParams(**{field: active})


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(bundled_llm):
  """vLLM's truncate_prompt_tokens: the request runs on the prompt's last k tokens (a prompt longer than the model
  then fits), exactly as that shorter prompt would."""
  tok = bundled_llm.get_tokenizer()
  ids = tok.encode("Natalia sold clips to 48 of her friends in April, and then she sold half as many in May. " * 3)
  assert len(ids) > 64  # longer than this LLM's max_model_len
  greedy = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
  (cut,) = bundled_llm.generate([{"prompt_token_ids": ids}], SamplingParams(**greedy, truncate_prompt_tokens=20),
                                use_tqdm=False)
  (short,) = bundled_llm.generate([{"prompt_token_ids": ids[-20:]}], SamplingParams(**greedy), use_tqdm=False)
  assert cut.prompt_token_ids == ids[-20:] and cut.outputs[0].token_ids == short.outputs[0].token_ids
  (whole,) = bundled_llm.generate([{"prompt_token_ids": ids[:30]}], SamplingParams(**greedy, truncate_prompt_tokens=40),
                                  use_tqdm=False)
  assert whole.prompt_token_ids == ids[:30]  # a prompt shorter than k is used whole
  for bad in (0, -1, 2.5, True):
    with pytest.raises(RequestError, match="truncate_prompt_tokens must be a positive integer"):
      bundled_llm.generate(["Hi"], SamplingParams(max_tokens=2, truncate_prompt_tokens=bad), use_tqdm=False)


def test_prompts_as_vllm_prompt_dicts(bundled_llm):
  tok = bundled_llm.get_tokenizer()
  params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
  text, ids = bundled_llm.generate(["What is 2 + 2?", {"prompt": "What is 2 + 2?"}], params, use_tqdm=False)
  (tokens,) = bundled_llm.generate({"prompt_token_ids": tok.encode("What is 2 + 2?")}, params, use_tqdm=False)
  assert text.outputs[0].token_ids == ids.outputs[0].token_ids == tokens.outputs[0].token_ids
  assert ids.prompt == "What is 2 + 2?" and tokens.prompt is None
  with pytest.raises(RequestError, match="'multi_modal_data'"):
    bundled_llm.generate({"prompt": "Hi", "multi_modal_data": {}}, params, use_tqdm=False)
