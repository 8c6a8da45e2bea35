"""``router.api.tokenizer_class``: the router loads a tokenizer without torch only through the
class ``AutoTokenizer`` itself picks for the same files, asked once per set of files."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from router.api import tokenizer_class
from router.api.tokenization import _encode, _load
from serve.tiny_model import build_tiny_model


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return build_tiny_model()


@pytest.fixture
def own_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A fresh answer cache for this test."""
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizer-classes"


def _copy(model_dir: Path, dest: Path, tokenizer_class: str, model_type: str | None) -> Path:
    """The tiny model's tokenizer files, its config naming ``tokenizer_class``, beside a
    ``config.json`` of ``model_type`` (none when None)."""
    dest.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(model_dir / name, dest / name)
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    (dest / "tokenizer_config.json").write_text(json.dumps({**config,
                                                            "tokenizer_class": tokenizer_class}))
    if model_type is not None:
        (dest / "config.json").write_text(json.dumps({"model_type": model_type}))
    return dest


def test_a_class_autotokenizer_overrides_is_not_used(model_dir: Path, tmp_path: Path,
                                                     own_cache: Path) -> None:
    """A config naming LlamaTokenizer for a qwen2 model: transformers 5's AutoTokenizer loads
    Qwen2Tokenizer (it overrides the hub's class for that model type), so the router does too.
    Control: the named class alone would have been LlamaTokenizer."""
    from transformers import AutoTokenizer

    odd = _copy(model_dir, tmp_path / "odd", "LlamaTokenizer", "qwen2")
    assert tokenizer_class.named_class(str(odd)).__name__ == "LlamaTokenizer"
    assert tokenizer_class.lean_class(str(odd)) is None
    loaded, auto = _load(str(odd)), AutoTokenizer.from_pretrained(str(odd))
    assert type(loaded) is type(auto) and type(auto).__name__ == "Qwen2Tokenizer"
    assert _encode(loaded, "Hello, world") == _encode(auto, "Hello, world")


def test_the_answer_is_asked_once_per_set_of_files(model_dir: Path, tmp_path: Path,
                                                   own_cache: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load asks a child process and remembers; the next reads the disk; changed
    files are asked again (control: a cache that ignored the files would not ask). The child
    answers as AutoTokenizer does for these files (the test above runs a real one)."""
    asked: list[str] = []
    answer = "transformers.tokenization_utils_tokenizers.TokenizersBackend\n"

    def child(cmd: list[str], **kwargs: Any) -> Any:
        asked.append(cmd[3])
        return subprocess.CompletedProcess(cmd, 0, stdout=answer, stderr="")

    monkeypatch.setattr(tokenizer_class.subprocess, "run", child)
    path = _copy(model_dir, tmp_path / "m", "TokenizersBackend", None)
    assert tokenizer_class.lean_class(str(path)).__name__ == "TokenizersBackend"
    assert tokenizer_class.lean_class(str(path)).__name__ == "TokenizersBackend"
    assert asked == [str(path)] and len(list(own_cache.iterdir())) == 1
    (path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    tokenizer_class.lean_class(str(path))
    assert asked == [str(path), str(path)] and len(list(own_cache.iterdir())) == 2


@pytest.mark.parametrize("config", [
    None,  # no tokenizer_config.json
    {"model_max_length": 4096},  # names no class
    {"tokenizer_class": "NoSuchTokenizerClass"},  # a class this transformers lacks
    {"tokenizer_class": "PretrainedConfig"},  # a transformers class, not a tokenizer
    {"tokenizer_class": "TokenizersBackend", "auto_map": {"AutoTokenizer": ["x.Tok", None]}},
])
def test_what_names_no_usable_class_goes_through_auto_tokenizer(
        tmp_path: Path, config: dict[str, Any] | None) -> None:
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert tokenizer_class.named_class(str(tmp_path)) is None
    assert tokenizer_class.lean_class(str(tmp_path)) is None


def test_a_named_tokenizer_class_is_found(tmp_path: Path) -> None:
    """Control for the cases above: a config naming a tokenizer class gives that class."""
    from transformers import TokenizersBackend

    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": "TokenizersBackend"}))
    assert tokenizer_class.named_class(str(tmp_path)) is TokenizersBackend
