"""The tiny model is built readable by every user: an image's unprivileged user (Compose's
router and workers run as uid 10001) serves the model its root build wrote."""

from __future__ import annotations

import stat
from pathlib import Path

from serve.tiny_model import build_tiny_model


def test_the_tiny_model_is_readable_by_every_user(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "tiny")
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in model.iterdir()}
    assert "model.safetensors" in modes and "tokenizer.json" in modes
    assert stat.S_IMODE(model.stat().st_mode) & 0o005 == 0o005  # others may list and enter
    unreadable = {name for name, mode in modes.items() if not mode & stat.S_IROTH}
    assert not unreadable, modes
