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


class IncrementalDetokenizer:
  """Text of a growing token sequence, decoding only a short window per token (vLLM's incremental detokenizer; the
  idea of `tokenizers`' `DecodeStream`, plus what the stop-string rule needs: how far each token's text reaches).

  A token's text is decoded as decode(ids[prefix:]) minus decode(ids[prefix:read]) over the few tokens since the
  last complete character, so merges across token boundaries come out as in a whole decode. A decode ending in
  U+FFFD is an incomplete UTF-8 sequence that a later token completes: it is held back (`text` holds only complete
  characters) but counted in `reach`, as a whole decode up to that token would show it.
  """

  def __init__(self, tokenizer: "Tokenizer", skip_special_tokens: bool = True):
    self.tokenizer = tokenizer
    self.skip_special_tokens = skip_special_tokens
    self.ids: list[int] = []
    self.text = ""
    self.reach: list[int] = []  # reach[k]: len(decode(ids[:k + 1])), pending replacement characters included
    self._prefix = 0  # ids[_prefix:_read] is the context the next token is decoded in
    self._read = 0
    self.decoded_tokens = 0  # tokens passed to decode (the work a test can bound)

  def _decode(self, ids) -> str:
    self.decoded_tokens += len(ids)
    return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

  def add(self, token_ids) -> str:
    """Appends tokens; returns the newly completed text."""
    start = len(self.text)
    for t in token_ids:
      self.ids.append(int(t))
      prefix_text = self._decode(self.ids[self._prefix:self._read])
      new_text = self._decode(self.ids[self._prefix:])
      tail = new_text[len(prefix_text):]
      if tail and not new_text.endswith(REPLACEMENT_CHAR):
        self.text += tail
        self._prefix, self._read = self._read, len(self.ids)
        self.reach.append(len(self.text))
      else:  # nothing new, or an incomplete character: wait for the token that completes it
        self.reach.append(len(self.text) + len(tail))
    return self.text[start:]

  def tokens_reaching(self, pos: int) -> int:
    """The fewest leading tokens whose text reaches past character `pos` (all of them if none does)."""
    for n, r in enumerate(self.reach, 1):
      if r > pos:
        return n
    return len(self.ids)


REPLACEMENT_CHAR = "\ufffd"
