"""The target model: config, lean decoder, loaders and the default checkpoint."""

from lyanna.model.config import ModelConfig, UnsupportedModelError
from lyanna.model.default import DEFAULT_MODEL, default_model_dir, fetch_default_model
from lyanna.model.loader import CheckpointError, build_model, load_model, read_gguf, read_hf_dir
from lyanna.model.transformer import Transformer

__all__ = [
    "DEFAULT_MODEL",
    "CheckpointError",
    "ModelConfig",
    "Transformer",
    "UnsupportedModelError",
    "build_model",
    "default_model_dir",
    "fetch_default_model",
    "load_default_model",
    "load_model",
    "read_gguf",
    "read_hf_dir",
]


def load_default_model(**kwargs) -> Transformer:
    """The default model (fetched and converted on first use)."""
    return load_model(fetch_default_model(), **kwargs)
