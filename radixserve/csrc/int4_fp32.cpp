// radixserve::int4_fp32_mm: int4 weights x fp32 activations; numerics and the fixed float order are
// radixserve/layers/int4_fp32.py's (reference_mm), the layout int4_layout.h's.
#include <torch/library.h>

#include "int4_layout.h"

namespace {

using namespace radixserve_int4;
using namespace radixserve_fp32;
constexpr int64_t DIRECT_ROWS = 2;   // tiles of at most this many rows convert codes per row, larger ones once a block
constexpr int ROWS_AT_ONCE = 4;      // rows sharing each load of a converted block

struct Rows {
  const float* x;    // (M, K)
  const float* xs;   // (M, B): each block's sum of x, in block_sum's order
  int64_t k, nb;
};

inline int code(const uint8_t* wb, int c, int k) {
  const int byte = wb[(k % 16) / 4 * 64 + c * 4 + k % 4];
  return k < 16 ? byte & 15 : byte >> 4;
}

// Column group of `w` (B blocks of codes) and `s` (B x 2 x 16 scales), rows [r0, r1): acc[r][c] += d * dot + mn * xs
// per block in order, dot = block_sum of the products q * x.
template <typename S>
void group_scalar(const uint8_t* w, const S* s, const Rows& a, int64_t r0, int64_t r1, float* acc) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < a.nb; ++b) {
      const uint8_t* wb = w + b * BLOCK_BYTES;
      const float* xb = a.x + r * a.k + b * BLOCK;
      for (int c = 0; c < COLS; ++c) {
        float prod[BLOCK];
        for (int k = 0; k < BLOCK; ++k) prod[k] = static_cast<float>(code(wb, c, k)) * xb[k];
        const float d = to_float(s[b * 2 * COLS + c]), mn = to_float(s[b * 2 * COLS + COLS + c]);
        float& o = acc[(r - r0) * COLS + c];
        o = o + (d * block_sum(prod) + mn * a.xs[r * a.nb + b]);
      }
    }
}

__attribute__((target("avx2"), always_inline)) inline __m256 codes8(const __m256i* raw, int k) {
  const __m256i q = _mm256_srli_epi32(raw[k % 16 / 4], 8 * (k % 4) + 4 * (k / 16));
  return _mm256_cvtepi32_ps(_mm256_and_si256(q, _mm256_set1_epi32(15)));
}

// Rows r .. r + R - 1, columns 8h .. 8h + 7 of acc + the block's term; codes from raw (this half's 4 words) or,
// BUFFERED, from wf (16 floats per k, this half's 8 at wf + 8h).
template <int R, bool BUFFERED, typename S>
__attribute__((target("avx2,f16c"), always_inline)) inline void add_block8(float* o, const __m256i* raw, const float* wf,
                                                                        const Rows& a, int64_t r, int64_t b,
                                                                        const S* sb, int h) {
  __m256 part[R][4];
#pragma GCC unroll 32
  for (int k = 0; k < BLOCK; ++k) {
    const __m256 q = BUFFERED ? _mm256_load_ps(wf + k * COLS + 8 * h) : codes8(raw, k);
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const float* x = a.x + (r + i) * a.k + b * BLOCK + k;
      if (k < 4)
        mul_add8<true>(part[i][k % 4], q, x);
      else
        mul_add8<false>(part[i][k % 4], q, x);
    }
  }
  const __m256 d = load8(sb + 8 * h), mn = load8(sb + COLS + 8 * h);
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    const __m256 dot = _mm256_add_ps(_mm256_add_ps(part[i][0], part[i][1]), _mm256_add_ps(part[i][2], part[i][3]));
    const __m256 v = _mm256_mul_ps(mn, _mm256_set1_ps(a.xs[(r + i) * a.nb + b]));
    float* oi = o + i * COLS + 8 * h;
    _mm256_storeu_ps(oi, _mm256_add_ps(_mm256_loadu_ps(oi), _mm256_add_ps(_mm256_mul_ps(d, dot), v)));
  }
}

template <typename S>
__attribute__((target("avx2,f16c"))) void group_avx2(const uint8_t* w, const S* s, const Rows& a, int64_t r0,
                                                     int64_t r1, float* acc) {
  alignas(32) float wf[BLOCK * COLS];
  for (int64_t b = 0; b < a.nb; ++b) {
    const S* sb = s + b * 2 * COLS;
    for (int h = 0; h < 2; ++h) {
      __m256i raw[4];
      for (int p = 0; p < 4; ++p)
        raw[p] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * BLOCK_BYTES + p * 64 + h * 32));
      if (r1 - r0 <= DIRECT_ROWS) {
        for (int64_t r = r0; r < r1; ++r) add_block8<1, false>(acc + (r - r0) * COLS, raw, wf, a, r, b, sb, h);
        continue;
      }
      for (int k = 0; k < BLOCK; ++k) _mm256_store_ps(wf + k * COLS + 8 * h, codes8(raw, k));
      int64_t r = r0;
      for (; r + 2 <= r1; r += 2) add_block8<2, true>(acc + (r - r0) * COLS, raw, wf, a, r, b, sb, h);
      for (; r < r1; ++r) add_block8<1, true>(acc + (r - r0) * COLS, raw, wf, a, r, b, sb, h);
    }
  }
}

// One 32-bit lane per column: the code of k is the low 4 bits of (lane >> shift), and vpermps reads only those 4
// bits, so a permute of the table 0..15 turns it into its float.
__attribute__((target("avx512f"))) inline __m512 codes16(const __m512i* raw, int k, __m512 table) {
  return _mm512_permutexvar_ps(_mm512_srli_epi32(raw[k % 16 / 4], 8 * (k % 4) + 4 * (k / 16)), table);
}

// Rows r .. r + R - 1 of acc (o, COLS apart) + the block's term: codes from `raw` (unpacked here) or, BUFFERED,
// from `wf` (16 floats per k), each read once for the R rows.
template <int R, bool BUFFERED, typename S>
__attribute__((target("avx512f"), always_inline)) inline void add_block(float* o, const __m512i* raw, const float* wf,
                                                                     __m512 table, const Rows& a, int64_t r,
                                                                     int64_t b, const S* sb) {
  __m512 part[R][4];
  const float* xb[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) xb[i] = a.x + (r + i) * a.k + b * BLOCK;
#pragma GCC unroll 32
  for (int k = 0; k < BLOCK; ++k) {
    const __m512 q = BUFFERED ? _mm512_load_ps(wf + k * COLS) : codes16(raw, k, table);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      if (k < 4)
        mul_add<true>(part[i][k % 4], q, xb[i] + k);
      else
        mul_add<false>(part[i][k % 4], q, xb[i] + k);
    }
  }
  const __m512 d = load16(sb), mn = load16(sb + COLS);
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const __m512 dot = _mm512_add_ps(_mm512_add_ps(part[i][0], part[i][1]), _mm512_add_ps(part[i][2], part[i][3]));
    const __m512 v = _mm512_mul_ps(mn, _mm512_set1_ps(a.xs[(r + i) * a.nb + b]));
    float* oi = o + i * COLS;
    _mm512_storeu_ps(oi, _mm512_add_ps(_mm512_loadu_ps(oi), _mm512_add_ps(_mm512_mul_ps(d, dot), v)));
  }
}

template <typename S>
__attribute__((target("avx512f"))) void group_avx512(const uint8_t* w, const S* s, const Rows& a, int64_t r0,
                                                     int64_t r1, float* acc) {
  const __m512 table = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float wf[BLOCK * COLS];   // the block's codes as floats, (k, column)
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i raw[4];
    for (int p = 0; p < 4; ++p) raw[p] = _mm512_loadu_si512(w + b * BLOCK_BYTES + p * 64);
    const S* sb = s + b * 2 * COLS;
    if (r1 - r0 <= DIRECT_ROWS) {
      for (int64_t r = r0; r < r1; ++r) add_block<1, false>(acc + (r - r0) * COLS, raw, wf, table, a, r, b, sb);
      continue;
    }
    for (int k = 0; k < BLOCK; ++k) _mm512_store_ps(wf + k * COLS, codes16(raw, k, table));
    int64_t r = r0;
    for (; r + ROWS_AT_ONCE <= r1; r += ROWS_AT_ONCE)
      add_block<ROWS_AT_ONCE, true>(acc + (r - r0) * COLS, raw, wf, table, a, r, b, sb);
    for (; r < r1; ++r) add_block<1, true>(acc + (r - r0) * COLS, raw, wf, table, a, r, b, sb);
  }
}

template <typename S>
void run(const uint8_t* w, const S* s, const Rows& a, int64_t m, int64_t n, int64_t groups, int64_t isa, float* y) {
  auto group = isa == AVX512 ? group_avx512<S> : isa == AVX2 ? group_avx2<S> : group_scalar<S>;
  const int64_t nb = a.nb;
  run_groups([&](int64_t g, int64_t r0, int64_t r1, float* acc) {
    group(w + g * nb * BLOCK_BYTES, s + g * nb * 2 * COLS, a, r0, r1, acc);
  }, m, n, groups, y);
}

// x (M, K) fp32; packed (G, K / 32, 4, 64) uint8; scales (G, K / 32, 2, 16) fp32 or fp16 -> (M, n) fp32.
at::Tensor int4_fp32_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                        int64_t isa) {
  check_operands("int4_fp32_mm", x, packed, scales, n);
  TORCH_CHECK(supported(isa), "int4_fp32_mm: this CPU lacks ISA ", isa);
  const int64_t m = x.size(0), k = x.size(1), groups = packed.size(0), nb = k / BLOCK;
  const at::Tensor xc = x.contiguous();
  at::Tensor xs = at::empty({m, nb}, x.options());
  const float* xp = xc.data_ptr<float>();
  float* xsp = xs.data_ptr<float>();
  at::parallel_for(0, m * nb, 256, [&](int64_t i0, int64_t i1) {
    for (int64_t i = i0; i < i1; ++i) xsp[i] = block_sum(xp + i * BLOCK);
  });
  const Rows a{xp, xsp, k, nb};
  at::Tensor out = at::empty({m, n}, x.options());
  with_scales(scales, [&](const auto* s) {
    run(packed.data_ptr<uint8_t>(), s, a, m, n, groups, isa, out.data_ptr<float>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("int4_fp32_mm(Tensor x, Tensor packed, Tensor scales, int n, int isa) -> Tensor");
  m.def("int4_fp32_supported(int isa) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("int4_fp32_mm", int4_fp32_mm); }
