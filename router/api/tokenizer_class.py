"""Which class loads a model's tokenizer in the router, without importing torch.

``AutoTokenizer``'s module imports torch and triton (``transformers.configuration_utils`` pulls
in the generation code): in the router, which only tokenizes, that was 5-6 s of CPU, about
330 MiB and 280,000 objects. The class a model's ``tokenizer_config.json`` names
(``tokenizer_class``) can be had from the ``transformers`` package alone, which imports that
class's module only. But ``AutoTokenizer`` does not always load the named class: transformers 5
overrides it for dozens of model types whose hub configs name the wrong one, for some hub ids,
for Mistral's formats and where the model type's own class is the generic backend. The router
must tokenize as vLLM does, and vLLM loads through ``AutoTokenizer``. So the named class is used
only when ``AutoTokenizer`` picks the same class for the same files, asked once in a child
process (which imports torch and exits) and remembered on disk, keyed by the files' contents and
the ``transformers`` version: a router start after the first asks nobody.

The answers live in ``$PDSERVE_CACHE/tokenizer-classes`` (default ``~/.cache/pdserve``); a
directory that cannot be written only costs the child process again next start.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

ASK_TIMEOUT_S = 300.0
"""Longest the child process that asks ``AutoTokenizer`` may take (it imports torch)."""
_ASK = """
import sys
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1], local_files_only=sys.argv[2] == "1")
print(type(tok).__module__ + "." + type(tok).__qualname__)
"""


def lean_class(model_path: str) -> Any | None:
    """The tokenizer class to load ``model_path`` with, imported without torch, when it is the
    one ``AutoTokenizer`` would load; None when it is not, or cannot be told (then load through
    ``AutoTokenizer``)."""
    cls = named_class(model_path)
    if cls is None:
        return None
    if auto_class_name(model_path) != _qualified(cls):
        return None
    return cls


def named_class(model_path: str) -> Any | None:
    """The tokenizer class ``model_path``'s ``tokenizer_config.json`` names, or None when it
    names none, asks for remote code (``auto_map``) or names one this ``transformers`` lacks."""
    found = _read_json(_model_file(model_path, "tokenizer_config.json"))
    name = found.get("tokenizer_class") if isinstance(found, dict) else None
    if not isinstance(name, str) or not name.isidentifier() or "auto_map" in found:
        return None
    try:
        import transformers
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase

        cls = getattr(transformers, name, None)
    except Exception as exc:  # a class whose module needs a missing optional package
        logger.debug("tokenizer class %s not importable (%s)", name, exc)
        return None
    if isinstance(cls, type) and issubclass(cls, PreTrainedTokenizerBase):
        return cls
    return None


def auto_class_name(model_path: str) -> str | None:
    """``module.qualname`` of the class ``AutoTokenizer`` loads ``model_path`` with, from the
    disk cache or else asked of a child process; None when that fails."""
    entry = _cache_entry(model_path)
    if entry is not None:
        try:
            return entry.read_text().strip() or None
        except OSError:
            pass
    local_only = "1" if os.path.isdir(model_path) else "0"
    try:
        done = subprocess.run([sys.executable, "-c", _ASK, model_path, local_only],
                              capture_output=True, text=True, timeout=ASK_TIMEOUT_S,
                              check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("cannot ask AutoTokenizer which class loads %s (%s): loading through it",
                       model_path, exc)
        return None
    lines = done.stdout.strip().splitlines()
    answer = lines[-1] if lines else ""
    if entry is not None and answer:
        try:
            entry.parent.mkdir(parents=True, exist_ok=True)
            scratch = entry.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(answer)
            os.replace(scratch, entry)
        except OSError as exc:
            logger.debug("cannot remember the tokenizer class in %s: %s", entry, exc)
    return answer or None


def cache_dir() -> Path:
    """``$PDSERVE_CACHE/tokenizer-classes``, default ``~/.cache/pdserve/tokenizer-classes``."""
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(Path.home(), ".cache", "pdserve")
    return Path(root) / "tokenizer-classes"


def _cache_entry(model_path: str) -> Path | None:
    """The cache file of ``model_path``'s answer: named by a hash of the transformers version
    and of every file ``AutoTokenizer`` decides by (None when they cannot be read)."""
    import transformers

    digest = hashlib.sha256(transformers.__version__.encode())
    for name in ("tokenizer_config.json", "config.json", "params.json", "tekken.json"):
        path = _model_file(model_path, name)
        digest.update(b"\x00" + name.encode() + b"\x00")
        if path is None:
            continue
        try:
            digest.update(Path(path).read_bytes())
        except OSError:
            return None
    # a hub id can be matched by name (transformers' list of hub ids it loads its own way)
    digest.update(b"\x00" + (b"" if os.path.isdir(model_path) else model_path.encode()))
    return cache_dir() / digest.hexdigest()


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _read_json(path: str | None) -> Any:
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _model_file(model_path: str, name: str) -> str | None:
    """``name`` in a model directory, or in the local HF cache of a hub id; None if absent."""
    if os.path.isdir(model_path):
        path = os.path.join(model_path, name)
        return path if os.path.isfile(path) else None
    try:
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(model_path, name)
    except Exception:  # not a valid repo id
        return None
    return cached if isinstance(cached, str) else None
