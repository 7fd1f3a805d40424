// radixserve::q8_fp32_mm: GGUF Q8_0 weights (int8 codes, one scale per 32 columns, w = d * q) x fp32 activations;
// numerics and the fixed float order are radixserve/layers/q8_fp32.py's (reference_mm). Layout: codes (G, B, 32, 16)
// int8, byte [g][b][k][c] the code of column 16g + c at k of block b; scales (G, B, 16) fp32 or fp16.
#include <torch/library.h>

#include "int4_layout.h"

namespace {

using namespace radixserve_int4;
using namespace radixserve_fp32;
constexpr int ROWS_AT_ONCE = 4;   // rows sharing each conversion of 16 codes (AVX-512; AVX2 shares among 2)
constexpr int64_t CODE_BYTES = BLOCK * COLS;

struct Rows {
  const float* x;   // (M, K)
  int64_t k, nb;
};

// Columns of one group, rows [r0, r1): acc[r][c] = acc[r][c] + d * dot per block in order, dot = block_sum of q * x.
template <typename S>
void group_scalar(const int8_t* w, const S* s, const Rows& a, int64_t r0, int64_t r1, float* acc) {
  for (int64_t r = r0; r < r1; ++r)
    for (int64_t b = 0; b < a.nb; ++b) {
      const float* xb = a.x + r * a.k + b * BLOCK;
      for (int c = 0; c < COLS; ++c) {
        float prod[BLOCK];
        for (int k = 0; k < BLOCK; ++k) prod[k] = static_cast<float>(w[b * CODE_BYTES + k * COLS + c]) * xb[k];
        float& o = acc[(r - r0) * COLS + c];
        o = o + to_float(s[b * COLS + c]) * block_sum(prod);
      }
    }
}

// Rows r .. r + R - 1 (acc rows o, COLS apart), columns 8h .. 8h + 7, block b.
template <int R, typename S>
__attribute__((target("avx2,f16c"), always_inline)) inline void add_block8(float* o, const int8_t* wb, const Rows& a,
                                                                        int64_t r, int64_t b, const S* sb, int h) {
  __m256 part[R][4];
#pragma GCC unroll 32
  for (int k = 0; k < BLOCK; ++k) {
    const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb + k * COLS + 8 * h));
    const __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
#pragma GCC unroll 4
    for (int i = 0; i < R; ++i) {
      const float* x = a.x + (r + i) * a.k + b * BLOCK + k;
      if (k < 4)
        mul_add8<true>(part[i][k % 4], q, x);
      else
        mul_add8<false>(part[i][k % 4], q, x);
    }
  }
  const __m256 d = load8(sb + 8 * h);
#pragma GCC unroll 4
  for (int i = 0; i < R; ++i) {
    const __m256 dot = _mm256_add_ps(_mm256_add_ps(part[i][0], part[i][1]), _mm256_add_ps(part[i][2], part[i][3]));
    float* oi = o + i * COLS + 8 * h;
    _mm256_storeu_ps(oi, _mm256_add_ps(_mm256_loadu_ps(oi), _mm256_mul_ps(d, dot)));
  }
}

template <typename S>
__attribute__((target("avx2,f16c"))) void group_avx2(const int8_t* w, const S* s, const Rows& a, int64_t r0,
                                                     int64_t r1, float* acc) {
  for (int64_t b = 0; b < a.nb; ++b)
    for (int h = 0; h < 2; ++h) {
      int64_t r = r0;
      for (; r + 2 <= r1; r += 2) add_block8<2>(acc + (r - r0) * COLS, w + b * CODE_BYTES, a, r, b, s + b * COLS, h);
      if (r < r1) add_block8<1>(acc + (r - r0) * COLS, w + b * CODE_BYTES, a, r, b, s + b * COLS, h);
    }
}

// Rows r .. r + R - 1 of acc (o, COLS apart), block b: each k's 16 codes sign-extended and converted once for R rows.
template <int R, typename S>
__attribute__((target("avx512f"), always_inline)) inline void add_block(float* o, const int8_t* wb, const Rows& a,
                                                                     int64_t r, int64_t b, const S* sb) {
  __m512 part[R][4];
  const float* xb[R];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) xb[i] = a.x + (r + i) * a.k + b * BLOCK;
#pragma GCC unroll 32
  for (int k = 0; k < BLOCK; ++k) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(wb + k * COLS));
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(raw));
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      if (k < 4)
        mul_add<true>(part[i][k % 4], q, xb[i] + k);
      else
        mul_add<false>(part[i][k % 4], q, xb[i] + k);
    }
  }
  const __m512 d = load16(sb);
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i) {
    const __m512 dot = _mm512_add_ps(_mm512_add_ps(part[i][0], part[i][1]), _mm512_add_ps(part[i][2], part[i][3]));
    float* oi = o + i * COLS;
    _mm512_storeu_ps(oi, _mm512_add_ps(_mm512_loadu_ps(oi), _mm512_mul_ps(d, dot)));
  }
}

template <typename S>
__attribute__((target("avx512f"))) void group_avx512(const int8_t* w, const S* s, const Rows& a, int64_t r0,
                                                     int64_t r1, float* acc) {
  for (int64_t b = 0; b < a.nb; ++b) {
    const int8_t* wb = w + b * CODE_BYTES;
    const S* sb = s + b * COLS;
    int64_t r = r0;
    for (; r + ROWS_AT_ONCE <= r1; r += ROWS_AT_ONCE) add_block<ROWS_AT_ONCE>(acc + (r - r0) * COLS, wb, a, r, b, sb);
    switch (r1 - r) {
      case 3: add_block<3>(acc + (r - r0) * COLS, wb, a, r, b, sb); break;
      case 2: add_block<2>(acc + (r - r0) * COLS, wb, a, r, b, sb); break;
      case 1: add_block<1>(acc + (r - r0) * COLS, wb, a, r, b, sb); break;
      default: break;
    }
  }
}

template <typename S>
void run(const int8_t* w, const S* s, const Rows& a, int64_t m, int64_t n, int64_t groups, int64_t isa, float* y) {
  auto group = isa == AVX512 ? group_avx512<S> : isa == AVX2 ? group_avx2<S> : group_scalar<S>;
  const int64_t nb = a.nb;
  run_groups([&](int64_t g, int64_t r0, int64_t r1, float* acc) {
    group(w + g * nb * CODE_BYTES, s + g * nb * COLS, a, r0, r1, acc);
  }, m, n, groups, y);
}

// x (M, K) fp32; codes (G, K / 32, 32, 16) int8; scales (G, K / 32, 16) fp32 or fp16 -> (M, n) fp32.
at::Tensor q8_fp32_mm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales, int64_t n,
                      int64_t isa) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "q8_fp32_mm: x must be (M, K) float32");
  TORCH_CHECK(codes.scalar_type() == at::kChar && codes.dim() == 4 && codes.is_contiguous() &&
              codes.size(2) == BLOCK && codes.size(3) == COLS, "q8_fp32_mm: codes must be (G, K / 32, 32, 16) int8");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous(),
              "q8_fp32_mm: scales must be float32 or float16");
  const int64_t m = x.size(0), k = x.size(1), groups = codes.size(0), nb = k / BLOCK;
  TORCH_CHECK(k % BLOCK == 0 && codes.size(1) == nb && scales.numel() == groups * nb * COLS, "q8_fp32_mm: bad K");
  TORCH_CHECK(n > (groups - 1) * COLS && n <= groups * COLS, "q8_fp32_mm: bad n");
  TORCH_CHECK(supported(isa), "q8_fp32_mm: this CPU lacks ISA ", isa);
  const at::Tensor xc = x.contiguous();
  const Rows a{xc.data_ptr<float>(), k, nb};
  at::Tensor out = at::empty({m, n}, x.options());
  with_scales(scales, [&](const auto* s) {
    run(codes.data_ptr<int8_t>(), s, a, m, n, groups, isa, out.data_ptr<float>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("q8_fp32_mm(Tensor x, Tensor codes, Tensor scales, int n, int isa) -> Tensor");
  m.def("q8_fp32_supported(int isa) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("q8_fp32_mm", q8_fp32_mm); }
