// The per-(sequence, KV head) math of radixserve::decode_attention(_paged): scalar, AVX2 and AVX-512 paths and the
// shared exp; included by decode_attention.cpp only (its contract: that file's header).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2 };
constexpr int64_t MIN_TASK_ROWS = 1024;   // K rows per thread (about 0.5 MB of fp32 K and V at D 64); fewer: one thread

bool supported(int64_t isa) {
  __builtin_cpu_init();
  if (isa == AVX512) return __builtin_cpu_supports("avx512f");
  if (isa == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return isa == SCALAR;
}

// One (sequence, KV head): rep query rows q (rep, D) over len rows of k and v, s a (rep, len) scratch; writes out
// (rep, D). Rows come in blocks of `block` rows (row stride st): block i starts at k + block_offset(i * block); not
// paged (pages null) one block of len rows at k, paged block i at k + pages[i] * pst. T: float, or uint16_t for
// bfloat16 K and V (widened to fp32 exactly on load).
template <class T>
struct Head {
  const float* q;
  const T* k;
  const T* v;
  int64_t st, len, rep, d;
  float scale;
  float* s;
  float* out;
  const int64_t* pages;
  int64_t block, pst;

  int64_t block_offset(int64_t t0) const { return pages ? pages[t0 / block] * pst : t0 * st; }
  int64_t block_rows(int64_t t0) const { return std::min(block, len - t0); }
  int64_t row_offset(int64_t t) const { return block_offset(t - t % block) + (t % block) * st; }
};

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {   // bfloat16 bits -> fp32, exact
  const uint32_t bits = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const uint16_t* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(wide, 16));
}
__attribute__((target("avx2,fma"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,fma"))) inline __m256 load8(const uint16_t* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}

// ---- scalar: std::exp, the reference order ----
template <class T>
void head_scalar(const Head<T>& h) {
  for (int64_t r = 0; r < h.rep; ++r) {
    float* s = h.s + r * h.len;
    const float* q = h.q + r * h.d;
    float mx = -INFINITY, sum = 0.f;
    for (int64_t t = 0; t < h.len; ++t) {
      float acc = 0.f;
      const T* k = h.k + h.row_offset(t);
      for (int64_t c = 0; c < h.d; ++c) acc += q[c] * to_float(k[c]);
      s[t] = acc * h.scale;
      mx = std::max(mx, s[t]);
    }
    for (int64_t t = 0; t < h.len; ++t) sum += (s[t] = std::exp(s[t] - mx));
    float* o = h.out + r * h.d;
    std::fill(o, o + h.d, 0.f);
    for (int64_t t = 0; t < h.len; ++t) {
      const T* v = h.v + h.row_offset(t);
      for (int64_t c = 0; c < h.d; ++c) o[c] += s[t] * to_float(v[c]);
    }
    for (int64_t c = 0; c < h.d; ++c) o[c] /= sum;
  }
}

// ---- exp for x <= 0: 2^n * p(r), n = round(x log2 e), r = x - n ln2 (ln2 split in two), p the degree-7 Taylor
// polynomial; x < -87 is taken as -87. Relative error bound stated and tested in decode_kernel.py. ----
constexpr float LOG2E = 1.44269504f, LN2_HI = 0.693359375f, LN2_LO = -2.12194440e-4f, EXP_MIN = -87.f;
constexpr float TAYLOR[8] = {1.f, 1.f, 1.f / 2, 1.f / 6, 1.f / 24, 1.f / 120, 1.f / 720, 1.f / 5040};

__attribute__((target("avx512f"))) inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
  __m512 p = _mm512_set1_ps(TAYLOR[7]);
  for (int i = 6; i >= 0; --i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(TAYLOR[i]));
  const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  return _mm512_mul_ps(p, _mm512_castsi512_ps(bits));
}

__attribute__((target("avx2,fma"))) inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
  __m256 p = _mm256_set1_ps(TAYLOR[7]);
  for (int i = 6; i >= 0; --i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(TAYLOR[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

__attribute__((target("avx2,fma"))) inline float hsum8(__m256 v) {
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  return _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
}

// ---- AVX-512 (D % 16 == 0): up to 4 query rows share each K and V row load ----
template <int NR, class T>
__attribute__((target("avx512f"))) void scores512(const Head<T>& h, int64_t r0) {
  for (int64_t t0 = 0; t0 < h.len; t0 += h.block) {
    const T* kb = h.k + h.block_offset(t0);
    for (int64_t t = t0, end = t0 + h.block_rows(t0); t < end; ++t) {
      const T* k = kb + (t - t0) * h.st;
      __m512 acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = _mm512_setzero_ps();
      for (int64_t c = 0; c < h.d; c += 16) {
        const __m512 kc = load16(k + c);
        for (int r = 0; r < NR; ++r) acc[r] = _mm512_fmadd_ps(_mm512_loadu_ps(h.q + (r0 + r) * h.d + c), kc, acc[r]);
      }
      for (int r = 0; r < NR; ++r) h.s[(r0 + r) * h.len + t] = _mm512_reduce_add_ps(acc[r]) * h.scale;
    }
  }
}

__attribute__((target("avx512f"))) float softmax512(float* s, int64_t len) {   // s <- exp(s - max); returns the sum
  const int64_t full = len & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (len - full)) - 1);
  __m512 mx = _mm512_set1_ps(-INFINITY);
  for (int64_t t = 0; t < full; t += 16) mx = _mm512_max_ps(mx, _mm512_loadu_ps(s + t));
  mx = _mm512_mask_max_ps(mx, tail, mx, _mm512_maskz_loadu_ps(tail, s + full));
  const __m512 m = _mm512_set1_ps(_mm512_reduce_max_ps(mx));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t t = 0; t < full; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(s + t), m));
    _mm512_storeu_ps(s + t, e);
    sum = _mm512_add_ps(sum, e);
  }
  const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + full), m));
  _mm512_mask_storeu_ps(s + full, tail, e);
  sum = _mm512_mask_add_ps(sum, tail, sum, e);
  return _mm512_reduce_add_ps(sum);
}

template <int NR, class T>
__attribute__((target("avx512f"))) void weighted512(const Head<T>& h, int64_t r0, const float* inv) {
  for (int64_t c0 = 0; c0 < h.d; c0 += 64) {
    const int nc = static_cast<int>(std::min<int64_t>(4, (h.d - c0) / 16));
    __m512 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_setzero_ps();
    for (int64_t t0 = 0; t0 < h.len; t0 += h.block) {
      const T* vb = h.v + h.block_offset(t0) + c0;
      for (int64_t t = t0, end = t0 + h.block_rows(t0); t < end; ++t) {
        const T* v = vb + (t - t0) * h.st;
        for (int c = 0; c < 4; ++c) {
          if (c >= nc) break;
          const __m512 vc = load16(v + 16 * c);
          for (int r = 0; r < NR; ++r)
            acc[r][c] = _mm512_fmadd_ps(_mm512_set1_ps(h.s[(r0 + r) * h.len + t]), vc, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < nc; ++c)
        _mm512_storeu_ps(h.out + (r0 + r) * h.d + c0 + 16 * c, _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv[r0 + r])));
  }
}

// ---- AVX2 (D % 8 == 0): the same structure on 8 lanes ----
template <int NR, class T>
__attribute__((target("avx2,fma"))) void scores256(const Head<T>& h, int64_t r0) {
  for (int64_t t0 = 0; t0 < h.len; t0 += h.block) {
    const T* kb = h.k + h.block_offset(t0);
    for (int64_t t = t0, end = t0 + h.block_rows(t0); t < end; ++t) {
      const T* k = kb + (t - t0) * h.st;
      __m256 acc[NR];
      for (int r = 0; r < NR; ++r) acc[r] = _mm256_setzero_ps();
      for (int64_t c = 0; c < h.d; c += 8) {
        const __m256 kc = load8(k + c);
        for (int r = 0; r < NR; ++r) acc[r] = _mm256_fmadd_ps(_mm256_loadu_ps(h.q + (r0 + r) * h.d + c), kc, acc[r]);
      }
      for (int r = 0; r < NR; ++r) h.s[(r0 + r) * h.len + t] = hsum8(acc[r]) * h.scale;
    }
  }
}

__attribute__((target("avx2,fma"))) float softmax256(float* s, int64_t len) {
  const int64_t full = len & ~int64_t{7};
  float mx = -INFINITY;
  __m256 mv = _mm256_set1_ps(-INFINITY);
  for (int64_t t = 0; t < full; t += 8) mv = _mm256_max_ps(mv, _mm256_loadu_ps(s + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, mv);
  for (float x : lanes) mx = std::max(mx, x);
  for (int64_t t = full; t < len; ++t) mx = std::max(mx, s[t]);
  const __m256 m = _mm256_set1_ps(mx);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t t = 0; t < full; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + t), m));
    _mm256_storeu_ps(s + t, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float rest[8] = {};
  for (int64_t t = full; t < len; ++t) rest[t - full] = s[t] - mx;
  const __m256 e = exp8(_mm256_load_ps(rest));
  _mm256_store_ps(rest, e);
  float total = hsum8(sum);
  for (int64_t t = full; t < len; ++t) total += (s[t] = rest[t - full]);
  return total;
}

template <int NR, class T>
__attribute__((target("avx2,fma"))) void weighted256(const Head<T>& h, int64_t r0, const float* inv) {
  for (int64_t c0 = 0; c0 < h.d; c0 += 32) {
    const int nc = static_cast<int>(std::min<int64_t>(4, (h.d - c0) / 8));
    __m256 acc[NR][4];
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t t0 = 0; t0 < h.len; t0 += h.block) {
      const T* vb = h.v + h.block_offset(t0) + c0;
      for (int64_t t = t0, end = t0 + h.block_rows(t0); t < end; ++t) {
        const T* v = vb + (t - t0) * h.st;
        for (int c = 0; c < 4; ++c) {
          if (c >= nc) break;
          const __m256 vc = load8(v + 8 * c);
          for (int r = 0; r < NR; ++r)
            acc[r][c] = _mm256_fmadd_ps(_mm256_set1_ps(h.s[(r0 + r) * h.len + t]), vc, acc[r][c]);
        }
      }
    }
    for (int r = 0; r < NR; ++r)
      for (int c = 0; c < nc; ++c)
        _mm256_storeu_ps(h.out + (r0 + r) * h.d + c0 + 8 * c, _mm256_mul_ps(acc[r][c], _mm256_set1_ps(inv[r0 + r])));
  }
}

// The vector paths' pieces, for head_vector.
struct Avx512 {
  template <int NR, class T> static void scores(const Head<T>& h, int64_t r0) { scores512<NR>(h, r0); }
  template <int NR, class T> static void weighted(const Head<T>& h, int64_t r0, const float* inv) {
    weighted512<NR>(h, r0, inv);
  }
  static float softmax(float* s, int64_t len) { return softmax512(s, len); }
};
struct Avx2 {
  template <int NR, class T> static void scores(const Head<T>& h, int64_t r0) { scores256<NR>(h, r0); }
  template <int NR, class T> static void weighted(const Head<T>& h, int64_t r0, const float* inv) {
    weighted256<NR>(h, r0, inv);
  }
  static float softmax(float* s, int64_t len) { return softmax256(s, len); }
};

// Query rows in groups of at most 4 (each group one pass over K and one over V).
template <class Isa, class T>
void head_vector(const Head<T>& h) {
  float inv[64];
  for (int64_t r0 = 0; r0 < h.rep; r0 += 4) {
    const int64_t nr = std::min<int64_t>(4, h.rep - r0);
    (nr == 4 ? Isa::template scores<4, T> : nr == 3 ? Isa::template scores<3, T>
     : nr == 2 ? Isa::template scores<2, T> : Isa::template scores<1, T>)(h, r0);
    for (int64_t r = r0; r < r0 + nr; ++r) inv[r] = 1.f / Isa::softmax(h.s + r * h.len, h.len);
    (nr == 4 ? Isa::template weighted<4, T> : nr == 3 ? Isa::template weighted<3, T>
     : nr == 2 ? Isa::template weighted<2, T> : Isa::template weighted<1, T>)(h, r0, inv);
  }
}

template <class T>
using HeadFn = void (*)(const Head<T>&);

// The path for `isa` and head_dim d: the vector ones where d is a multiple of their width, else scalar.
template <class T>
HeadFn<T> head_fn(int64_t isa, int64_t d) {
  TORCH_CHECK(supported(isa), "decode_attention: this CPU lacks ISA ", isa);
  if (isa == AVX512 && d % 16 == 0) return head_vector<Avx512, T>;
  if (isa == AVX2 && d % 8 == 0) return head_vector<Avx2, T>;
  return head_scalar<T>;
}

}  // namespace
