"""Training data: GSM8K rendered with the engine's chat template, a byte-level BPE tokenizer with split digits and
reserved special tokens, and deterministic packing into fixed-length sequences (the order is a pure function of
(seed, epoch), so a resumed run sees exactly the batches the uninterrupted run would have seen)."""

from __future__ import annotations

import json
import pathlib

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

PAD, BOS, EOS, MASK = "<pad>", "<s>", "</s>", "<mask>"
CHAT_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
SPECIAL_TOKENS = [PAD, BOS, EOS, MASK] + CHAT_TOKENS  # ids 0..7 in this order

# assistant turns end with EOS so a generation stops there; other turns end with <|end|>
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}<|assistant|>\n{{ m['content'] }}{{ eos_token }}"
    "{% else %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def load_gsm8k(path: str | pathlib.Path) -> list[dict]:
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"GSM8K file {path} not found (pass --data_dir)")
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def gsm8k_messages(row: dict, with_answer: bool = True) -> list[dict]:
  msgs = [{"role": "user", "content": row["question"].strip()}]
  if with_answer:
    msgs.append({"role": "assistant", "content": row["answer"].strip()})
  return msgs


def train_tokenizer(texts, vocab_size: int) -> Tokenizer:
  tok = Tokenizer(models.BPE(unk_token=None))
  # digits one by one: arithmetic stays learnable and numbers copy token by token
  tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                               pre_tokenizers.ByteLevel(add_prefix_space=False)])
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  for i, s in enumerate(SPECIAL_TOKENS):
    assert tok.token_to_id(s) == i, f"special token {s} must have id {i}"
  return tok


def save_tokenizer(tok: Tokenizer, directory: str | pathlib.Path) -> None:
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "mask_token": MASK,
      "additional_special_tokens": CHAT_TOKENS, "chat_template": CHAT_TEMPLATE}, indent=2))


def render(messages: list[dict], add_generation_prompt: bool = False) -> str:
  """Renders with the same template the engine applies (recguide_jax.text.tokenizer)."""
  import jinja2.sandbox
  env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
  return env.from_string(CHAT_TEMPLATE).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                                bos_token=BOS, eos_token=EOS)


def encode_documents(tok: Tokenizer, rows: list[dict]) -> list[np.ndarray]:
  docs = tok.encode_batch([render(gsm8k_messages(r)) for r in rows], add_special_tokens=False)
  return [np.asarray(d.ids, np.int32) for d in docs]


class PackedBatches:
  """Packs documents (shuffled per epoch) end to end into rows of `seq_len` tokens; batch `i` of the stream is
  a pure function of (seed, i). `weights` (optional, one array per document, same lengths) are packed alongside
  and returned by `weighted_batch` (per-token loss weights, e.g. 0 on prompts)."""

  def __init__(self, docs: list[np.ndarray], seq_len: int, batch_size: int, seed: int = 0,
               weights: list[np.ndarray] | None = None):
    if weights is not None and [len(w) for w in weights] != [len(d) for d in docs]:
      raise ValueError("every document needs one weight per token")
    self.docs = docs
    self.weights = weights
    self.seq_len = seq_len
    self.batch_size = batch_size
    self.seed = seed
    total = sum(len(d) for d in docs)
    self.rows_per_epoch = total // seq_len
    self.batches_per_epoch = self.rows_per_epoch // batch_size
    self._epoch_cache: dict[int, tuple[np.ndarray, np.ndarray | None]] = {}

  def _epoch_rows(self, epoch: int) -> tuple[np.ndarray, np.ndarray | None]:
    if epoch not in self._epoch_cache:
      order = np.random.default_rng([self.seed, epoch]).permutation(len(self.docs))
      n = self.rows_per_epoch * self.seq_len
      rows = np.concatenate([self.docs[i] for i in order])[:n].reshape(self.rows_per_epoch, self.seq_len)
      wrows = None
      if self.weights is not None:
        wrows = np.concatenate([self.weights[i] for i in order])[:n].reshape(self.rows_per_epoch, self.seq_len)
      self._epoch_cache = {epoch: (rows, wrows)}  # keep one epoch in memory
    return self._epoch_cache[epoch]

  def _slice(self, index: int, which: int) -> np.ndarray:
    epoch, i = divmod(index, self.batches_per_epoch)
    rows = self._epoch_rows(epoch)[which]
    return rows[i * self.batch_size:(i + 1) * self.batch_size]

  def batch(self, index: int) -> np.ndarray:
    return self._slice(index, 0)

  def weighted_batch(self, index: int) -> tuple[np.ndarray, np.ndarray]:
    if self.weights is None:
      raise ValueError("these batches were packed without weights")
    return self._slice(index, 0), self._slice(index, 1)
