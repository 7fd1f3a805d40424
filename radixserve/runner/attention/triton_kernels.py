"""Triton kernels of paged attention: decode (one query token per sequence) and extend (a prefill chunk over its cached prefix).

Pages are read in-kernel (PagedAttention, Kwon et al. 2023), keys in blocks of BLOCK_N with an online softmax
(Milakov & Gimelshein 2018) tiled as in FlashAttention (Dao et al. 2022); K and V scales fold into the score scale and
the output. Scores, softmax and accumulation are fp32; products take q's dtype (fp32 with input_precision="ieee")."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

# The softmax uses exp2: e^x = 2^(x * log2(e)), log2(e) = 1.4426950408889634 folded into qk_scale.


@triton.jit
def _key_offsets(PageTable, seq, stride_pt, pos, valid, stride_kp, stride_kt, PAGE_SIZE: tl.constexpr):
    page = tl.load(PageTable + seq * stride_pt + pos // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
    return page * stride_kp + (pos % PAGE_SIZE).to(tl.int64) * stride_kt


@triton.jit
def _online_softmax_block(q, kt, v, visible, qk_scale, m_i, l_i, acc):
    """q (R, D), kt (D, N), v (N, D), visible (R, N); running max and sum m_i, l_i (R,) (base 2), acc (R, D) fp32."""
    qk = tl.dot(q, kt.to(q.dtype), input_precision="ieee") * qk_scale
    qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    return m_new, l_i, acc


@triton.jit
def decode_kernel(Q, K, V, KScale, VScale, Out, PageTable, ContextLens, SeqIdx, QRows, sm_scale,
                  stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_kp, stride_kt, stride_pt,
                  PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    """Grid (num_decodes, num_kv_heads): a KV head's GROUP query heads attend over ContextLens[SeqIdx[i]] keys."""
    i = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.load(SeqIdx + i)
    row = tl.load(QRows + i).to(tl.int64)
    ctx = tl.load(ContextLens + seq)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    h_mask = offs_h < GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * GROUP + offs_h
    q_mask = h_mask[:, None] & d_mask[None, :]
    q = tl.load(Q + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    qk_scale = sm_scale * tl.load(KScale + kv_head) * 1.4426950408889634
    k_base = K + kv_head.to(tl.int64) * stride_kh
    v_base = V + kv_head.to(tl.int64) * stride_kh
    m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(0, ctx, BLOCK_N):
        pos = start + offs_n
        valid = pos < ctx
        tok = _key_offsets(PageTable, seq, stride_pt, pos, valid, stride_kp, stride_kt, PAGE_SIZE)
        kt = tl.load(k_base + tok[None, :] + offs_d[:, None], mask=d_mask[:, None] & valid[None, :], other=0.0)
        v = tl.load(v_base + tok[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
        m_i, l_i, acc = _online_softmax_block(q, kt, v, valid[None, :], qk_scale, m_i, l_i, acc)
    out = acc / l_i[:, None] * tl.load(VScale + kv_head)
    tl.store(Out + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=q_mask)


@triton.jit
def extend_kernel(Q, K, V, KScale, VScale, Out, PageTable, ContextLens, CuSeqlensQ, SeqIdx, sm_scale,
                  stride_qt, stride_qh, stride_ot, stride_oh, stride_kh, stride_kp, stride_kt, stride_pt,
                  PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, DOT_FP32: tl.constexpr):
    """Grid (num_prefills, num_heads, cdiv(longest chunk, BLOCK_M)): chunk row r at position prefix + r sees keys
    <= prefix + r, all read from the cache (its own K/V written first), so chunking does not change the result."""
    i = tl.program_id(0)
    head = tl.program_id(1)
    block = tl.program_id(2)
    seq = tl.load(SeqIdx + i)
    q_start = tl.load(CuSeqlensQ + seq)
    q_len = tl.load(CuSeqlensQ + seq + 1) - q_start
    if block * BLOCK_M >= q_len:
        return
    ctx = tl.load(ContextLens + seq)
    prefix = ctx - q_len
    kv_head = head // GROUP
    offs_m = block * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_mask = m_mask[:, None] & d_mask[None, :]
    rows = (q_start + offs_m).to(tl.int64)
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=q_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = prefix + offs_m
    qk_scale = sm_scale * tl.load(KScale + kv_head) * 1.4426950408889634
    k_base = K + kv_head.to(tl.int64) * stride_kh
    v_base = V + kv_head.to(tl.int64) * stride_kh
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    end = tl.minimum(ctx, prefix + (block + 1) * BLOCK_M)
    for start in range(0, end, BLOCK_N):
        pos = start + offs_n
        valid = pos < end
        tok = _key_offsets(PageTable, seq, stride_pt, pos, valid, stride_kp, stride_kt, PAGE_SIZE)
        kt = tl.load(k_base + tok[None, :] + offs_d[:, None], mask=d_mask[:, None] & valid[None, :], other=0.0)
        v = tl.load(v_base + tok[:, None] + offs_d[None, :], mask=valid[:, None] & d_mask[None, :], other=0.0)
        visible = valid[None, :] & (pos[None, :] <= q_pos[:, None])
        # m_i stays finite: every row sees key 0 in the first block
        m_i, l_i, acc = _online_softmax_block(q, kt, v, visible, qk_scale, m_i, l_i, acc)
    out = acc / l_i[:, None] * tl.load(VScale + kv_head)
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=q_mask)


def _block_d(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _dot_fp32(q: torch.Tensor) -> bool:
    """fp32 products for fp32 q and on CPU, where the Triton interpreter's tl.dot is wrong for bf16 (numpy has none)."""
    return q.dtype == torch.float32 or q.device.type == "cpu"


def _block_n(q: torch.Tensor, head_dim: int) -> int:
    """Keys per iteration: 64, or 32 for fp32 products at head_dim > 64 (register and shared-memory budget)."""
    return 32 if _dot_fp32(q) and q.device.type != "cpu" and head_dim > 64 else 64


def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, out: torch.Tensor, page_table: torch.Tensor,
                 context_lens: torch.Tensor, seq_idx: torch.Tensor, q_rows: torch.Tensor) -> None:
    """Sequences seq_idx (n,) int32 with query rows q_rows (n,) int32 of q (T, H, D), last dim contiguous, into those rows
    of out; k, v, scales as KVCache.kernel_view gives them; page_table (B, max_pages), context_lens (B,) int32."""
    num_kv, _, page_size, head_dim = k.shape
    group = q.shape[1] // num_kv
    decode_kernel[(seq_idx.shape[0], num_kv)](
        q, k, v, k_scale, v_scale, out, page_table, context_lens, seq_idx, q_rows, head_dim ** -0.5,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2),
        page_table.stride(0), PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=_block_n(q, head_dim),
        BLOCK_D=_block_d(head_dim), DOT_FP32=_dot_fp32(q), num_warps=4, num_stages=2)


def paged_extend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor,
                 v_scale: torch.Tensor, out: torch.Tensor, page_table: torch.Tensor,
                 context_lens: torch.Tensor, cu_seqlens_q: torch.Tensor, seq_idx: torch.Tensor,
                 max_q_len: int) -> None:
    """Chunks seq_idx (n,) int32, rows [cu_seqlens_q[s], cu_seqlens_q[s + 1]) of q, causally; else as paged_decode."""
    num_kv, _, page_size, head_dim = k.shape
    num_heads = q.shape[1]
    block_m = block_n = _block_n(q, head_dim)
    grid = (seq_idx.shape[0], num_heads, triton.cdiv(max_q_len, block_m))
    extend_kernel[grid](
        q, k, v, k_scale, v_scale, out, page_table, context_lens, cu_seqlens_q, seq_idx, head_dim ** -0.5,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), k.stride(0), k.stride(1), k.stride(2),
        page_table.stride(0), PAGE_SIZE=page_size, GROUP=num_heads // num_kv, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=_block_d(head_dim), DOT_FP32=_dot_fp32(q),
        num_warps=4, num_stages=2)
