"""Tokenizer: HF tokenizer loading (directory or GGUF, with an on-disk cache), chat template, eos ids."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Mapping, Sequence
from typing import Any

from radixserve.config import cache_root
from radixserve.errors import InvalidRequest
from radixserve.tokenizer.messages import normalize_messages
from radixserve.tokenizer.text_bound import TextBound

logger = logging.getLogger(__name__)

_META_FILE = "radixserve.json"
# apply_chat_template arguments chat_template_kwargs may not set (ours, or ones changing the output).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
_TURN_PROBE = "radixserve-turn-probe-7f3a"


def default_cache_dir() -> str:
    return str(cache_root() / "tokenizers")


class Tokenizer:
    """A transformers tokenizer plus serving's needs. eos_token_ids: the tokenizer's, config's or GGUF's eos/eot/eom and
    the template's assistant-turn end; byte_token_ids: `<0xNN>` tokens with ByteFallback, else empty."""

    def __init__(self, hf: Any, eos_token_ids: Sequence[int] = (), loaded_from_cache: bool = False):
        self.hf = hf
        eos = set(eos_token_ids)
        if hf.eos_token_id is not None:
            eos.add(int(hf.eos_token_id))
        turn_end = _template_turn_end_id(hf)
        if turn_end is not None:
            eos.add(turn_end)
        self.eos_token_ids: frozenset[int] = frozenset(eos)
        self.bos_token_id: int | None = hf.bos_token_id
        self.special_token_ids: frozenset[int] = frozenset(
            tid for tid, tok in hf.added_tokens_decoder.items() if tok.special)
        self.vocab_size: int = len(hf)
        self.byte_token_ids: frozenset[int] = _byte_fallback_ids(hf)
        self.loaded_from_cache = loaded_from_cache
        self.text_bound: TextBound | None = TextBound.of(hf)

    @classmethod
    def load(cls, model_path: str, cache_dir: str | None = None) -> Tokenizer:
        """Load from an HF directory or a `.gguf` file (never downloads); a converted GGUF vocabulary is
        cached under `cache_dir`, keyed by path, size, mtime and transformers version. FileNotFoundError."""
        if os.path.isdir(model_path):
            return cls(_from_folder(model_path), _hf_dir_eos_ids(model_path))
        if not os.path.isfile(model_path):
            raise FileNotFoundError(f"no tokenizer at {model_path!r} (need an HF directory or a .gguf file)")
        return cls._load_gguf(model_path, cache_dir or default_cache_dir())

    @classmethod
    def _load_gguf(cls, path: str, cache_root: str) -> Tokenizer:
        cached = os.path.join(cache_root, _cache_key(path))
        meta_path = os.path.join(cached, _META_FILE)
        if os.path.isfile(meta_path):
            try:
                with open(meta_path) as f:
                    meta = json.load(f)
                return cls(_from_folder(cached), meta["eos_token_ids"], loaded_from_cache=True)
            except (OSError, ValueError, KeyError) as exc:
                logger.warning("tokenizer cache %s unreadable (%s); converting again", cached, exc)
        path = os.path.abspath(path)
        logger.info("first run: converting the GGUF vocabulary to a tokenizer, cached for next "
                    "time in %s", cached)
        from transformers import AutoTokenizer
        hf = AutoTokenizer.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                           local_files_only=True)
        meta = _gguf_tokenizer_meta(path)
        if not hf.chat_template and meta["chat_template"]:
            hf.chat_template = meta["chat_template"]
        _save_to_cache(hf, {"eos_token_ids": meta["eos_token_ids"], "source": path}, cached)
        return cls(hf, meta["eos_token_ids"])

    def encode(self, text: str) -> list[int]:
        """Prompt ids with HF's special tokens; a text already starting with BOS keeps exactly one BOS."""
        ids = self.hf.encode(text, add_special_tokens=True)
        bos = self.bos_token_id
        if (bos is not None and len(ids) >= 2 and ids[0] == bos and ids[1] == bos
                and text.startswith(self.hf.bos_token)
                and not text[len(self.hf.bos_token):].startswith(self.hf.bos_token)):
            ids = ids[1:]
        return ids

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        return self._chat(messages, add_generation_prompt, False, tools, template_kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Exactly HF `apply_chat_template(..., tokenize=True)` over normalize_messages(messages), template_kwargs as
        template variables. Raises InvalidRequest for malformed messages, a reserved variable or a template error."""
        return self._chat(messages, add_generation_prompt, True, tools, template_kwargs)

    def _chat(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool,
              tools: list[dict] | None, template_kwargs: Mapping[str, Any] | None) -> Any:
        if not self.hf.chat_template:
            raise InvalidRequest("this model has no chat template; use the completions API", param="messages")
        normalized = normalize_messages(messages)
        extra = dict(template_kwargs or {})
        reserved = sorted(set(extra) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise InvalidRequest(f"chat_template_kwargs may not set {reserved[0]!r}",
                                 param="chat_template_kwargs")
        try:
            out = self.hf.apply_chat_template(normalized, tools=tools or None,
                                              add_generation_prompt=add_generation_prompt,
                                              tokenize=tokenize, return_dict=False, **extra)
        except InvalidRequest:
            raise
        except Exception as exc:
            raise InvalidRequest(f"messages could not be rendered by the chat template: {exc}",
                                 param="messages") from exc
        return list(out) if tokenize else out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, verbatim (no clean-up of tokenization spaces)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)


def _template_turn_end_id(hf: Any) -> int | None:
    """The special token the chat template writes right after an assistant message, if any."""
    if not hf.chat_template:
        return None
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _TURN_PROBE}]
    try:
        text = hf.apply_chat_template(convo, tokenize=False, add_generation_prompt=False)
    except Exception as exc:
        logger.debug("chat template probe failed: %s", exc)
        return None
    at = text.find(_TURN_PROBE)
    if at < 0:
        return None
    rest = text[at + len(_TURN_PROBE):]
    specials = [tok.content for tok in hf.added_tokens_decoder.values() if tok.special]
    matches = [s for s in specials if s and rest.startswith(s)]
    if not matches:
        return None
    return int(hf.convert_tokens_to_ids(max(matches, key=len)))


def _byte_fallback_ids(hf: Any) -> frozenset[int]:
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or backend.decoder is None or "ByteFallback" not in repr(backend.decoder):
        return frozenset()
    return frozenset(tid for token, tid in hf.get_vocab().items()
                     if len(token) == 6 and token.startswith("<0x") and token.endswith(">"))


def _hf_dir_eos_ids(model_dir: str) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        path = os.path.join(model_dir, name)
        if not os.path.isfile(path):
            continue
        try:
            with open(path) as f:
                value = json.load(f).get("eos_token_id")
        except (OSError, ValueError) as exc:
            logger.warning("cannot read %s: %s", path, exc)
            continue
        ids.extend(v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int))
    return ids


def _gguf_tokenizer_meta(path: str) -> dict:
    from radixserve.weights.gguf_header import read_scalars

    id_keys = [f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom")]
    keys = [*id_keys, "tokenizer.chat_template"]
    try:
        values = read_scalars(path, keys)
    except ValueError:
        from gguf import GGUFReader
        fields = GGUFReader(path).fields
        values = {k: fields[k].contents() for k in keys if k in fields}
    eos = [int(v) for k in id_keys if isinstance(v := values.get(k), int) and not isinstance(v, bool)]
    template = values.get("tokenizer.chat_template")
    return {"eos_token_ids": eos, "chat_template": template if isinstance(template, str) else None}


def _cache_key(path: str) -> str:
    import transformers
    st = os.stat(path)
    raw = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    stem = os.path.splitext(os.path.basename(path))[0]
    return f"{stem}-{hashlib.sha256(raw.encode()).hexdigest()[:16]}"


_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _from_folder(folder: str) -> Any:
    """The HF tokenizer in `folder`, loaded by `tokenizers` directly (AutoTokenizer imports torch, unneeded by HTTP)."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json")) as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        tokenizer_class = None
    if tokenizer_class in _GENERIC_CLASSES and os.path.isfile(os.path.join(folder, "tokenizer.json")):
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
        return TokenizersBackend.from_pretrained(folder, local_files_only=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(folder, local_files_only=True)


def _save_to_cache(hf: Any, meta: dict, target: str) -> None:
    """Write the tokenizer to `target` atomically (temp folder + rename); failures only log."""
    root = os.path.dirname(target)
    try:
        os.makedirs(root, exist_ok=True)
        tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    except OSError as exc:
        logger.warning("cannot cache tokenizer under %s: %s", root, exc)
        return
    try:
        hf.save_pretrained(tmp)
        with open(os.path.join(tmp, _META_FILE), "w") as f:
            json.dump(meta, f)
        if os.path.isdir(target) and not os.path.isfile(os.path.join(target, _META_FILE)):
            shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    except OSError as exc:
        logger.warning("tokenizer cache write to %s skipped: %s", target, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
