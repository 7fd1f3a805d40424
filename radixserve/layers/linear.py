"""Linear layers (plain and fused QKV / gate-up) with CPU fast paths for skinny inputs.

M == 1 takes row_path.py's timed path, M > 1 a oneDNN-packed weight, quantized shards quant_linear.py (docs/runner.md)."""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from radixserve.layers import batch_invariant as bi
from radixserve.layers.quant_linear import MATMULS, Int8Weight, QuantWeight, kernel_available, native_bf16
from radixserve.layers.q8_fp32 import Q8Head
from radixserve.layers.screened_head import ScreenedHead

logger = logging.getLogger(__name__)
_UNPACKABLE: set[torch.dtype] = set()


class Linear(torch.nn.Module):
    """y = x @ weight.T (+ bias), weight (out, in). `shards`: name -> (first row, rows) of a fused weight, each loaded
    by `load(tensor, shard)`. Call `prepare()` once the final weights and dtype are in place."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 shards: dict[str, tuple[int, int]] | None = None):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = torch.nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = (torch.nn.Parameter(torch.zeros(out_features), requires_grad=False)
                     if bias else None)
        self.shards = shards or {}
        self._split: torch.Tensor | None = None
        self._row: str | None = None
        self._packed: torch.Tensor | None = None
        self._packed_dtype: torch.dtype | None = None
        self._quant_shards: dict[str | None, QuantWeight] = {}
        self._quant = None
        self._quant_max_rows = 0
        self._small_head: ScreenedHead | Q8Head | None = None   # an LM head's path for steps of few rows
        self._small_head_max_rows = 0
        self.tp_split = None   # layers/parallel.py TPSplit: the part of each checkpoint tensor this rank holds

    def local_part(self, tensor: torch.Tensor, shard: str | None = None, is_bias: bool = False) -> torch.Tensor:
        """The rows or columns of a full checkpoint tensor this rank holds (all of it without tensor parallelism)."""
        return tensor if self.tp_split is None else self.tp_split.local(tensor, shard, is_bias)

    def load(self, tensor: torch.Tensor | QuantWeight, shard: str | None = None, is_bias: bool = False) -> None:
        """Raises ValueError on a shape mismatch; a quantized weight is kept for `prepare()`."""
        target = self.bias if is_bias else self.weight
        assert target is not None, "checkpoint has a bias this layer was built without"
        if shard is not None:
            offset, size = self.shards[shard]
            target = target.narrow(0, offset, size)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs parameter "
                             f"{tuple(target.shape)} (shard {shard!r})")
        if isinstance(tensor, tuple(MATMULS)):
            self._quant_shards[shard] = tensor
        else:
            target.copy_(tensor)

    def weight_rows(self, index: torch.Tensor) -> torch.Tensor:
        """Rows `index` ((K,) int64) of the loaded weight, dequantized to float; before prepare(), unfused only."""
        q = self._quant_shards.get(None)
        return q.take_rows(index).dequantize() if q is not None else self.weight.data.index_select(0, index)

    def tie(self, weight: torch.nn.Parameter) -> None:
        assert tuple(weight.shape) == (self.out_features, self.in_features), "tied shapes differ"
        self.weight = weight

    def prepare(self, batch_invariant: bool = False, quantized_max_tokens: int = 0) -> None:
        """Build the fast paths (ValueError where `batch_invariant` cannot be met); a quantized layer runs up to
        `quantized_max_tokens` rows (0: all) on its kernel, more on a kept dequantized copy."""
        self._split, self._packed, self._packed_dtype, self._small_head = None, None, None, None
        self._row = None
        if self._quant_shards:
            if self._prepare_quant(batch_invariant, keep_float=quantized_max_tokens > 0):
                self._quant_max_rows = quantized_max_tokens
                if not quantized_max_tokens:
                    return
        w = self.weight.data
        if batch_invariant:
            self._packed, self._packed_dtype = bi.pack(w), w.dtype
            return
        if w.device.type != "cpu":
            return
        fp32_copy = getattr(self._quant, "FLOAT_COPY_DTYPE", None) == torch.float32
        if self._quant_max_rows and w.dtype == torch.float32 and not fp32_copy and native_bf16():
            self._pack(w.to(torch.bfloat16))
        else:
            splits = next((s for s in (4, 2) if self.out_features % s == 0), 0)
            if splits and w.dtype == torch.float32:
                self._split = w.view(splits, self.out_features // splits, self.in_features)
            self._pack(w)
        if self._quant_max_rows and self._packed is not None:
            self._split = None
            self.weight = torch.nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
        elif not self._quant_max_rows:
            self._row = "split" if self._split is not None else "packed" if self._packed is not None else "linear"

    def row_paths(self) -> tuple[str, ...]:
        """Single-row paths this layer can take (row_path.PATHS); () where M = 1 does not run on its float weight."""
        if self._row is None or self._small_head is not None:
            return ()
        return tuple(p for p, ok in (("split", self._split is not None), ("linear", True),
                                     ("packed", self._packed_dtype == self.weight.dtype)) if ok)

    @property
    def row_path(self) -> str | None:
        return self._row

    def use_row_path(self, path: str) -> None:
        assert path in self.row_paths(), f"{path!r} not among {self.row_paths()}"
        self._row = path

    def _pack(self, w: torch.Tensor) -> None:
        if not torch.backends.mkldnn.is_available():
            return
        try:
            self._packed = torch.ops.mkldnn._reorder_linear_weight(w, bi.PACK_BATCH_HINT)
            self._packed_dtype = w.dtype
        except (RuntimeError, AttributeError) as exc:
            if w.dtype not in _UNPACKABLE:
                _UNPACKABLE.add(w.dtype)
                logger.warning("oneDNN weight prepacking unavailable for %s (%s); using F.linear",
                               str(w.dtype).removeprefix("torch."), exc)

    @property
    def quantized(self) -> bool:
        return self._quant is not None

    @property
    def holds_quantized(self) -> bool:
        return self.quantized or bool(self._quant_shards)

    def enable_screened_head(self, max_rows: int, exact_top: int) -> bool:
        """Run up to `max_rows` rows on screened_head.py; False where it cannot (not an fp32 CPU weight, no int8 kernel)."""
        if not self._fp32_cpu_weight() or not kernel_available(Int8Weight):
            return False
        self._small_head, self._small_head_max_rows = ScreenedHead(self.weight.data, exact_top), max_rows
        return True

    def enable_q8_head(self, max_rows: int) -> bool:
        """Run <= `max_rows` rows on q8_fp32.py's kernel; False if no vector path or not an fp32 CPU Q8_0 grid."""
        head = Q8Head.build(self.weight.data) if self._fp32_cpu_weight() else None
        if head is None:
            return False
        self._small_head, self._small_head_max_rows = head, max_rows
        return True

    def _fp32_cpu_weight(self) -> bool:
        w = self.weight.data
        return w.device.type == "cpu" and w.dtype == torch.float32 and w.numel() > 0

    def _prepare_quant(self, batch_invariant: bool, keep_float: bool = False) -> bool:
        """Pack the quantized shards (dropping the float weight unless `keep_float`), else dequantize; whether it packed."""
        order = [None] if None in self._quant_shards else list(self.shards)
        kinds = {type(q) for q in self._quant_shards.values()}
        complete = all(s in self._quant_shards for s in order) and len(kinds) == 1
        w = self.weight.data
        matmul = MATMULS[next(iter(kinds))]
        invariant = not batch_invariant or getattr(matmul, "BATCH_INVARIANT", False)
        if complete and invariant and w.device.type == "cpu" and kernel_available(*kinds):
            try:
                self._quant = matmul([self._quant_shards[s] for s in order])
            except ValueError as exc:
                logger.warning("quantized layer %dx%d kept in float: %s", self.out_features, self.in_features, exc)
            else:
                if keep_float:
                    self._dequantize_into(w)
                else:
                    self.weight = torch.nn.Parameter(torch.empty(0, dtype=w.dtype), requires_grad=False)
                    self._quant_shards = {}
                return True
        self._dequantize_into(w)
        return False

    def _dequantize_into(self, w: torch.Tensor) -> None:
        for shard, q in self._quant_shards.items():
            rows = w if shard is None else w.narrow(0, *self.shards[shard])
            rows.copy_(q.dequantize())
        self._quant_shards = {}

    def forward(self, x: torch.Tensor, cast_back: bool = True) -> torch.Tensor:
        """x (M, in) -> (M, out) in x's dtype, or with `cast_back=False` in the dtype the path computed in."""
        if self._small_head is not None and x.shape[0] <= self._small_head_max_rows and x.dtype == torch.float32:
            return self._small_head(x, self.weight, self.bias)
        if self._quant is not None and (not self._quant_max_rows or x.shape[0] <= self._quant_max_rows):
            y = self._quant(x, cast_back)
            return y if self.bias is None else y.add_(self.bias)
        if x.shape[0] == 1 and self._row == "split":
            s, same = self._split.shape[0], x.dtype == self._split.dtype
            xt = (x if same else x.to(self._split.dtype)).t().unsqueeze(0).expand(s, -1, 1)
            y = torch.bmm(self._split, xt).view(1, self.out_features)
            y = y if self.bias is None else y.add_(self.bias)
            return y if same else y.to(x.dtype)
        # A compiled graph (runner/compiled_decode.py) multiplies by the plain weight, which Inductor packs itself.
        if (self._packed is not None and not (x.shape[0] == 1 and self._row == "linear")
                and not torch.compiler.is_compiling()):
            if x.dtype == self._packed_dtype and (self.bias is None or self.bias.dtype == x.dtype):
                return bi.matmul(x, self._packed, self.bias)
            y = bi.matmul(x.to(self._packed_dtype), self._packed)
            y = y.to(x.dtype) if cast_back else y
            return y if self.bias is None else y.add_(self.bias)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)

    local_forward = forward   # this rank's part, without a subclass's collective (what row_path.py times)


class QKVLinear(Linear):
    """Fused q/k/v projection: out rows [q (H*D) | k (KV*D) | v (KV*D)], shards "q", "k", "v"."""

    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 bias: bool = False):
        q, kv = num_heads * head_dim, num_kv_heads * head_dim
        super().__init__(hidden_size, q + 2 * kv, bias,
                         {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)})


class GateUpLinear(Linear):
    """Fused SwiGLU input projection: out rows [gate (I) | up (I)], shards "gate", "up"."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False):
        super().__init__(hidden_size, 2 * intermediate_size, bias,
                         {"gate": (0, intermediate_size), "up": (intermediate_size, intermediate_size)})
