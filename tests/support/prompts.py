"""Deterministic prompts of chosen token lengths for the tiny model."""

from __future__ import annotations

import random
from pathlib import Path

from transformers import AutoTokenizer

WORDS = [
    "river", "stone", "lantern", "copper", "meadow", "violet", "thunder", "orbit", "pepper",
    "glacier", "harbor", "sable", "crimson", "falcon", "willow", "ember", "quartz", "saffron",
    "tundra", "mosaic", "beacon", "cobalt", "juniper", "nectar", "obsidian", "prairie", "raven",
    "sierra", "tangent", "umber", "vertex", "walnut", "zephyr",
]


def prompt_of_tokens(tokenizer, target: int, rng: random.Random) -> str:  # noqa: ANN001
    """A text whose token count is ``target`` or slightly above (words are never cut)."""
    if target <= 1:
        return "A"
    words: list[str] = []
    while True:
        words.append(rng.choice(WORDS))
        text = " ".join(words)
        if len(tokenizer(text)["input_ids"]) >= target:
            return text


def make_prompts(model_dir: Path, lengths: list[int], seed: int, tag: str = "") -> list[str]:
    """One prompt per target length; ``tag`` makes a set unique (no prefix-cache reuse)."""
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    rng = random.Random(f"{seed}-{tag}")
    prompts = []
    for n in lengths:
        head = f"{tag} " if tag else ""
        prompts.append(head + prompt_of_tokens(tokenizer, max(1, n - len(head.split())), rng))
    return prompts
