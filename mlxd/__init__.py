"""mlxd: an OpenAI- and Anthropic-compatible inference server on MLX."""

from __future__ import annotations

from pathlib import Path

__version__ = "0.1.0"

DEFAULT_MODEL_DIR = Path(__file__).parent / "models" / "tinycoder-16m"
DEFAULT_MODEL_NAME = "tinycoder-16m"


def model_source(model: str | None) -> str:
    """What `--model` names for the loader: no model (or the bundled model's name) is the bundled
    model's directory; anything else passes through (a directory or a Hugging Face repo id)."""
    if model is None or model in ("", "default", DEFAULT_MODEL_NAME):
        return str(DEFAULT_MODEL_DIR)
    return model
