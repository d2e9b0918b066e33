"""Where GSM8K lives and how its questions become prompts.

GSM8K is never committed. Its jsonl splits (`train.jsonl`, `test.jsonl`, one `{"question": ..., "answer": ...}` per
line) are looked up in `$RECGUIDE_GSM8K_DIR` when that is set, else in `../shared/data/gsm8k/` beside the repository
(the layout of the machines this project was built on). Every launch script also takes `--gsm8k_dir` (the folder)
and, where it reads one split, `--data` (the file itself)."""

from __future__ import annotations

import json
import os
import pathlib

GSM8K_ENV = "RECGUIDE_GSM8K_DIR"
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]
SHARED_GSM8K_DIR = REPO_ROOT.parent / "shared" / "data" / "gsm8k"


def default_gsm8k_dir() -> str:
  """$RECGUIDE_GSM8K_DIR if set, else ../shared/data/gsm8k beside the repository."""
  return os.environ.get(GSM8K_ENV) or str(SHARED_GSM8K_DIR)


def gsm8k_file(split: str, gsm8k_dir: str | os.PathLike | None = None) -> str:
  """The jsonl of one split ("train" or "test") in `gsm8k_dir` (default: `default_gsm8k_dir()`)."""
  return os.path.join(gsm8k_dir or default_gsm8k_dir(), f"{split}.jsonl")


def gsm8k_prompts(path: str | os.PathLike, n: int, tokenizer, offset: int = 0) -> list[list[int]]:
  """Token ids of questions offset..offset+n-1 of a GSM8K jsonl, each as one chat-templated user turn."""
  path = pathlib.Path(path)
  if not path.exists():
    raise FileNotFoundError(f"GSM8K file {path} not found (pass --data, --gsm8k_dir or set ${GSM8K_ENV})")
  if tokenizer is None:
    raise ValueError("the checkpoint has no tokenizer; GSM8K prompts need one")
  rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][offset:offset + n]
  return [tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": r["question"].strip()}]))
          for r in rows]
