// PiX channel fusion, forward and backward (CUDA). Semantics: DESIGN.md / seed 003 (official kernel):
//   y[b,g] = p[b,g] * (p[b,g] < tau ? max_k x[b,g*zeta+k] : mean_k x[b,g*zeta+k])
//   max branch: dx = p*dy at the FIRST arg-max channel, 0 elsewhere; mean branch: dx = p*dy/zeta everywhere;
//   dp[b,g] = sum_hw (max or mean) * dy.
// One pass: every kernel reads its inputs once and writes its outputs once; fp32 accumulation.
// NCHW: a block owns `ppb` whole (b, g) planes (ppb = 256 / items for small planes, else 1 plane looped),
// with vector loads along HW (the widest of 16/8/4/2 bytes that divides HW); dp is reduced in shared memory
// (segmented warp scans keyed by plane + one shared atomic per warp and plane) and written once per plane: no
// global atomics, no full-size intermediate.
// channels_last: a group's zeta channels are contiguous, so each thread loads one group as one vector;
// dp via per-block partial sums (B, chunks, G) and a tiny finalize kernel.
// Tried and dropped (H200, 2026-11-21): staging a block's planes in shared memory with 16-byte loads for small
// planes (7x7, 14x14 bf16) ran slower than this mapping (bf16 64x1024x14x14 fwd 0.0150 vs 0.0094 ms, bwd 0.0289
// vs 0.0164 ms; benchmarks/results/kernels_h200.json, meta.ab).
#include "common.cuh"

namespace {

using ck::from_f;
using ck::to_f;
using ck::Vec;

constexpr int kThreads = 256;

// ------------------------------------------------------------------------------------------------ NCHW
// Add `part` into red[lp] for every lane. lp is non-decreasing across the valid lanes of the warp (invalid lanes,
// lp = -1, come last): one shared atomic per warp when the warp lies in one plane, else a segmented inclusive
// warp scan keyed by lp and one atomic per (warp, plane) segment, from the segment's last lane. Never 32 lanes
// adding to the same slot (that serialises the shared atomics at plane boundaries).
__device__ __forceinline__ void seg_add(float* red, int lp, float part, bool valid) {
  constexpr unsigned kFull = 0xffffffffu;
  const int lane = threadIdx.x & 31;
  const int lp0 = __shfl_sync(kFull, lp, 0);
  if (__all_sync(kFull, lp == lp0)) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) part += __shfl_down_sync(kFull, part, off);
    if (lane == 0 && lp0 >= 0) atomicAdd(&red[lp0], part);
    return;
  }
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const float v = __shfl_up_sync(kFull, part, off);
    const int l = __shfl_up_sync(kFull, lp, off);
    if (lane >= off && l == lp) part += v;
  }
  const int lnext = __shfl_down_sync(kFull, lp, 1);
  if (valid && (lane == 31 || lnext != lp)) atomicAdd(&red[lp], part);
}

template <typename T, int VEC, int ZETA>
__global__ void __launch_bounds__(kThreads) pix_fwd_nchw(const T* __restrict__ x, const T* __restrict__ p,
                                                         T* __restrict__ y, int planes, int zeta_rt, int HW,
                                                         float tau, int ppb) {
  const int zeta = ZETA > 0 ? ZETA : zeta_rt;
  const int items = HW / VEC;
  const int plane0 = blockIdx.x * ppb;
  const int total = min(ppb, planes - plane0) * items;
  for (int e = threadIdx.x; e < total; e += blockDim.x) {
    const int lp = e / items;
    const int i = e - lp * items;
    const int64_t plane = plane0 + lp;
    const float pv = to_f(p[plane]);
    const bool use_max = pv < tau;
    const T* xp = x + plane * zeta * HW;
    float acc[VEC];
    Vec<T, VEC> v = reinterpret_cast<const Vec<T, VEC>*>(xp)[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = to_f(v.v[j]);
#pragma unroll
    for (int k = 1; k < zeta; ++k) {
      Vec<T, VEC> u = reinterpret_cast<const Vec<T, VEC>*>(xp + (int64_t)k * HW)[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float f = to_f(u.v[j]);
        acc[j] = use_max ? (f > acc[j] ? f : acc[j]) : acc[j] + f;
      }
    }
    Vec<T, VEC> o;
#pragma unroll
    for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(use_max ? pv * acc[j] : pv * (acc[j] / (float)zeta));
    reinterpret_cast<Vec<T, VEC>*>(y + plane * HW)[i] = o;
  }
}

template <typename T, int VEC, int ZETA>
__global__ void __launch_bounds__(kThreads) pix_bwd_nchw(const T* __restrict__ dy, const T* __restrict__ x,
                                                         const T* __restrict__ p, T* __restrict__ dx,
                                                         T* __restrict__ dp, int planes, int zeta_rt, int HW,
                                                         float tau, int ppb) {
  const int zeta = ZETA > 0 ? ZETA : zeta_rt;
  __shared__ float red[kThreads];
  const int items = HW / VEC;
  const int plane0 = blockIdx.x * ppb;
  const int np = min(ppb, planes - plane0);
  const int total = np * items;
  for (int i = threadIdx.x; i < np; i += blockDim.x) red[i] = 0.f;
  __syncthreads();
  for (int base = 0; base < total; base += blockDim.x) {  // uniform trip count: warps stay converged
    const int e = base + threadIdx.x;
    const bool valid = e < total;
    const int lp = valid ? e / items : -1;
    float part = 0.f;
    if (valid) {
      const int i = e - lp * items;
      const int64_t plane = plane0 + lp;
      const float pv = to_f(p[plane]);
      const bool use_max = pv < tau;
      const T* xp = x + plane * zeta * HW;
      T* dxp = dx + plane * zeta * HW;
      Vec<T, VEC> g = reinterpret_cast<const Vec<T, VEC>*>(dy + plane * HW)[i];
      float gv[VEC], best[VEC], sum[VEC];
      int arg[VEC];
      {
        Vec<T, VEC> v = reinterpret_cast<const Vec<T, VEC>*>(xp)[i];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          gv[j] = to_f(g.v[j]);
          best[j] = sum[j] = to_f(v.v[j]);
          arg[j] = 0;
        }
      }
#pragma unroll
      for (int k = 1; k < zeta; ++k) {
        Vec<T, VEC> u = reinterpret_cast<const Vec<T, VEC>*>(xp + (int64_t)k * HW)[i];
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          float f = to_f(u.v[j]);
          if (f > best[j]) { best[j] = f; arg[j] = k; }
          sum[j] += f;
        }
      }
      if (use_max) {
#pragma unroll
        for (int j = 0; j < VEC; ++j) part += best[j] * gv[j];
#pragma unroll
        for (int k = 0; k < zeta; ++k) {
          Vec<T, VEC> o;
#pragma unroll
          for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(arg[j] == k ? pv * gv[j] : 0.f);
          reinterpret_cast<Vec<T, VEC>*>(dxp + (int64_t)k * HW)[i] = o;
        }
      } else {
        Vec<T, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          part += (sum[j] / (float)zeta) * gv[j];
          o.v[j] = from_f<T>((pv * gv[j]) / (float)zeta);
        }
#pragma unroll
        for (int k = 0; k < zeta; ++k) reinterpret_cast<Vec<T, VEC>*>(dxp + (int64_t)k * HW)[i] = o;
      }
    }
    seg_add(red, lp, part, valid);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < np; i += blockDim.x) dp[plane0 + i] = from_f<T>(red[i]);
}

// ---------------------------------------------------------------------------------------- channels_last
// Thread per (b, hw, g): the group's zeta channels are x[idx*zeta ... idx*zeta+zeta), output y[idx].
template <typename T, int ZETA>
__global__ void pix_fwd_cl(const T* __restrict__ x, const T* __restrict__ p, T* __restrict__ y, int total, int G,
                           int zeta_rt, int HWG, float tau) {
  constexpr int ZN = ZETA > 0 ? ZETA : 1;
  const int zeta = ZETA > 0 ? ZETA : zeta_rt;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    const int g = idx % G;
    const int b = idx / HWG;
    const float pv = to_f(p[b * G + g]);
    float mx, s;
    if (ZETA > 0) {
      Vec<T, ZN> v = reinterpret_cast<const Vec<T, ZN>*>(x)[idx];
      mx = s = to_f(v.v[0]);
#pragma unroll
      for (int k = 1; k < ZN; ++k) {
        float f = to_f(v.v[k]);
        mx = f > mx ? f : mx;
        s += f;
      }
    } else {
      const T* xp = x + (int64_t)idx * zeta;
      mx = s = to_f(xp[0]);
      for (int k = 1; k < zeta; ++k) {
        float f = to_f(xp[k]);
        mx = f > mx ? f : mx;
        s += f;
      }
    }
    y[idx] = from_f<T>(pv < tau ? pv * mx : pv * (s / (float)zeta));
  }
}

// Block (32 groups) x (8 rows of positions); grid (G tiles, position chunks, B). Partials (B, chunks, G).
template <typename T, int ZETA>
__global__ void pix_bwd_cl(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ p,
                           T* __restrict__ dx, float* __restrict__ partial, int G, int zeta_rt, int HW, int chunk,
                           float tau) {
  constexpr int ZN = ZETA > 0 ? ZETA : 1;
  const int zeta = ZETA > 0 ? ZETA : zeta_rt;
  __shared__ float red[8][33];
  const int g = blockIdx.x * 32 + threadIdx.x;
  const int b = blockIdx.z;
  const int h0 = blockIdx.y * chunk;
  const int h1 = min(h0 + chunk, HW);
  float part = 0.f;
  if (g < G) {
    const float pv = to_f(p[b * G + g]);
    const bool use_max = pv < tau;
    for (int hw = h0 + threadIdx.y; hw < h1; hw += 8) {
      const int64_t idx = ((int64_t)b * HW + hw) * G + g;
      const float gv = to_f(dy[idx]);
      float best, s;
      int arg = 0;
      if (ZETA > 0) {
        Vec<T, ZN> v = reinterpret_cast<const Vec<T, ZN>*>(x)[idx];
        best = s = to_f(v.v[0]);
#pragma unroll
        for (int k = 1; k < ZN; ++k) {
          float f = to_f(v.v[k]);
          if (f > best) { best = f; arg = k; }
          s += f;
        }
        Vec<T, ZN> o;
        if (use_max) {
#pragma unroll
          for (int k = 0; k < ZN; ++k) o.v[k] = from_f<T>(k == arg ? pv * gv : 0.f);
        } else {
          const T d = from_f<T>((pv * gv) / (float)ZN);
#pragma unroll
          for (int k = 0; k < ZN; ++k) o.v[k] = d;
        }
        reinterpret_cast<Vec<T, ZN>*>(dx)[idx] = o;
      } else {
        const T* xp = x + idx * zeta;
        T* dxp = dx + idx * zeta;
        best = s = to_f(xp[0]);
        for (int k = 1; k < zeta; ++k) {
          float f = to_f(xp[k]);
          if (f > best) { best = f; arg = k; }
          s += f;
        }
        const T d = from_f<T>((pv * gv) / (float)zeta);
        for (int k = 0; k < zeta; ++k) dxp[k] = use_max ? from_f<T>(k == arg ? pv * gv : 0.f) : d;
      }
      part += use_max ? best * gv : (s / (float)zeta) * gv;
    }
  }
  red[threadIdx.y][threadIdx.x] = part;
  __syncthreads();
  if (threadIdx.y == 0 && g < G) {
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < 8; ++r) s += red[r][threadIdx.x];
    partial[((int64_t)b * gridDim.y + blockIdx.y) * G + g] = s;
  }
}

template <typename T>
__global__ void pix_dp_finalize(const float* __restrict__ partial, T* __restrict__ dp, int BG, int G, int chunks) {
  for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < BG; i += gridDim.x * blockDim.x) {
    const int b = i / G;
    const int g = i % G;
    float s = 0.f;
    for (int c = 0; c < chunks; ++c) s += partial[((int64_t)b * chunks + c) * G + g];
    dp[i] = from_f<T>(s);
  }
}

void check_inputs(const at::Tensor& x, const at::Tensor& p, int64_t zeta, const char* op) {
  TORCH_CHECK(x.is_cuda() && p.is_cuda(), op, ": tensors 'x' and 'p' must be CUDA tensors");
  TORCH_CHECK(x.dim() == 4, op, ": tensor 'x' must be 4-D");
  TORCH_CHECK(zeta >= 1 && x.size(1) % zeta == 0, op, ": the channels of tensor 'x' are not divisible by zeta");
  TORCH_CHECK(p.numel() == x.size(0) * (x.size(1) / zeta), op, ": tensor 'p' must have B*C/zeta elements");
  TORCH_CHECK(p.scalar_type() == x.scalar_type(), op, ": 'p' and 'x' must have the same dtype");
  TORCH_CHECK(x.numel() < ((int64_t)1 << 31) - 1, op, ": tensor 'x' has too many elements for the kernel (2^31)");
}

template <typename F>
void with_zeta(int64_t zeta, F&& f) {  // f(std::integral_constant<int, Z>), Z in {2, 4} or 0 (runtime zeta)
  switch (zeta) {
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    default: f(std::integral_constant<int, 0>{}); break;
  }
}

// Widest vector (elements) that divides HW and keeps every plane aligned: 16 bytes at most.
template <typename T, typename F>
void with_vec(int64_t HW, std::initializer_list<const void*> ptrs, F&& f) {
  int v = 16 / (int)sizeof(T);
  while (v > 1) {
    bool ok = HW % v == 0;
    for (const void* q : ptrs) ok = ok && ck::aligned(q, v * (int)sizeof(T));
    if (ok) break;
    v /= 2;
  }
  switch (v) {
    case 8: if constexpr (sizeof(T) <= 2) { f(std::integral_constant<int, 8>{}); break; } [[fallthrough]];
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    default: f(std::integral_constant<int, 1>{}); break;
  }
}

int planes_per_block(int64_t items) { return items >= kThreads ? 1 : (int)(kThreads / items); }

}  // namespace

at::Tensor pix_forward(const at::Tensor& x, const at::Tensor& p, int64_t zeta, double tau, bool cl) {
  check_inputs(x, p, zeta, "compress::pix");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), G = C / zeta, HW = H * W;
  auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  TORCH_CHECK(x.is_contiguous(fmt), "compress::pix: tensor 'x' must be contiguous in the requested layout");
  auto y = at::empty({B, G, H, W}, x.options().memory_format(fmt));
  if (y.numel() == 0) return y;
  auto stream = at::cuda::getCurrentCUDAStream();
  const float ftau = (float)tau;
  CK_DISPATCH(x.scalar_type(), "pix_forward", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* pp = p.data_ptr<scalar_t>();
    scalar_t* yp = y.data_ptr<scalar_t>();
    if (cl) {
      with_zeta(zeta, [&](auto Z) {
        constexpr int ZV = decltype(Z)::value;
        const int total = (int)(B * HW * G);
        const bool vec_ok = ZV > 0 && ck::aligned(xp, sizeof(scalar_t) * (ZV > 0 ? ZV : 1));
        const unsigned grid = ck::grid_for(total, kThreads, 32);
        if (vec_ok)
          pix_fwd_cl<scalar_t, ZV><<<grid, kThreads, 0, stream>>>(xp, pp, yp, total, (int)G, (int)zeta, (int)(HW * G), ftau);
        else
          pix_fwd_cl<scalar_t, 0><<<grid, kThreads, 0, stream>>>(xp, pp, yp, total, (int)G, (int)zeta, (int)(HW * G), ftau);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    } else {
      with_vec<scalar_t>(HW, {xp, yp}, [&](auto V) {
        constexpr int VV = decltype(V)::value;
        with_zeta(zeta, [&](auto Z) {
          constexpr int ZV = decltype(Z)::value;
          const int planes = (int)(B * G);
          const int ppb = planes_per_block(HW / VV);
          const unsigned grid = (unsigned)ck::ceil_div(planes, ppb);
          pix_fwd_nchw<scalar_t, VV, ZV><<<grid, kThreads, 0, stream>>>(xp, pp, yp, planes, (int)zeta, (int)HW, ftau, ppb);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
    }
  });
  return y;
}

std::vector<at::Tensor> pix_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& p, int64_t zeta,
                                     double tau, bool cl) {
  check_inputs(x, p, zeta, "compress::pix_backward");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3), G = C / zeta, HW = H * W;
  auto fmt = cl ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous;
  TORCH_CHECK(x.is_contiguous(fmt) && dy.is_contiguous(fmt),
              "compress::pix_backward: tensors 'x' and 'grad' must be contiguous in the requested layout");
  TORCH_CHECK(dy.scalar_type() == x.scalar_type(), "compress::pix_backward: 'grad' and 'x' must have the same dtype");
  auto dx = at::empty_like(x, x.options().memory_format(fmt));
  auto dp = at::empty({B, G, 1, 1}, p.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) {
    dp.zero_();
    return {dx, dp};
  }
  auto stream = at::cuda::getCurrentCUDAStream();
  const float ftau = (float)tau;
  CK_DISPATCH(x.scalar_type(), "pix_backward", [&] {
    const scalar_t* xp = x.data_ptr<scalar_t>();
    const scalar_t* gp = dy.data_ptr<scalar_t>();
    const scalar_t* pp = p.data_ptr<scalar_t>();
    scalar_t* dxp = dx.data_ptr<scalar_t>();
    scalar_t* dpp = dp.data_ptr<scalar_t>();
    if (cl) {
      const int gt = (int)ck::ceil_div(G, 32);
      int64_t chunks = ck::ceil_div((int64_t)ck::num_sms() * 8, (int64_t)gt * B);  // ~8 blocks per SM
      chunks = std::max<int64_t>(1, std::min<int64_t>(chunks, ck::ceil_div(HW, 32)));
      const int64_t chunk = ck::ceil_div(HW, chunks);
      chunks = ck::ceil_div(HW, chunk);
      auto partial = at::empty({B, chunks, G}, x.options().dtype(at::kFloat));
      dim3 grid(gt, (unsigned)chunks, (unsigned)B), block(32, 8);
      with_zeta(zeta, [&](auto Z) {
        constexpr int ZV = decltype(Z)::value;
        const bool vec_ok = ZV > 0 && ck::aligned(xp, sizeof(scalar_t) * (ZV > 0 ? ZV : 1)) &&
                            ck::aligned(dxp, sizeof(scalar_t) * (ZV > 0 ? ZV : 1));
        if (vec_ok)
          pix_bwd_cl<scalar_t, ZV><<<grid, block, 0, stream>>>(gp, xp, pp, dxp, partial.data_ptr<float>(), (int)G,
                                                               (int)zeta, (int)HW, (int)chunk, ftau);
        else
          pix_bwd_cl<scalar_t, 0><<<grid, block, 0, stream>>>(gp, xp, pp, dxp, partial.data_ptr<float>(), (int)G,
                                                              (int)zeta, (int)HW, (int)chunk, ftau);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      pix_dp_finalize<scalar_t><<<ck::grid_for(B * G, kThreads), kThreads, 0, stream>>>(
          partial.data_ptr<float>(), dpp, (int)(B * G), (int)G, (int)chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      with_vec<scalar_t>(HW, {xp, dxp, gp}, [&](auto V) {
        constexpr int VV = decltype(V)::value;
        with_zeta(zeta, [&](auto Z) {
          constexpr int ZV = decltype(Z)::value;
          const int planes = (int)(B * G);
          const int ppb = planes_per_block(HW / VV);
          const unsigned grid = (unsigned)ck::ceil_div(planes, ppb);
          pix_bwd_nchw<scalar_t, VV, ZV><<<grid, kThreads, 0, stream>>>(gp, xp, pp, dxp, dpp, planes, (int)zeta,
                                                                        (int)HW, ftau, ppb);
          C10_CUDA_KERNEL_LAUNCH_CHECK();
        });
      });
    }
  });
  return {dx, dp};
}
