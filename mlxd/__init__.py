"""mlxd: an OpenAI- and Anthropic-compatible inference server on MLX."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

DEFAULT_MODEL_DIR = Path(__file__).parent / "models" / "tinycoder-16m"
DEFAULT_MODEL_NAME = "tinycoder-16m"
