// radixserve::decode_attention: one query token per sequence over its first lens[b] mirrored tokens, fp32;
// radixserve::decode_attention_paged: the same over the paged KV cache through a page table.
// Contract and numerics bound: radixserve/runner/attention/decode_kernel.py and docs/runner.md, "Decode attention".
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

// Shared checks: q (B, H, D) fp32, k and v fp32 (or bf16 where `bf16_kv`) of one dtype with equal sizes and strides,
// unit stride in D, H a multiple of kv_heads (at most 64 query heads per KV head), lens (B,) int64 in [1, max_len]
// (its sum over B returned).
int64_t check(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens, int64_t kv_heads,
              int64_t max_len, bool bf16_kv) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && k.sizes() == v.sizes() && k.strides() == v.strides(),
              "decode_attention: q (B, H, D), k and v 4-d with the same sizes and strides");
  const bool kv_ok = k.scalar_type() == at::kFloat || (bf16_kv && k.scalar_type() == at::kBFloat16);
  TORCH_CHECK(q.scalar_type() == at::kFloat && kv_ok && v.scalar_type() == k.scalar_type(),
              "decode_attention: float32 q with float32 K and V", bf16_kv ? " (or bfloat16 K and V)" : "");
  const int64_t heads = q.size(1);
  TORCH_CHECK(k.size(3) == q.size(2) && k.stride(3) == 1 && kv_heads > 0 && heads % kv_heads == 0 &&
              heads / kv_heads <= 64, "decode_attention: bad shapes or strides");
  TORCH_CHECK(lens.scalar_type() == at::kLong && lens.dim() == 1 && lens.size(0) == q.size(0), "lens must be (B,) int64");
  const at::Tensor lc = lens.contiguous();
  const int64_t* len = lc.data_ptr<int64_t>();
  int64_t total = 0;
  for (int64_t b = 0; b < q.size(0); ++b) {
    TORCH_CHECK(len[b] >= 1 && len[b] <= max_len, "decode_attention: lens[", b, "] = ", len[b], " not in [1, ",
                max_len, "]");
    total += len[b];
  }
  return total;
}

// out (B, H, D) from make(b, g, scratch, out data), which runs task (sequence b, KV head g) with a (rep, max_len)
// scratch; tasks go to threads only above MIN_TASK_ROWS K rows per thread.
template <class Make>
at::Tensor run_tasks(const at::Tensor& q, int64_t kv_heads, int64_t rows, int64_t max_len, const Make& make) {
  const int64_t batch = q.size(0), rep = q.size(1) / kv_heads;
  at::Tensor out = at::empty({batch, q.size(1), q.size(2)}, q.options());
  const int64_t tasks = batch * kv_heads;
  const int64_t grain = rows <= MIN_TASK_ROWS ? tasks : std::max<int64_t>(1, tasks * MIN_TASK_ROWS / rows);
  auto work = [&](int64_t i0, int64_t i1) {
    std::vector<float> scratch(rep * max_len);
    for (int64_t i = i0; i < i1; ++i) make(i / kv_heads, i % kv_heads, scratch.data(), out.data_ptr<float>());
  };
  if (grain >= tasks)
    work(0, tasks);
  else
    at::parallel_for(0, tasks, grain, work);
  return out;
}

// q (B, H, D) fp32; k, v (B, KV, L, D) fp32 with unit stride in D and equal strides; lens (B,) int64 in [1, L]
// -> (B, H, D) fp32. Query head h reads KV head h / (H / KV).
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& lens,
                            int64_t isa) {
  TORCH_CHECK(k.dim() == 4 && k.size(0) == q.size(0), "decode_attention: k and v (B, KV, L, D)");
  const int64_t kv = k.size(1), max_len = k.size(2), heads = q.size(1), d = q.size(2), rep = heads / std::max<int64_t>(kv, 1);
  const int64_t rows = check(q, k, v, lens, kv, max_len, false) * kv;
  const HeadFn<float> head = head_fn<float>(isa, d);
  const at::Tensor qc = q.contiguous(), lc = lens.contiguous();
  const int64_t* len = lc.data_ptr<int64_t>();
  const float *qp = qc.data_ptr<float>(), *kp = k.data_ptr<float>(), *vp = v.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  return run_tasks(q, kv, rows, max_len, [&](int64_t b, int64_t g, float* scratch, float* op) {
    const int64_t off = b * k.stride(0) + g * k.stride(1);
    head(Head<float>{qp + (b * heads + g * rep) * d, kp + off, vp + off, k.stride(2), len[b], rep, d, scale, scratch,
                     op + (b * heads + g * rep) * d, nullptr, len[b], 0});
  });
}

template <class T>
at::Tensor paged(const at::Tensor& q, const T* kp, const T* vp, const at::Tensor& k, const int64_t* len,
                 const int64_t* pages, int64_t max_pages, int64_t rows, int64_t longest, int64_t isa) {
  const int64_t kv = k.size(0), heads = q.size(1), d = q.size(2), rep = heads / kv;
  const HeadFn<T> head = head_fn<T>(isa, d);
  const at::Tensor qc = q.contiguous();
  const float* qp = qc.data_ptr<float>();
  const float scale = 1.f / std::sqrt(static_cast<float>(d));
  return run_tasks(q, kv, rows, longest, [&](int64_t b, int64_t g, float* scratch, float* op) {
    const int64_t off = g * k.stride(0);
    head(Head<T>{qp + (b * heads + g * rep) * d, kp + off, vp + off, k.stride(2), len[b], rep, d, scale, scratch,
                 op + (b * heads + g * rep) * d, pages + b * max_pages, k.size(2), k.stride(1)});
  });
}

// q (B, H, D) fp32; k, v (KV, P, S, D) fp32 or bf16 pages of S tokens, unit stride in D and equal strides; page_table
// (B, M) int64 page ids in [0, P) (entries past a sequence's last page are not read); lens (B,) int64 in [1, M * S]
// -> (B, H, D) fp32. Token t of sequence b is row t % S of page page_table[b, t / S]; otherwise as decode_attention
// (bf16 K and V: as decode_attention over their exact fp32 values).
at::Tensor decode_attention_paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const at::Tensor& page_table, const at::Tensor& lens, int64_t isa) {
  TORCH_CHECK(k.dim() == 4 && page_table.dim() == 2 && page_table.size(0) == q.size(0) &&
              page_table.scalar_type() == at::kLong, "decode_attention_paged: k, v (KV, P, S, D), page_table (B, M) int64");
  const int64_t kv = k.size(0), num_pages = k.size(1), page = k.size(2), max_pages = page_table.size(1);
  const int64_t rows = check(q, k, v, lens, kv, max_pages * page, true) * kv;
  const at::Tensor lc = lens.contiguous(), pc = page_table.contiguous();
  const int64_t *len = lc.data_ptr<int64_t>(), *pages = pc.data_ptr<int64_t>();
  int64_t longest = 0;
  for (int64_t b = 0; b < q.size(0); ++b) {
    longest = std::max(longest, len[b]);
    for (int64_t i = 0; i < (len[b] + page - 1) / page; ++i)
      TORCH_CHECK(pages[b * max_pages + i] >= 0 && pages[b * max_pages + i] < num_pages,
                  "decode_attention_paged: page_table[", b, ", ", i, "] = ", pages[b * max_pages + i], " not in [0, ",
                  num_pages, ")");
  }
  if (k.scalar_type() == at::kBFloat16)
    return paged(q, reinterpret_cast<const uint16_t*>(k.data_ptr<at::BFloat16>()),
                 reinterpret_cast<const uint16_t*>(v.data_ptr<at::BFloat16>()), k, len, pages, max_pages, rows,
                 longest, isa);
  return paged(q, k.data_ptr<float>(), v.data_ptr<float>(), k, len, pages, max_pages, rows, longest, isa);
}

__attribute__((target("avx512f"))) void exp_block512(float* p) { _mm512_storeu_ps(p, exp16(_mm512_loadu_ps(p))); }
__attribute__((target("avx2,fma"))) void exp_block256(float* p) { _mm256_storeu_ps(p, exp8(_mm256_loadu_ps(p))); }

at::Tensor fast_exp(const at::Tensor& x, int64_t isa) {   // the vector paths' exp, for tests: x fp32 contiguous
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && supported(isa) && isa != SCALAR, "bad fast_exp");
  at::Tensor out = at::empty_like(x);
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t n = x.numel(), step = isa == AVX512 ? 16 : 8;
  std::vector<float> buf(step);
  for (int64_t i = 0; i < n; i += step) {
    std::fill(buf.begin(), buf.end(), 0.f);
    std::copy(xp + i, xp + std::min(n, i + step), buf.begin());
    (isa == AVX512 ? exp_block512 : exp_block256)(buf.data());
    std::copy(buf.begin(), buf.begin() + std::min(step, n - i), op + i);
  }
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(radixserve, m) {
  m.def("decode_attention(Tensor q, Tensor k, Tensor v, Tensor lens, int isa) -> Tensor");
  m.def("decode_attention_paged(Tensor q, Tensor k, Tensor v, Tensor page_table, Tensor lens, int isa) -> Tensor");
  m.def("decode_attention_supported(int isa) -> bool", &supported);
  m.def("decode_attention_exp(Tensor x, int isa) -> Tensor");
}

TORCH_LIBRARY_IMPL(radixserve, CPU, m) {
  m.impl("decode_attention", decode_attention);
  m.impl("decode_attention_paged", decode_attention_paged);
  m.impl("decode_attention_exp", fast_exp);
}
