// Shared helpers for the compress kernels (CUDA). Kernel bodies only; schemas/autograd live in Python.
#pragma once
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cstdint>

namespace ck {

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

template <typename T>
__device__ __forceinline__ float to_f(T v) { return static_cast<float>(v); }

template <typename T>
__device__ __forceinline__ T from_f(float v) { return static_cast<T>(v); }

inline int num_sms() { return at::cuda::getCurrentDeviceProperties()->multiProcessorCount; }

inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Blocks for a grid-stride loop over `total` items with `threads` per block.
inline unsigned int grid_for(int64_t total, int threads, int per_sm = 16) {
  int64_t b = ceil_div(total, threads);
  int64_t cap = (int64_t)num_sms() * per_sm;
  if (b > cap) b = cap;
  if (b < 1) b = 1;
  return (unsigned int)b;
}

inline bool aligned(const void* p, int bytes) { return (reinterpret_cast<uintptr_t>(p) % bytes) == 0; }

// Copy n words of type W (uint2, uint4) from global src to shared dst with one warp (lanes strided), LOADS loads
// in flight per lane before any store. The caller syncs (__syncwarp) before reading dst.
template <int LOADS, typename W>
__device__ __forceinline__ void warp_copy(W* dst, const W* __restrict__ src, int n, int lane) {
  for (int base = 0; base < n; base += 32 * LOADS) {
    W r[LOADS];
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int i = base + j * 32 + lane;
      if (i < n) r[j] = src[i];
    }
#pragma unroll
    for (int j = 0; j < LOADS; ++j) {
      const int i = base + j * 32 + lane;
      if (i < n) dst[i] = r[j];
    }
  }
}

// n words of type W (uint2, uint4) from shared src to global dst with one warp, lanes strided (coalesced).
template <typename W>
__device__ __forceinline__ void warp_store(W* __restrict__ dst, const W* src, int n, int lane) {
  for (int i = lane; i < n; i += 32) dst[i] = src[i];
}

}  // namespace ck

// float32 / float16 / bfloat16 only (float64 takes the PyTorch path in Python).
#define CK_DISPATCH(TYPE, NAME, ...)                                \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                    \
                     AT_DISPATCH_CASE(at::ScalarType::Float, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::ScalarType::Half, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::ScalarType::BFloat16, __VA_ARGS__))
