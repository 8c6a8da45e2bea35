"""Build the tiny offline model: a random-weight Llama plus a byte-level BPE tokenizer.

Nothing is downloaded. The weights are drawn from our own seeded generator (not the library's
init code, which changes between transformers releases) and the tokenizer is trained on a
corpus generated from a fixed seed, so every machine builds the same model. Outputs are
gibberish but deterministic, which is what equality tests between serving paths need.

The model is served in float32 (:data:`SERVE_DTYPE`): a random model's logits have near-ties,
and bf16 rounding differs between vLLM's kernels for a whole prefill and for a decode step over
cached KV, so a bf16 P/D path and a plain server could pick different greedy tokens from the
same, correctly transferred KV. In float32 those differences stay far below any logit gap.
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

TINY_MODEL_VERSION = 2
SERVE_DTYPE = "float32"
MARKER = "pdserve-tiny.json"
VOCAB_SIZE = 2048
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}</s>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>"]


def default_cache_dir() -> Path:
    """Where built models are cached: $PDSERVE_CACHE or ~/.cache/pdserve."""
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(Path.home(), ".cache", "pdserve")
    return Path(root) / "models"


def default_tiny_model_dir() -> Path:
    """The cached location of the tiny model used by `pdserve up` and the tests."""
    return default_cache_dir() / f"tiny-llama-v{TINY_MODEL_VERSION}"


def _corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English text: words from syllables, sentences with punctuation."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w",
              "st", "tr", "pr", "gr", "ch", "sh", "th"]
    vowels = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "io"]
    codas = ["", "n", "r", "s", "t", "l", "m", "nd", "st", "ng"]
    words = sorted({rng.choice(onsets) + rng.choice(vowels) + rng.choice(codas)
                    + (rng.choice(vowels) + rng.choice(codas) if rng.random() < 0.5 else "")
                    for _ in range(3000)})
    lines = []
    for _ in range(num_lines):
        n = rng.randint(4, 18)
        sentence = " ".join(rng.choice(words) for _ in range(n))
        lines.append(sentence.capitalize() + rng.choice([".", ".", "?", "!", ",", ":"]))
        if rng.random() < 0.1:
            lines.append(" ".join(str(rng.randint(0, 9999)) for _ in range(rng.randint(1, 6))))
    return lines


def _build_tokenizer(out_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 4096
    fast.save_pretrained(out_dir)
    return len(fast)


def is_tiny_model(model: str | os.PathLike[str]) -> bool:
    """Whether ``model`` is a directory this module built."""
    return (Path(model) / MARKER).is_file()


def _build_weights(out_dir: Path, vocab_size: int, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=3,
        tie_word_embeddings=False,
        torch_dtype="float32",  # type: ignore[call-arg]  # kept as config metadata
    )
    model = LlamaForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    # Larger-than-default init spreads the logits, so greedy decoding is stable rather than
    # a coin toss between near-equal tokens: equality tests then compare real computation.
    with torch.no_grad():
        for _, param in sorted(model.named_parameters()):
            if param.dim() > 1:
                param.copy_(torch.randn(param.shape, generator=gen, dtype=torch.float32) * 0.08)
            else:
                param.fill_(1.0)  # RMSNorm scales
    model = model.to(torch.float32)  # type: ignore[arg-type]
    model.save_pretrained(out_dir, safe_serialization=True)


def build_tiny_model(out_dir: str | os.PathLike[str] | None = None, *, seed: int = 0,
                     force: bool = False) -> Path:
    """Write the tiny Llama + tokenizer to ``out_dir`` (default: the cache) and return the path.

    Cached: an existing complete build is reused unless ``force``. The build goes to a temporary
    sibling directory first and is renamed into place, so concurrent builders never see half a
    model.
    """
    target = Path(out_dir) if out_dir is not None else default_tiny_model_dir()
    marker = target / MARKER
    if marker.exists() and not force:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        vocab = _build_tokenizer(tmp)
        _build_weights(tmp, vocab, seed)
        (tmp / MARKER).write_text(json.dumps({"version": TINY_MODEL_VERSION,
                                                          "seed": seed, "vocab_size": vocab}))
        # readable by every user, as a model is (mkdtemp makes 0700, the weights' writer 0600):
        # an image's unprivileged user serves the model root built
        tmp.chmod(0o755)
        for path in tmp.iterdir():
            path.chmod(0o644)
        if target.exists():
            shutil.rmtree(target)
        try:
            tmp.rename(target)
        except OSError:
            if not marker.exists():  # lost a race to another builder only if it finished
                raise
        logger.info("built tiny model at %s", target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
