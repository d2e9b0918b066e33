"""Helpers for the server tests: a tiny checkpoint with a real byte-level BPE tokenizer and a chat template, and the
real server (`launch/serve.py`) as a subprocess."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import time

import httpx

REPO = pathlib.Path(__file__).resolve().parent.parent
SERVE = REPO / "launch" / "serve.py"

SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<mask>"]  # ids 0..3: pad, bos, eos, mask as in conftest.tiny_config
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May.",
    "How many clips did Natalia sell altogether in April and May?",
    "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting.",
    "Betty is saving money for a new wallet which costs $100.",
    "Hello world! How are you today? I am fine, thank you.",
    "Café, naïve, über, jalapeño: a few words with accents.",
    "def add(a, b):\n    return a + b\n",
    "<|user|>\nWhat is 2 + 2?\n<|assistant|>\n2 + 2 = 4.\n",
]


def build_tokenizer(directory: pathlib.Path, vocab_size: int = 320):
  """Trains a byte-level BPE on CORPUS; writes tokenizer.json and tokenizer_config.json (with the chat template)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  tok = Tokenizer(models.BPE())
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(CORPUS * 10, trainer)
  directory.mkdir(parents=True, exist_ok=True)
  tok.save(str(directory / "tokenizer.json"))
  (directory / "tokenizer_config.json").write_text(json.dumps({
      "bos_token": "<s>", "eos_token": "</s>", "mask_token": "<mask>", "pad_token": "<pad>",
      "chat_template": CHAT_TEMPLATE}))
  return tok


def build_checkpoint(directory: pathlib.Path, seed: int = 0) -> pathlib.Path:
  """A tiny random NLD model over the trained tokenizer, saved in our checkpoint format."""
  from flax import nnx

  from conftest import tiny_config
  from recguide_jax.model import checkpoint
  from recguide_jax.model.nld import NLDModel
  tok = build_tokenizer(directory)
  ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
  cfg = tiny_config(vocab_size=tok.get_vocab_size(), bos_token_id=ids["<s>"], eos_token_ids=(ids["</s>"],),
                    mask_token_id=ids["<mask>"], pad_token_id=ids["<pad>"])
  checkpoint.save_model(directory, NLDModel(cfg, rngs=nnx.Rngs(seed)))
  return directory


def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


class ServerProcess:
  """`python launch/serve.py ...` with its output in a log file (read on failure)."""

  def __init__(self, checkpoint: pathlib.Path, log_path: pathlib.Path, *args: str, env: dict | None = None):
    self.port = free_port()
    self.base = f"http://127.0.0.1:{self.port}"
    self.log_path = log_path
    self.cmd = [sys.executable, str(SERVE), f"--model={checkpoint}", f"--port={self.port}", *args]
    self._log = open(log_path, "w")
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1")
    self.proc = subprocess.Popen(self.cmd, cwd=REPO, stdout=self._log, stderr=subprocess.STDOUT, env=env)

  def log(self) -> str:
    if not self._log.closed:
      self._log.flush()
    return self.log_path.read_text()

  def wait_ready(self, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
      if self.proc.poll() is not None:
        raise RuntimeError(f"server exited with {self.proc.returncode} during startup:\n{self.log()[-4000:]}")
      try:
        if httpx.get(self.base + "/health", timeout=2).status_code == 200:
          return
      except httpx.TransportError:
        pass
      time.sleep(0.5)
    self.kill()
    raise TimeoutError(f"server not healthy after {timeout} s:\n{self.log()[-4000:]}")

  def terminate(self, timeout: float) -> int:
    """SIGTERM, then the exit status (raises if it does not exit in time)."""
    self.proc.send_signal(signal.SIGTERM)
    try:
      return self.proc.wait(timeout)
    finally:
      self._log.close()

  def kill(self) -> None:
    if self.proc.poll() is None:
      self.proc.kill()
      self.proc.wait()
    self._log.close()


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, str(SERVE), *args], cwd=REPO, capture_output=True, text=True,
                        timeout=timeout)


class InProcessServer:
  """An app served by uvicorn on a free loopback port from a thread of this process: real HTTP (raw bytes, any
  header, chunked bodies, concurrent streams) with the engine in this process."""

  def __init__(self, app, timeout: float = 60):
    import threading

    import uvicorn
    self.port = free_port()
    self.base = f"http://127.0.0.1:{self.port}"
    config = uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="on",
                            access_log=False)
    self.server = uvicorn.Server(config)
    self.thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
    self.thread.start()
    deadline = time.monotonic() + timeout
    while not self.server.started:
      if not self.thread.is_alive() or time.monotonic() > deadline:
        raise RuntimeError("the in-process server did not start")
      time.sleep(0.05)

  def stop(self, timeout: float = 60) -> None:
    self.server.should_exit = True
    self.thread.join(timeout)
