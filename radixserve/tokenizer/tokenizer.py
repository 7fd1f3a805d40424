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

from radixserve.errors import InvalidRequest
from radixserve.tokenizer.text_bound import TextBound

logger = logging.getLogger(__name__)

_META_FILE = "radixserve.json"
# Arguments of HF apply_chat_template that chat_template_kwargs must not reach: the ones this
# class sets, and those that would swap the template or change what comes back.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"})
# Probe text rendered as an assistant turn to find the token a template closes a turn with.
_TURN_PROBE = "radixserve-turn-probe-7f3a"


def default_cache_dir() -> str:
    """Where converted GGUF tokenizers are cached: ~/.cache/radixserve/tokenizers."""
    return os.path.join(os.path.expanduser("~"), ".cache", "radixserve", "tokenizers")


class Tokenizer:
    """A transformers tokenizer plus what serving needs from it.

    Attributes:
        hf: the `transformers` tokenizer (fast backend).
        eos_token_ids: ids that end generation: the tokenizer's eos, eos ids from
            generation_config.json / config.json (HF directory) or eos/eot/eom from GGUF metadata,
            and the token the chat template closes an assistant turn with (`<|im_end|>` for SmolLM2).
        bos_token_id: the BOS id, or None when the tokenizer has none.
        special_token_ids: ids of special added tokens (those `skip_special_tokens` drops).
        byte_token_ids: SentencePiece byte tokens (`<0xE4>`) when the decoder has ByteFallback,
            else empty (byte-level BPE such as SmolLM2's needs no special handling).
        vocab_size: number of ids the tokenizer knows (base vocabulary + added tokens).
        loaded_from_cache: True when a GGUF tokenizer came from the on-disk cache.
        text_bound: the fewest tokens a text can take, from its bytes (text_bound.py), or None
            when this tokenizer has no sound bound.
    """

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
        # Exactly the ids the backend drops under skip_special_tokens: added tokens marked special.
        self.special_token_ids: frozenset[int] = frozenset(
            tid for tid, tok in hf.added_tokens_decoder.items() if tok.special)
        self.vocab_size: int = len(hf)
        self.byte_token_ids: frozenset[int] = _byte_fallback_ids(hf)
        self.loaded_from_cache = loaded_from_cache
        self.text_bound: TextBound | None = TextBound.of(hf)

    # ----------------------------------------------------------------------------------- loading
    @classmethod
    def load(cls, model_path: str, cache_dir: str | None = None) -> Tokenizer:
        """Load from an HF model directory or a `.gguf` file; never downloads.

        A GGUF vocabulary is converted by transformers (seconds), then saved under
        `cache_dir` (default `default_cache_dir()`) in a folder keyed by the file's path, size and
        mtime and the transformers version; later loads read that folder. The GGUF chat template
        (`tokenizer.chat_template`) and eos/eot ids travel with the cache.
        Raises FileNotFoundError when the path does not exist.
        """
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

    # ----------------------------------------------------------------------------------- encoding
    def encode(self, text: str) -> list[int]:
        """Token ids of a completions prompt, with special tokens added the way HF adds them.

        When the text already starts with the BOS token (pre-rendered chat template text) and the
        tokenizer adds BOS itself, the added one is dropped, so the ids hold exactly one BOS
        (field case C23).
        """
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
        """The chat template rendered as text (arguments as in apply_chat_template)."""
        return self._chat(messages, add_generation_prompt, False, tools, template_kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Prompt ids of a chat: exactly HF `apply_chat_template(..., tokenize=True)`.

        messages: OpenAI-style dicts with a non-empty string `role` and `content` that is a
        string, None, or a list of {"type": "text", "text": ...} parts (joined); every other
        field (tool_calls, tool_call_id, name, reasoning_content, ...) reaches the template.
        tools: the OpenAI `tools` list for templates that describe tools (None: no tools).
        template_kwargs: extra template variables (`chat_template_kwargs`, e.g.
        {"enable_thinking": false}); names HF's own arguments use are refused.
        The template emits its own special tokens; nothing more is added (one BOS, C23).
        Raises InvalidRequest for an empty list, malformed messages, a reserved template
        variable, a template error or a tokenizer without a chat template.
        """
        return self._chat(messages, add_generation_prompt, True, tools, template_kwargs)

    def _chat(self, messages: list[dict], add_generation_prompt: bool, tokenize: bool,
              tools: list[dict] | None, template_kwargs: Mapping[str, Any] | None) -> Any:
        if not self.hf.chat_template:
            raise InvalidRequest("this model has no chat template; use the completions API", param="messages")
        normalized = _normalize_messages(messages)
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
        except Exception as exc:  # jinja TemplateError, raise_exception() in templates, TypeError, ...
            raise InvalidRequest(f"messages could not be rendered by the chat template: {exc}",
                                 param="messages") from exc
        return list(out) if tokenize else out

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of `ids`, verbatim (no tokenization-space clean-up, so streaming can match it)."""
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens,
                              clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------------------- helpers
def _normalize_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise InvalidRequest("messages must be a non-empty list", param="messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping):
            raise InvalidRequest(f"messages[{i}] must be an object", param="messages")
        role = msg.get("role")
        if not isinstance(role, str) or not role:
            raise InvalidRequest(f"messages[{i}].role must be a non-empty string", param="messages")
        content = msg.get("content")
        if isinstance(content, (list, tuple)):
            parts = []
            for part in content:
                if not (isinstance(part, Mapping) and part.get("type") == "text"
                        and isinstance(part.get("text"), str)):
                    raise InvalidRequest(f"messages[{i}].content: only text parts are supported",
                                         param="messages")
                parts.append(part["text"])
            content = "".join(parts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise InvalidRequest(f"messages[{i}].content must be a string or a list of text parts",
                                 param="messages")
        out.append({**msg, "content": content})
    return out


def _template_turn_end_id(hf: Any) -> int | None:
    """The special token the chat template writes right after an assistant message, if any."""
    if not hf.chat_template:
        return None
    convo = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _TURN_PROBE}]
    try:
        text = hf.apply_chat_template(convo, tokenize=False, add_generation_prompt=False)
    except Exception as exc:  # a template may insist on other shapes; eos alone then
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
    """Ids of `<0xNN>` tokens when the fast tokenizer's decoder includes ByteFallback."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or backend.decoder is None or "ByteFallback" not in repr(backend.decoder):
        return frozenset()
    return frozenset(tid for token, tid in hf.get_vocab().items()
                     if len(token) == 6 and token.startswith("<0x") and token.endswith(">"))


def _hf_dir_eos_ids(model_dir: str) -> list[int]:
    """eos ids from generation_config.json and config.json (int or list) in an HF directory."""
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
    """eos/eot/eom ids and the chat template from GGUF metadata."""
    from radixserve.weights.gguf_header import read_scalars

    id_keys = [f"tokenizer.ggml.{k}_token_id" for k in ("eos", "eot", "eom")]
    keys = [*id_keys, "tokenizer.chat_template"]
    try:
        values = read_scalars(path, keys)
    except ValueError:   # big-endian or v1 files: gguf's full reader handles those (slowly)
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


# tokenizer_config.json classes that are exactly transformers' generic `tokenizers` backend.
_GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def _from_folder(folder: str) -> Any:
    """The HF tokenizer saved in `folder`. A folder whose tokenizer_config.json names the generic
    `tokenizers` backend (every converted GGUF vocabulary, SmolLM2) loads through that class
    directly: `AutoTokenizer` imports transformers' config machinery and with it torch, seconds
    of start-up in the HTTP process, which needs no torch. Any other class goes through
    `AutoTokenizer`, which picks the model family's own tokenizer class."""
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
            shutil.rmtree(target, ignore_errors=True)  # an unusable leftover; replace it
        os.replace(tmp, target)
    except OSError as exc:  # another process won the race, or the disk is full
        logger.warning("tokenizer cache write to %s skipped: %s", target, exc)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
