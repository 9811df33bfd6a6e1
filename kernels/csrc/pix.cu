// PiX channel fusion, forward and backward (CUDA). Semantics: DESIGN.md / seed 003 (official kernel):
//   y[b,g] = p[b,g] * (p[b,g] < tau ? max_k x[b,g*zeta+k] : mean_k x[b,g*zeta+k])
//   max branch: dx = p*dy at the FIRST arg-max channel, 0 elsewhere; mean branch: dx = p*dy/zeta everywhere;
//   dp[b,g] = sum_hw (max or mean) * dy.
// One pass: every kernel reads its inputs once and writes its outputs once; fp32 accumulation.
// NCHW: a group of `tpp` threads owns one (b, g) plane, vector loads along HW; dp is a block reduction
// written directly (no atomics, no full-size intermediate). channels_last: a group's zeta channels are
// contiguous, so each thread loads one group as one vector; dp via per-block partials + a tiny finalize.
#include "common.cuh"

namespace {

using ck::from_f;
using ck::to_f;
using ck::Vec;

// ------------------------------------------------------------------------------------------------ NCHW
template <typename T, int VEC, int ZETA>
__global__ void pix_fwd_nchw(const T* __restrict__ x, const T* __restrict__ p, T* __restrict__ y, int64_t planes,
                             int zeta_rt, int64_t HW, float tau, int tpp) {
  const int zeta = ZETA > 0 ? ZETA : zeta_rt;
  const int ppb = blockDim.x / tpp;
  const int64_t plane = (int64_t)blockIdx.x * ppb + threadIdx.x / tpp;
  const int lane = threadIdx.x % tpp;
  if (plane >= planes) return;
  const float pv = to_f(p[plane]);
  const bool use_max = pv < tau;
  const T* xp = x + plane * zeta * HW;
  T* yp = y + plane * HW;
  const int64_t nvec = HW / VEC;
  for (int64_t i = lane; i < nvec; i += tpp) {
    float acc[VEC];
    Vec<T, VEC> v = reinterpret_cast<const Vec<T, VEC>*>(xp)[i];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = to_f(v.v[j]);
#pragma unroll
    for (int k = 1; k < zeta; ++k) {
      Vec<T, VEC> u = reinterpret_cast<const Vec<T, VEC>*>(xp + k * HW)[i];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        float f = to_f(u.v[j]);
        acc[j] = use_max ? (f > acc[j] ? f : acc[j]) : acc[j] + f;
      }
    }
    Vec<T, VEC> o;
    if (use_max) {
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(pv * acc[j]);
    } else {
#pragma unroll
      for (int j = 0; j < VEC; ++j) o.v[j] = from_f<T>(pv * (acc[j] / (float)zeta));
    }
    reinterpret_cast<Vec<T, VEC>*>(yp)[i] = o;
  }
}

template <typename T, int VEC, int ZETA>
__global__ void pix_bwd_nchw(const T* __restrict__ dy, const T* __restrict__ x, const T* __restrict__ p,
                             T* __restrict__ dx, T* __restrict__ dp, int64_t planes, int zeta_rt, int64_t HW,
                             float tau, int tpp) {
  const int zeta = ZETA > 0 ? ZETA : zeta_rt;
  __shared__ float red[32];
  const int ppb = blockDim.x / tpp;
  const int64_t plane = (int64_t)blockIdx.x * ppb + threadIdx.x / tpp;
  const int lane = threadIdx.x % tpp;
  float part = 0.f;
  if (plane < planes) {
    const float pv = to_f(p[plane]);
    const bool use_max = pv < tau;
    const T* xp = x + plane * zeta * HW;
    T* dxp = dx + plane * zeta * HW;
    const T* dyp = dy + plane * HW;
    const int64_t nvec = HW / VEC;
    for (int64_t i = lane; i < nvec; i += tpp) {
      Vec<T, VEC> g = reinterpret_cast<const Vec<T, VEC>*>(dyp)[i];
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
        Vec<T, VEC> u = reinterpret_cast<const Vec<T, VEC>*>(xp + k * HW)[i];
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
          reinterpret_cast<Vec<T, VEC>*>(dxp + k * HW)[i] = o;
        }
      } else {
        Vec<T, VEC> o;
#pragma unroll
        for (int j = 0; j < VEC; ++j) {
          part += (sum[j] / (float)zeta) * gv[j];
          o.v[j] = from_f<T>((pv * gv[j]) / (float)zeta);
        }
        for (int k = 0; k < zeta; ++k) reinterpret_cast<Vec<T, VEC>*>(dxp + k * HW)[i] = o;
      }
    }
  }
  // Reduce `part` over the tpp threads of this plane (tpp is a multiple of 32).
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) part += __shfl_down_sync(0xffffffffu, part, off);
  const int warp = threadIdx.x / 32;
  if (tpp == 32) {
    if ((threadIdx.x & 31) == 0 && plane < planes) dp[plane] = from_f<T>(part);
    return;
  }
  if ((threadIdx.x & 31) == 0) red[warp] = part;
  __syncthreads();
  if (lane == 0 && plane < planes) {
    float s = 0.f;
    const int w0 = warp, nw = tpp / 32;
    for (int w = 0; w < nw; ++w) s += red[w0 + w];
    dp[plane] = from_f<T>(s);
  }
}

// ---------------------------------------------------------------------------------------- channels_last
// Thread per (b, hw, g): the group's zeta channels are x[idx*zeta ... idx*zeta+zeta), output y[idx].
template <typename T, int ZETA>
__global__ void pix_fwd_cl(const T* __restrict__ x, const T* __restrict__ p, T* __restrict__ y, int64_t total,
                           int G, int zeta_rt, int64_t HW, float tau) {
  const int zeta = ZETA > 0 ? ZETA : zeta_rt;
  for (int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; idx < total;
       idx += (int64_t)gridDim.x * blockDim.x) {
    const int g = idx % G;
    const int64_t b = idx / ((int64_t)HW * G);
    const float pv = to_f(p[b * G + g]);
    float mx, s;
    if (ZETA > 0) {
      Vec<T, (ZETA > 0 ? ZETA : 1)> v = reinterpret_cast<const Vec<T, (ZETA > 0 ? ZETA : 1)>*>(x)[idx];
      mx = s = to_f(v.v[0]);
#pragma unroll
      for (int k = 1; k < (ZETA > 0 ? ZETA : 1); ++k) {
        float f = to_f(v.v[k]);
        mx = f > mx ? f : mx;
        s += f;
      }
    } else {
      const T* xp = x + idx * zeta;
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
                           T* __restrict__ dx, float* __restrict__ partial, int G, int zeta_rt, int64_t HW,
                           int64_t chunk, float tau) {
  constexpr int ZN = ZETA > 0 ? ZETA : 1;
  const int zeta = ZETA > 0 ? ZETA : zeta_rt;
  __shared__ float red[8][33];
  const int g = blockIdx.x * 32 + threadIdx.x;
  const int64_t b = blockIdx.z;
  const int64_t h0 = (int64_t)blockIdx.y * chunk;
  const int64_t h1 = min(h0 + chunk, HW);
  float part = 0.f;
  if (g < G) {
    const float pv = to_f(p[b * G + g]);
    const bool use_max = pv < tau;
    for (int64_t hw = h0 + threadIdx.y; hw < h1; hw += 8) {
      const int64_t idx = (b * HW + hw) * G + g;
      const float gv = to_f(dy[idx]);
      if (ZETA > 0) {
        Vec<T, ZN> v = reinterpret_cast<const Vec<T, ZN>*>(x)[idx];
        float best = to_f(v.v[0]), s = best;
        int arg = 0;
#pragma unroll
        for (int k = 1; k < ZN; ++k) {
          float f = to_f(v.v[k]);
          if (f > best) { best = f; arg = k; }
          s += f;
        }
        Vec<T, ZN> o;
        if (use_max) {
          part += best * gv;
#pragma unroll
          for (int k = 0; k < ZN; ++k) o.v[k] = from_f<T>(k == arg ? pv * gv : 0.f);
        } else {
          part += (s / (float)ZN) * gv;
          const T d = from_f<T>((pv * gv) / (float)ZN);
#pragma unroll
          for (int k = 0; k < ZN; ++k) o.v[k] = d;
        }
        reinterpret_cast<Vec<T, ZN>*>(dx)[idx] = o;
      } else {
        const T* xp = x + idx * zeta;
        T* dxp = dx + idx * zeta;
        float best = to_f(xp[0]), s = best;
        int arg = 0;
        for (int k = 1; k < zeta; ++k) {
          float f = to_f(xp[k]);
          if (f > best) { best = f; arg = k; }
          s += f;
        }
        if (use_max) {
          part += best * gv;
          for (int k = 0; k < zeta; ++k) dxp[k] = from_f<T>(k == arg ? pv * gv : 0.f);
        } else {
          part += (s / (float)zeta) * gv;
          const T d = from_f<T>((pv * gv) / (float)zeta);
          for (int k = 0; k < zeta; ++k) dxp[k] = d;
        }
      }
    }
  }
  red[threadIdx.y][threadIdx.x] = part;
  __syncthreads();
  if (threadIdx.y == 0 && g < G) {
    float s = 0.f;
#pragma unroll
    for (int r = 0; r < 8; ++r) s += red[r][threadIdx.x];
    partial[(b * gridDim.y + blockIdx.y) * G + g] = s;
  }
}

template <typename T>
__global__ void pix_dp_finalize(const float* __restrict__ partial, T* __restrict__ dp, int64_t BG, int G,
                                int chunks) {
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < BG; i += (int64_t)gridDim.x * blockDim.x) {
    const int64_t b = i / G;
    const int g = i % G;
    float s = 0.f;
    for (int c = 0; c < chunks; ++c) s += partial[(b * chunks + c) * G + g];
    dp[i] = from_f<T>(s);
  }
}

int threads_per_plane(int64_t nvec) {
  int t = 32;
  while (t < 256 && t < nvec) t *= 2;
  return t;
}

void check_inputs(const at::Tensor& x, const at::Tensor& p, int64_t zeta, const char* op) {
  TORCH_CHECK(x.is_cuda() && p.is_cuda(), op, ": tensors 'x' and 'p' must be CUDA tensors");
  TORCH_CHECK(x.dim() == 4, op, ": tensor 'x' must be 4-D");
  TORCH_CHECK(zeta >= 1 && x.size(1) % zeta == 0, op, ": the channels of tensor 'x' are not divisible by zeta");
  TORCH_CHECK(p.numel() == x.size(0) * (x.size(1) / zeta), op, ": tensor 'p' must have B*C/zeta elements");
  TORCH_CHECK(p.scalar_type() == x.scalar_type(), op, ": 'p' and 'x' must have the same dtype");
}

template <typename F>
void with_zeta(int64_t zeta, F&& f) {
  // f(std::integral_constant<int, Z>) with Z in {2, 4, 8} or 0 (runtime zeta)
  switch (zeta) {
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 8: f(std::integral_constant<int, 8>{}); break;
    default: f(std::integral_constant<int, 0>{}); break;
  }
}

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
        const int64_t total = B * HW * G;
        const bool vec_ok = ZV > 0 && ck::aligned(xp, sizeof(scalar_t) * (ZV > 0 ? ZV : 1));
        const unsigned grid = ck::grid_for(total, 256, 32);
        if (vec_ok)
          pix_fwd_cl<scalar_t, ZV><<<grid, 256, 0, stream>>>(xp, pp, yp, total, G, zeta, HW, ftau);
        else
          pix_fwd_cl<scalar_t, 0><<<grid, 256, 0, stream>>>(xp, pp, yp, total, G, zeta, HW, ftau);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    } else {
      constexpr int V = 16 / sizeof(scalar_t) > 8 ? 8 : 16 / sizeof(scalar_t);
      const bool vec = HW % V == 0 && ck::aligned(xp, 16) && ck::aligned(yp, 16);
      with_zeta(zeta, [&](auto Z) {
        constexpr int ZV = decltype(Z)::value;
        const int64_t planes = B * G;
        if (vec) {
          const int tpp = threads_per_plane(HW / V);
          const unsigned grid = (unsigned)ck::ceil_div(planes, 256 / tpp);
          pix_fwd_nchw<scalar_t, V, ZV><<<grid, 256, 0, stream>>>(xp, pp, yp, planes, zeta, HW, ftau, tpp);
        } else {
          const int tpp = threads_per_plane(HW);
          const unsigned grid = (unsigned)ck::ceil_div(planes, 256 / tpp);
          pix_fwd_nchw<scalar_t, 1, ZV><<<grid, 256, 0, stream>>>(xp, pp, yp, planes, zeta, HW, ftau, tpp);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
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
      // enough blocks to fill the GPU: ~8 per SM
      int64_t chunks = ck::ceil_div((int64_t)ck::num_sms() * 8, (int64_t)gt * B);
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
          pix_bwd_cl<scalar_t, ZV><<<grid, block, 0, stream>>>(gp, xp, pp, dxp, partial.data_ptr<float>(), G, zeta,
                                                               HW, chunk, ftau);
        else
          pix_bwd_cl<scalar_t, 0><<<grid, block, 0, stream>>>(gp, xp, pp, dxp, partial.data_ptr<float>(), G, zeta,
                                                              HW, chunk, ftau);
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
      pix_dp_finalize<scalar_t><<<ck::grid_for(B * G, 256), 256, 0, stream>>>(partial.data_ptr<float>(), dpp,
                                                                              B * G, G, (int)chunks);
      C10_CUDA_KERNEL_LAUNCH_CHECK();
    } else {
      constexpr int V = 16 / sizeof(scalar_t) > 8 ? 8 : 16 / sizeof(scalar_t);
      const bool vec = HW % V == 0 && ck::aligned(xp, 16) && ck::aligned(dxp, 16) && ck::aligned(gp, 16);
      with_zeta(zeta, [&](auto Z) {
        constexpr int ZV = decltype(Z)::value;
        const int64_t planes = B * G;
        if (vec) {
          const int tpp = threads_per_plane(HW / V);
          const unsigned grid = (unsigned)ck::ceil_div(planes, 256 / tpp);
          pix_bwd_nchw<scalar_t, V, ZV><<<grid, 256, 0, stream>>>(gp, xp, pp, dxp, dpp, planes, zeta, HW, ftau, tpp);
        } else {
          const int tpp = threads_per_plane(HW);
          const unsigned grid = (unsigned)ck::ceil_div(planes, 256 / tpp);
          pix_bwd_nchw<scalar_t, 1, ZV><<<grid, 256, 0, stream>>>(gp, xp, pp, dxp, dpp, planes, zeta, HW, ftau, tpp);
        }
        C10_CUDA_KERNEL_LAUNCH_CHECK();
      });
    }
  });
  return {dx, dp};
}
