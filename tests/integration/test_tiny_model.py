"""`pdserve model tiny` builds the same offline model everywhere, with a chat template."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

from transformers import AutoConfig, AutoTokenizer

from serve.tiny_model import build_tiny_model


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_build_is_deterministic_and_loadable(tmp_path: Path) -> None:
    """One build by the CLI in its own process, one by the same function in this one (a second
    process would only import torch again)."""
    outs = [tmp_path / "a", tmp_path / "b"]
    done = subprocess.run([sys.executable, "-m", "serve.cli", "model", "tiny", "--out",
                           str(outs[0])], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(outs[0])
    assert build_tiny_model(outs[1]) == outs[1]
    for name in ("model.safetensors", "tokenizer.json"):
        assert digest(outs[0] / name) == digest(outs[1] / name)
    config = AutoConfig.from_pretrained(outs[0])
    assert (config.num_hidden_layers, config.num_key_value_heads) == (4, 2)
    tok = AutoTokenizer.from_pretrained(outs[0])
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}],
                                  add_generation_prompt=True, tokenize=True)
    text = tok.decode(ids if isinstance(ids, list) else ids["input_ids"])
    assert "<|user|>" in text and text.rstrip().endswith("<|assistant|>")
    assert len(tok) == config.vocab_size
