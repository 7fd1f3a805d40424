"""Sliding-window attention as a checkpoint declares it (HF config.json or GGUF metadata), read per layer, and the
start-up refusal of a window that can bind: radixserve has no windowed attention (docs/runner.md)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_DEFAULT_WINDOW, _DEFAULT_MAX_WINDOW_LAYERS = 4096, 28   # transformers 5.25's config classes', for an omitted key
# config class (model_type) -> how its modeling code places the window; `architectures[0]` when model_type is absent
_RULES = {"mistral": "every", "qwen3_moe": "every_if_used", "qwen2": "layer_types", "qwen3": "layer_types"}
_ARCH_TYPES = {"MistralForCausalLM": "mistral", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3",
               "Qwen3MoeForCausalLM": "qwen3_moe"}
_LEGACY_TYPES = {"attention": "full_attention"}   # transformers' remap_legacy_layer_types, the entry that applies
# config classes of our other families, whose modeling code has no window (a `sliding_window` key there is ignored)
_WINDOWLESS = {"llama", "glm", "glm4", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "deepseek_v32"}


@dataclass(frozen=True)
class SlidingWindow:
    """`size` tokens on `layers` (sorted layer indices): a query at position q attends to positions
    (q - size, q] only (transformers' `sliding_window_overlay`); `source`: the config keys that set it."""

    size: int
    layers: tuple[int, ...]
    source: str

    def can_bind(self, context_len: int) -> bool:
        """True when a sequence of `context_len` tokens outgrows the window (size < context_len)."""
        return self.size < context_len


def window_from_hf(cfg: dict[str, Any], num_layers: int) -> SlidingWindow | None:
    """The window of a config.json dict as transformers 5.25 applies it (None: full attention everywhere). Mistral:
    `sliding_window` on every layer, `layer_types` ignored; Qwen3-MoE: on every layer if `use_sliding_window`; Qwen2 /
    Qwen3: if `use_sliding_window`, on the "sliding_attention" entries of `layer_types`, else from `max_window_layers`
    on; Llama, GLM, DeepSeek: none. ValueError for another model_type with a `sliding_window` (transformers picks the
    config class, e.g. Ministral's, by model_type, not `architectures`), `layer_types` of another length or kind,
    "sliding_attention" layers without a window size (transformers cannot build their mask either), or
    `max_window_layers` not an int under a window."""
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        model_type = _ARCH_TYPES.get(str((cfg.get("architectures") or [""])[0]), "")
    rule = _RULES.get(model_type)
    if rule is None:
        if model_type and model_type not in _WINDOWLESS and cfg.get("sliding_window") is not None:
            raise ValueError(f"config.json model_type {model_type!r} with sliding_window {cfg['sliding_window']!r}: "
                             "radixserve does not know which layers its config class windows")
        return None
    size = cfg.get("sliding_window", _DEFAULT_WINDOW)
    if rule == "every":
        return _window(size, range(num_layers), "config.json sliding_window; MistralForCausalLM: every layer")
    used = bool(cfg.get("use_sliding_window", False))
    if rule == "every_if_used":
        return _window(size if used else None, range(num_layers), "config.json sliding_window, use_sliding_window")
    size = size if used else None
    types = cfg.get("layer_types")
    if types is None:
        first = cfg.get("max_window_layers", _DEFAULT_MAX_WINDOW_LAYERS)
        if size is not None and (isinstance(first, bool) or not isinstance(first, int)):
            raise ValueError(f"config.json max_window_layers {first!r} is not a layer index")
        return _window(size, range(max(first, 0), num_layers),   # transformers: layer i slides if i >= it
                       "config.json sliding_window, use_sliding_window, max_window_layers")
    if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
        raise ValueError(f"config.json layer_types {types!r} is not a list of layer kinds")
    types = [_LEGACY_TYPES.get(t, t) for t in types]
    if len(types) != num_layers or not set(types) <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"config.json layer_types {types}: {model_type} takes {num_layers} entries, each "
                         "full_attention or sliding_attention")
    sliding = [i for i, t in enumerate(types) if t == "sliding_attention"]
    if sliding and size is None:
        raise ValueError(f"config.json layer_types marks {_layer_names(sliding)} sliding_attention, but "
                         "use_sliding_window is false or sliding_window null: no window size")
    return _window(size, sliding, "config.json sliding_window, use_sliding_window, layer_types")


def window_from_gguf(get: Callable[[str, Any], Any], arch: str, num_layers: int) -> SlidingWindow | None:
    """`<arch>.attention.sliding_window` (gguf's Keys.Attention.SLIDING_WINDOW) on the layers its
    `sliding_window_pattern` names: a list of bools per layer, or an int n as llama.cpp's `set_swa_pattern(n)` (layer
    i slides unless i % n == n - 1; n = 0: every layer); without a pattern, every layer; ValueError for a pattern of
    another type. `get(key, default)` reads `<arch>.<key>`."""
    size = get("attention.sliding_window", None)
    if size is None:
        return None
    pattern = get("attention.sliding_window_pattern", None)
    source = f"GGUF {arch}.attention.sliding_window"
    if pattern is None:
        return _window(size, range(num_layers), source)
    source += f", {arch}.attention.sliding_window_pattern"
    if isinstance(pattern, int) and pattern >= 0:
        return _window(size, [i for i in range(num_layers) if pattern == 0 or i % pattern < pattern - 1], source)
    if not isinstance(pattern, list):
        raise ValueError(f"{source}: sliding_window_pattern {pattern!r} is neither a layer count >= 0 nor a list")
    return _window(size, [i for i, on in enumerate(pattern[:num_layers]) if on], source)


def check_window(window: SlidingWindow | None, context_len: int) -> None:
    """ValueError naming the layers, the size and the keys when `window` can bind within `context_len` tokens (the
    engine's --context-length, else the model's max_position_embeddings); a window that cannot bind changes nothing."""
    if window is None:
        return
    if isinstance(context_len, bool) or not isinstance(context_len, int) or context_len < 1:
        raise ValueError(f"context length {context_len!r} (--context-length, else max_position_embeddings) is not a "
                         "positive token count")
    if not window.can_bind(context_len):
        return
    verb = "uses" if len(window.layers) == 1 else "use"
    raise ValueError(f"{_layer_names(window.layers)} {verb} a {window.size}-token sliding window ({window.source}), "
                     f"shorter than the {context_len}-token context (--context-length, else max_position_embeddings); "
                     f"radixserve has no windowed attention: serve a checkpoint without it, or --context-length "
                     f"{window.size} or less")


def _window(size: Any, layers: Any, source: str) -> SlidingWindow | None:
    layers = tuple(layers)
    if size is None or not layers:
        return None
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"{source}: sliding_window {size!r} is not a positive token count")
    return SlidingWindow(size, layers, source)


def _layer_names(layers: list[int] | tuple[int, ...]) -> str:
    """'layer 3', 'layers 0-3' or 'layers 1, 3, 5-7': runs of consecutive indices joined."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    text = ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)
    return f"layer {text}" if len(layers) == 1 else f"layers {text}"
