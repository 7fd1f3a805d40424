// radixserve::decode_attention: one query token per sequence over its first lens[b] mirrored tokens, fp32;
// radixserve::decode_attention_paged: the same over the paged KV cache through a page table.
// Contract and numerics bound: radixserve/runner/attention/decode_kernel.py and docs/runner.md, "Decode attention".
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include "decode_attention_math.h"

namespace {

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
