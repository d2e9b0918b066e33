"""The shipped chat prompt set (data/chat_prompts.jsonl): general assistant requests written for this project, so a
chat model's draft adapter is trained and measured on more than GSM8K.

Each line is `{"prompt": ..., "split": "train" | "heldout"}`. The held-out prompts are about topics no train prompt
names (the split is by topic, the request templates are shared), so tau on them measures drafting of unseen
content. They are never used for training."""

from __future__ import annotations

import json
import pathlib

CHAT_PROMPTS_FILE = pathlib.Path(__file__).resolve().parent / "data" / "chat_prompts.jsonl"
SPLITS = ("train", "heldout")


def chat_texts(split: str, path: str | pathlib.Path = CHAT_PROMPTS_FILE) -> list[str]:
  """The prompt texts of one split, in file order."""
  if split not in SPLITS:
    raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
  rows = [json.loads(line) for line in pathlib.Path(path).read_text().splitlines() if line.strip()]
  return [r["prompt"] for r in rows if r["split"] == split]


def chat_prompts(tokenizer, split: str, n: int | None = None, path: str | pathlib.Path = CHAT_PROMPTS_FILE
                 ) -> list[list[int]]:
  """Token ids of the first `n` prompts of `split`, each one chat-templated user turn."""
  if tokenizer is None:
    raise ValueError("the checkpoint has no tokenizer; chat prompts need one")
  return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": t}]))
          for t in chat_texts(split, path)[:n]]
