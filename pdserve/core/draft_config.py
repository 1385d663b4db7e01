"""A trained drafter's checkpoint config, readable without torch.

Owns what a drafter's `config.json` holds (`DraftConfig`), the checkpoint's file names and
format version, and reading the config (`read_draft_config`, `read_draft_kind`), so that
`pdserve serve --draft PATH` checks a drafter before any process starts without importing torch.
Must not load weights or build the network (`pdserve.engine.spec.draft_model` does).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

KINDS = ("eagle", "dflash", "dspark")
FORMAT_VERSION = 1
WEIGHTS_FILE = "draft.safetensors"
CONFIG_FILE = "config.json"


@dataclass
class DraftConfig:
    """What `config.json` holds: the architecture, and what training measured (`stats`)."""

    kind: str
    target_name: str
    hidden_size: int
    num_heads: int
    head_dim: int
    intermediate_size: int
    window: int = 32
    gamma: int = 4
    draft_vocab_size: int = 8192
    markov_rank: int = 64
    format_version: int = FORMAT_VERSION
    stats: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"draft kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.window <= 0 or self.gamma <= 0 or self.draft_vocab_size <= 0:
            raise ValueError("window, gamma and draft_vocab_size must be positive")


def read_draft_kind(path: str) -> str:
    """The kind ("eagle", "dflash", "dspark") of the drafter saved at `path`."""
    return read_draft_config(path).kind


def read_draft_config(path: str) -> DraftConfig:
    cfg_path = os.path.join(path, CONFIG_FILE)
    if not os.path.isfile(cfg_path) or not os.path.isfile(os.path.join(path, WEIGHTS_FILE)):
        raise ValueError(f"{path!r} is not a drafter checkpoint ({CONFIG_FILE} + {WEIGHTS_FILE})")
    with open(cfg_path) as f:
        raw = json.load(f)
    if raw.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: drafter format_version {raw.get('format_version')!r}, "
                         f"this pdserve reads {FORMAT_VERSION}")
    return DraftConfig(**raw)
