"""Shared fixtures. Importing `engine` first loads the optimised BLAS before MLX."""

from __future__ import annotations

import os

# MLX-CUDA multiplies float32 matrices in TF32 (10-bit mantissas) unless told otherwise; the
# exact tier compares float32 forwards of different widths, so the GPU runs of this suite use
# full float32 (no effect on a CPU or on 16-bit models).
os.environ.setdefault("MLX_ENABLE_TF32", "0")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import engine  # noqa: E402, F401  (loads OpenBLAS before mlx on Linux)
from mlxd import DEFAULT_MODEL_DIR  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHARED = REPO.parent / "shared"


@pytest.fixture(scope="session")
def tinycoder_path() -> Path:
    return DEFAULT_MODEL_DIR


@pytest.fixture(scope="session")
def draft_model_path() -> Path:
    path = SHARED / "models" / "tinycoder-draft-4m"
    if not path.exists():
        pytest.skip("../shared/models/tinycoder-draft-4m is not present")
    return path


@pytest.fixture(scope="session")
def dev_data_path() -> Path:
    path = SHARED / "data" / "tinycoder-dev.jsonl"
    if not path.exists():
        pytest.skip("../shared/data/tinycoder-dev.jsonl is not present")
    return path


@pytest.fixture(scope="module")
def fake():
    """A scripted engine (tests/fake_engine.py), one per test module; modules reset it."""
    from tests.fake_engine import FakeEngine

    return FakeEngine()


@pytest.fixture(scope="module")
def server(fake):
    """uvicorn serving `fake` with the default config on a free loopback port."""
    from server.app import create_app
    from server.config import ServerConfig
    from tests.fake_engine import ServerThread

    with ServerThread(create_app(fake, ServerConfig())) as srv:
        yield srv


@pytest.fixture(scope="session")
def real_engine():
    """The real engine on the bundled model (float32 on CPU), started once per session."""
    from mlxd.runtime import build_client

    client = build_client(model=None)
    client.start()
    yield client
    client.stop()


@pytest.fixture(scope="session")
def real_server(real_engine):
    """uvicorn serving the real engine on a free loopback port."""
    from server.app import create_app
    from server.config import ServerConfig
    from tests.fake_engine import ServerThread

    with ServerThread(create_app(real_engine, ServerConfig())) as srv:
        yield srv
