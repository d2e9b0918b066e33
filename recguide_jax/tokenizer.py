"""Tokenizer and chat template of a checkpoint: `tokenizer.json` (HF `tokenizers`) plus a jinja chat template from
`tokenizer_config.json` or `chat_template.jinja`, rendered in a sandbox the way HF `apply_chat_template` does."""

from __future__ import annotations

import json
import pathlib

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer


class TokenizerError(ValueError):
  pass


def _raise_exception(message):
  raise jinja2.exceptions.TemplateError(message)


class Tokenizer:

  def __init__(self, tok: HFTokenizer, chat_template: str | None = None, bos_token: str | None = None,
               eos_token: str | None = None):
    self._tok = tok
    self.chat_template = chat_template
    self.bos_token = bos_token or ""
    self.eos_token = eos_token or ""
    self._template = None
    if chat_template:
      env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
      env.globals["raise_exception"] = _raise_exception
      self._template = env.from_string(chat_template)

  @classmethod
  def from_dir(cls, directory: str | pathlib.Path) -> "Tokenizer":
    directory = pathlib.Path(directory)
    path = directory / "tokenizer.json"
    if not path.exists():
      raise TokenizerError(f"{directory} has no tokenizer.json; pass token ids instead of text")
    tok = HFTokenizer.from_file(str(path))
    template = None
    bos = eos = None
    cfg_path = directory / "tokenizer_config.json"
    if cfg_path.exists():
      cfg = json.loads(cfg_path.read_text())
      template = cfg.get("chat_template")
      bos, eos = cfg.get("bos_token"), cfg.get("eos_token")
      bos = bos.get("content") if isinstance(bos, dict) else bos
      eos = eos.get("content") if isinstance(eos, dict) else eos
    jinja_path = directory / "chat_template.jinja"
    if jinja_path.exists():
      template = jinja_path.read_text()
    return cls(tok, template, bos, eos)

  @property
  def vocab_size(self) -> int:
    return self._tok.get_vocab_size()

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

  def token_to_id(self, token: str) -> int | None:
    return self._tok.token_to_id(token)

  def id_to_token(self, token_id: int) -> str | None:
    return self._tok.id_to_token(token_id)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **template_kwargs) -> str:
    """`template_kwargs`: extra template variables (vLLM's `chat_template_kwargs`, e.g. `enable_thinking`)."""
    if self._template is None:
      raise TokenizerError("this checkpoint has no chat template")
    if not isinstance(messages, list) or not messages:
      raise TokenizerError("messages must be a non-empty list")
    for m in messages:
      if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise TokenizerError("each message needs a string 'role' and a string 'content'")
    try:
      return self._template.render(**template_kwargs, messages=messages, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token)
    except jinja2.exceptions.TemplateError as e:
      raise TokenizerError(f"chat template error: {e}") from e
