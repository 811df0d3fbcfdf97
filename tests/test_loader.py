"""Model resolution and loading: bundled default, local dirs, and a Hugging Face cache offline."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine.loader import pick_dtype, resolve_model_path
from kernels import device as blas
from mlxd import DEFAULT_MODEL_DIR, model_source

REPO = Path(__file__).resolve().parent.parent


def test_default_is_bundled_model():
    for no_model in (None, "", "default", "tinycoder-16m"):
        assert model_source(no_model) == str(DEFAULT_MODEL_DIR)
    assert model_source("org/repo") == "org/repo"
    path, model_id = resolve_model_path(model_source(None))
    assert path == DEFAULT_MODEL_DIR.resolve() and model_id == "tinycoder-16m"
    assert (path / "config.json").is_file()


def test_local_directory(tmp_path):
    path, model_id = resolve_model_path(str(DEFAULT_MODEL_DIR))
    assert path == DEFAULT_MODEL_DIR.resolve() and model_id == "tinycoder-16m"
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError):
        resolve_model_path("not/a/repo/id")


def _lay_out_hf_cache(cache: Path, repo_id: str) -> Path:
    """The standard hub cache layout: models--org--name/{refs/main, snapshots/<rev>/...}."""
    rev = "0123456789abcdef0123456789abcdef01234567"
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snap = root / "snapshots" / rev
    snap.mkdir(parents=True)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(rev)
    for f in DEFAULT_MODEL_DIR.iterdir():
        if f.is_file():
            (snap / f.name).symlink_to(f)
    return snap


def test_hf_repo_id_from_local_cache_offline(tmp_path):
    snap = _lay_out_hf_cache(tmp_path / "hub", "someorg/tiny-coder")
    code = (
        "import json, engine; from engine.loader import load_model;"
        "lm = load_model('someorg/tiny-coder');"
        "ids = lm.tokenizer.encode('def f(x):');"
        "print(json.dumps({'path': str(lm.path), 'id': lm.model_id, 'n': len(ids), 'ctx': lm.context_length}))"
    )
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1",
               PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(got["path"]) == snap and got["id"] == "someorg/tiny-coder"
    assert got["n"] > 0 and got["ctx"] == 4096


def test_hf_repo_missing_offline_fails_cleanly(tmp_path):
    code = "import engine; from engine.loader import load_model; load_model('someorg/absent')"
    env = dict(os.environ, HF_HUB_CACHE=str(tmp_path / "hub"), HF_HUB_OFFLINE="1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "offline" in out.stderr.lower() or "not found" in out.stderr.lower() or "cache" in out.stderr.lower()


def test_cpu_dtype_is_float32():
    import mlx.core as mx

    assert pick_dtype("auto", mx.Device(mx.cpu)) == mx.float32
    assert pick_dtype("bfloat16") == mx.bfloat16
    with pytest.raises(ValueError):
        pick_dtype("int3")


def test_blas_loaded_before_mlx_on_linux():
    info = blas.info()
    if sys.platform != "linux":
        assert info.path is None
        return
    if info.path is None:
        pytest.skip(f"no optimised BLAS here: {info.reason}")
    assert info.loaded_before_mlx and info.reason == "loaded"


def test_mlx_imported_first_is_warned_about():
    """A script that imports mlx before mlxd's modules keeps MLX's reference BLAS (the library
    loaded afterwards has no effect): it is told so, not left ~30x slower in silence."""
    if sys.platform != "linux" or blas.info().path is None:
        pytest.skip("no optimised BLAS to load here")
    code = ("import warnings; warnings.simplefilter('always'); import mlx.core; "
            "from kernels import device; i = device.load(); print(i.reason)")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("MLXD_BLAS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "loaded after mlx was imported: no effect"
    assert "RuntimeWarning: mlx was imported before mlxd" in out.stderr
    first = subprocess.run([sys.executable, "-c", code.replace("import mlx.core; ", "")], env=env,
                           capture_output=True, text=True, timeout=60)
    assert first.stdout.strip() == "loaded" and "RuntimeWarning" not in first.stderr


def test_blas_override_none_in_subprocess():
    code = "from kernels import device as blas; import json; i = blas.load(); print(json.dumps([i.path, i.reason]))"
    env = dict(os.environ, MLXD_BLAS="none", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    path, reason = json.loads(out.stdout)
    assert path is None and "disabled" in reason
