// radixserve::int4_int8_mm: layout, numerics and the fixed float order are radixserve/layers/int4_int8.py's.
#include <torch/library.h>

#include <cmath>

#include "int4_layout.h"

namespace {

using namespace radixserve_int4;
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512_VNNI = 2 };

struct Acts {
  const int8_t* q;    // (M, K)
  const float* dx;    // (M, B)
  const float* sxf;   // (M, B)
  int64_t k, nb;
};

bool supported(int64_t isa) {
  __builtin_cpu_init();
  if (isa == AVX512_VNNI)
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
           __builtin_cpu_supports("avx512vnni");
  if (isa == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return isa == SCALAR;
}

void quantize_rows(const float* x, int64_t m, int64_t k, int8_t* q, float* dx, float* sxf) {
  const int64_t nb = k / BLOCK;
  at::parallel_for(0, m, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t b = 0; b < nb; ++b) {
        const float* xb = x + r * k + b * BLOCK;
        float amax = 0.f;
        for (int i = 0; i < BLOCK; ++i) amax = std::max(amax, std::fabs(xb[i]));
        const float d = amax / 127.f, id = amax > 0.f ? 127.f / amax : 0.f;
        int sum = 0;
        for (int i = 0; i < BLOCK; ++i) {
          float v = std::nearbyint(xb[i] * id);
          v = std::min(127.f, std::max(-127.f, v));
          q[r * k + b * BLOCK + i] = static_cast<int8_t>(v);
          sum += static_cast<int>(v);
        }
        dx[r * nb + b] = d;
        sxf[r * nb + b] = d * static_cast<float>(sum);
      }
  });
}

// Column group g, rows [r0, r1): acc[r][c] += d[c] * (isum * dx) + mn[c] * sxf, blocks in order.
template <typename S>
void group_scalar(const uint8_t* w, const S* s, const Acts& a, int64_t r0, int64_t r1, float* acc) {
  for (int64_t b = 0; b < a.nb; ++b) {
    const uint8_t* wb = w + b * 4 * 64;
    float d[2 * COLS];
    for (int c = 0; c < 2 * COLS; ++c) d[c] = to_float(s[b * 2 * COLS + c]);
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* q = a.q + r * a.k + b * BLOCK;
      const float dx = a.dx[r * a.nb + b], sxf = a.sxf[r * a.nb + b];
      for (int c = 0; c < COLS; ++c) {
        int32_t isum = 0;
        for (int i = 0; i < BLOCK; ++i) {
          const int word = i / 4, byte = wb[(word % 4) * 64 + c * 4 + i % 4];
          isum += (word < 4 ? byte & 15 : byte >> 4) * q[i];
        }
        float& o = acc[(r - r0) * COLS + c];
        o = o + (d[c] * (static_cast<float>(isum) * dx) + d[COLS + c] * sxf);
      }
    }
  }
}

template <typename S>
__attribute__((target("avx2,f16c"))) void group_avx2(const uint8_t* w, const S* s, const Acts& a, int64_t r0,
                                                     int64_t r1, float* acc) {
  const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < a.nb; ++b)
    for (int h = 0; h < 2; ++h) {
      __m256i wv[8];
      for (int p = 0; p < 4; ++p) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + b * 256 + p * 64 + h * 32));
        wv[p] = _mm256_and_si256(v, low);
        wv[p + 4] = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
      }
      const S* sb = s + b * 2 * COLS + h * 8;
      const __m256 d = load8(sb), mn = load8(sb + COLS);
      for (int64_t r = r0; r < r1; ++r) {
        const int8_t* q = a.q + r * a.k + b * BLOCK;
        __m256i s16 = _mm256_setzero_si256();
        for (int i = 0; i < 8; ++i) {   // |16 products| <= 30480: the int16 sum cannot overflow
          int32_t word;
          std::memcpy(&word, q + 4 * i, 4);
          s16 = _mm256_add_epi16(s16, _mm256_maddubs_epi16(wv[i], _mm256_set1_epi32(word)));
        }
        const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(s16, ones));
        const __m256 u = _mm256_mul_ps(d, _mm256_mul_ps(isum, _mm256_set1_ps(a.dx[r * a.nb + b])));
        const __m256 v = _mm256_mul_ps(mn, _mm256_set1_ps(a.sxf[r * a.nb + b]));
        float* o = acc + (r - r0) * COLS + h * 8;
        _mm256_storeu_ps(o, _mm256_add_ps(_mm256_loadu_ps(o), _mm256_add_ps(u, v)));
      }
    }
}

template <typename S>
__attribute__((target("avx512f,avx512bw,avx512vnni"))) void group_vnni(const uint8_t* w, const S* s, const Acts& a,
                                                                       int64_t r0, int64_t r1, float* acc) {
  const __m512i low = _mm512_set1_epi8(15);
  for (int64_t b = 0; b < a.nb; ++b) {
    __m512i wv[8];
    for (int p = 0; p < 4; ++p) {
      const __m512i v = _mm512_loadu_si512(w + b * 256 + p * 64);
      wv[p] = _mm512_and_si512(v, low);
      wv[p + 4] = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
    }
    const __m512 d = load16(s + b * 2 * COLS), mn = load16(s + b * 2 * COLS + COLS);
    for (int64_t r = r0; r < r1; ++r) {
      const int8_t* q = a.q + r * a.k + b * BLOCK;
      __m512i part[4];   // four independent chains of vpdpbusd
      for (int i = 0; i < 8; ++i) {
        int32_t word;
        std::memcpy(&word, q + 4 * i, 4);
        const __m512i prod = _mm512_dpbusd_epi32(i < 4 ? _mm512_setzero_si512() : part[i - 4], wv[i],
                                                 _mm512_set1_epi32(word));
        part[i % 4] = prod;
      }
      const __m512i is = _mm512_add_epi32(_mm512_add_epi32(part[0], part[1]), _mm512_add_epi32(part[2], part[3]));
      const __m512 u = _mm512_mul_ps(d, _mm512_mul_ps(_mm512_cvtepi32_ps(is), _mm512_set1_ps(a.dx[r * a.nb + b])));
      const __m512 v = _mm512_mul_ps(mn, _mm512_set1_ps(a.sxf[r * a.nb + b]));
      float* o = acc + (r - r0) * COLS;
      _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), _mm512_add_ps(u, v)));
    }
  }
}

template <typename S>
void run(const uint8_t* w, const S* s, const Acts& a, int64_t m, int64_t n, int64_t groups, int64_t isa, float* y) {
  auto group = isa == AVX512_VNNI ? group_vnni<S> : isa == AVX2 ? group_avx2<S> : group_scalar<S>;
  const int64_t nb = a.nb;
  run_groups([&](int64_t g, int64_t r0, int64_t r1, float* acc) {
    group(w + g * nb * BLOCK_BYTES, s + g * nb * 2 * COLS, a, r0, r1, acc);
  }, m, n, groups, y);
}

// x (M, K) fp32; packed (G, K / 32, 4, 64) uint8; scales (G, K / 32, 2, 16) fp32 or fp16 -> (M, n) fp32.
at::Tensor int4_int8_mm(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales, int64_t n,
                        int64_t isa) {
  check_operands("int4_int8_mm", x, packed, scales, n);
  const int64_t m = x.size(0), k = x.size(1), groups = packed.size(0), nb = k / BLOCK;
  TORCH_CHECK(supported(isa), "int4_int8_mm: this CPU lacks ISA ", isa);
  const at::Tensor xc = x.contiguous();
  at::Tensor q = at::empty({m, k}, x.options().dtype(at::kChar));
  at::Tensor dx = at::empty({m, nb}, x.options()), sxf = at::empty({m, nb}, x.options());
  quantize_rows(xc.data_ptr<float>(), m, k, q.data_ptr<int8_t>(), dx.data_ptr<float>(), sxf.data_ptr<float>());
  const Acts a{q.data_ptr<int8_t>(), dx.data_ptr<float>(), sxf.data_ptr<float>(), k, nb};
  at::Tensor out = at::empty({m, n}, x.options());
  with_scales(scales, [&](const auto* s) {
    run(packed.data_ptr<uint8_t>(), s, a, m, n, groups, isa, out.data_ptr<float>());
  });
  return out;
}

}  // namespace

TORCH_LIBRARY(radixserve, m) {
  m.def("int4_int8_mm(Tensor x, Tensor packed, Tensor scales, int n, int isa) -> Tensor");
  m.def("int4_int8_supported(int isa) -> bool", &supported);
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) { m.impl("int4_int8_mm", int4_int8_mm); }
