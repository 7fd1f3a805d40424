// Shared by the int4 kernels: the packed layout of radixserve/layers/int4_int8.py's pack(), scale loads, and the
// thread / row-tile loop (q8_fp32.cpp uses COLS, BLOCK, TILE, the loads and run_groups).
// Columns go in groups of COLS, K in blocks of BLOCK; a group's block is 256 code bytes
// (4 words x 64 bytes: byte 4c + j of word p holds column c's codes 4p + j (low nibble) and 4(p + 4) + j (high)).
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstring>

namespace radixserve_int4 {

constexpr int COLS = 16, BLOCK = 32, TILE = 32, BLOCK_BYTES = 256;

inline float to_float(float v) { return v; }
inline float to_float(at::Half v) { return static_cast<float>(v); }

__attribute__((target("avx2,f16c"))) inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
__attribute__((target("avx2,f16c"))) inline __m256 load8(const at::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
__attribute__((target("avx512f"))) inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
__attribute__((target("avx512f"))) inline __m512 load16(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// Checks shared by the ops: x (M, K) fp32; packed (G, K / 32, 4, 64) uint8; scales (G, K / 32, 2, 16) fp32 or fp16.
inline void check_operands(const char* op, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scales,
                           int64_t n) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, op, ": x must be (M, K) float32");
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 4 && packed.is_contiguous(), op, ": bad packed");
  TORCH_CHECK((scales.scalar_type() == at::kFloat || scales.scalar_type() == at::kHalf) && scales.is_contiguous(),
              op, ": scales must be float32 or float16");
  const int64_t k = x.size(1), groups = packed.size(0), nb = k / BLOCK;
  TORCH_CHECK(k % BLOCK == 0 && packed.size(1) == nb && scales.numel() == groups * nb * 2 * COLS, op, ": bad K");
  TORCH_CHECK(n > (groups - 1) * COLS && n <= groups * COLS, op, ": bad n");
}

// f(s) with s the scales' data as `const float*` or `const at::Half*` (each op's checks allow only those two).
template <typename F>
void with_scales(const at::Tensor& scales, const F& f) {
  if (scales.scalar_type() == at::kHalf)
    f(scales.data_ptr<at::Half>());
  else
    f(scales.data_ptr<float>());
}

// Threads split the column groups; rows go in tiles of TILE. group(g, r0, r1, acc) adds group g's columns of rows
// [r0, r1) into the zeroed acc (TILE x COLS fp32); the first n columns of y (M, n) receive them.
template <typename Group>
void run_groups(const Group& group, int64_t m, int64_t n, int64_t groups, float* y) {
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    alignas(64) float acc[TILE * COLS];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t cols = std::min<int64_t>(COLS, n - g * COLS);
      for (int64_t r0 = 0; r0 < m; r0 += TILE) {
        const int64_t r1 = std::min(m, r0 + TILE);
        std::fill(acc, acc + TILE * COLS, 0.f);
        group(g, r0, r1, acc);
        for (int64_t r = r0; r < r1; ++r)
          std::memcpy(y + r * n + g * COLS, acc + (r - r0) * COLS, cols * sizeof(float));
      }
    }
  });
}

}  // namespace radixserve_int4

// Shared by the fp32-activation kernels (int4_fp32.cpp, q8_fp32.cpp): ISA numbers, the fixed block order, and the
// product-and-add step that keeps each mul and add rounding once (never an FMA).
namespace radixserve_fp32 {

using radixserve_int4::BLOCK;
enum Isa : int64_t { SCALAR = 0, AVX2 = 1, AVX512 = 2 };

inline bool supported(int64_t isa) {
  __builtin_cpu_init();
  if (isa == AVX512) return __builtin_cpu_supports("avx512f");
  if (isa == AVX2) return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
  return isa == SCALAR;
}

// Four partial sums over k % 4, each in k order from its first term, then (s0 + s1) + (s2 + s3).
inline float block_sum(const float* v) {
  float s[4] = {v[0], v[1], v[2], v[3]};
  for (int k = 4; k < BLOCK; ++k) s[k % 4] = s[k % 4] + v[k];
  return (s[0] + s[1]) + (s[2] + s[3]);
}

// part = q * x (FIRST) or part + q * x, x broadcast from memory: two instructions, each rounding once. Written as
// intrinsics, GCC hoists all of a block's multiplies ahead of the adds and spills the products to the stack
// (measured 2-2.5x slower at 4 rows a pass); one asm statement keeps each product beside its add.
template <bool FIRST>
__attribute__((target("avx512f"), always_inline)) inline void mul_add(__m512& part, __m512 q, const float* x) {
  if (FIRST) {
    asm("vmulps %2%{1to16%}, %1, %0" : "=v"(part) : "v"(q), "m"(*x));
  } else {
    __m512 prod;
    asm("vmulps %3%{1to16%}, %2, %1\n\tvaddps %1, %0, %0" : "+v"(part), "=&v"(prod) : "v"(q), "m"(*x));
  }
}

// AVX2 form of mul_add (8 lanes, x broadcast first).
template <bool FIRST>
__attribute__((target("avx2"), always_inline)) inline void mul_add8(__m256& part, __m256 q, const float* x) {
  __m256 prod;
  if (FIRST)
    asm("vbroadcastss %2, %0\n\tvmulps %0, %1, %0" : "=&x"(part) : "x"(q), "m"(*x));
  else
    asm("vbroadcastss %3, %1\n\tvmulps %1, %2, %1\n\tvaddps %1, %0, %0" : "+x"(part), "=&x"(prod) : "x"(q), "m"(*x));
}

}  // namespace radixserve_fp32
