// im2col / col2im (seed 002's kernels, with any input strides, so channels_last needs no copy).
// cols layout: (n, C*KH*KW, Ho*Wo), rows ordered (c, kh, kw) like weight.reshape(O, -1) and F.unfold.
// col2im gathers (one thread per input element, no atomics, deterministic).
#include "common.cuh"

namespace {

using ck::from_f;
using ck::to_f;

template <typename T>
__global__ void im2col_kernel(const T* __restrict__ x, T* __restrict__ cols, int total, int C, int H, int W,
                              int KH, int KW, int Ho, int Wo, int sh, int sw, int ph, int pw, int dh, int dw,
                              int64_t sN, int64_t sC, int64_t sH, int64_t sW) {
  const int L = Ho * Wo;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    const int l = idx % L;
    int t = idx / L;
    const int kw = t % KW; t /= KW;
    const int kh = t % KH; t /= KH;
    const int c = t % C;
    const int64_t n = t / C;
    const int ho = l / Wo, wo = l % Wo;
    const int hi = ho * sh - ph + kh * dh, wi = wo * sw - pw + kw * dw;
    cols[idx] = (hi >= 0 && hi < H && wi >= 0 && wi < W) ? x[n * sN + c * sC + hi * sH + wi * sW] : from_f<T>(0.f);
  }
}

template <typename T>
__global__ void col2im_kernel(const T* __restrict__ cols, T* __restrict__ x, int total, int C, int H, int W,
                              int KH, int KW, int Ho, int Wo, int sh, int sw, int ph, int pw, int dh, int dw) {
  const int64_t L = (int64_t)Ho * Wo;
  for (int idx = blockIdx.x * blockDim.x + threadIdx.x; idx < total; idx += gridDim.x * blockDim.x) {
    const int wi = idx % W;
    const int t = idx / W;
    const int hi = t % H;
    const int64_t nc = t / H;  // n * C + c
    float acc = 0.f;
    for (int kh = 0; kh < KH; ++kh) {
      const int th = hi + ph - kh * dh;
      if (th < 0 || th % sh) continue;
      const int ho = th / sh;
      if (ho >= Ho) continue;
      for (int kw = 0; kw < KW; ++kw) {
        const int tw = wi + pw - kw * dw;
        if (tw < 0 || tw % sw) continue;
        const int wo = tw / sw;
        if (wo >= Wo) continue;
        acc += to_f(cols[((nc * KH + kh) * KW + kw) * L + (int64_t)ho * Wo + wo]);
      }
    }
    x[idx] = from_f<T>(acc);
  }
}

int out_size(int64_t in, int64_t k, int64_t s, int64_t p, int64_t d) { return (int)((in + 2 * p - d * (k - 1) - 1) / s + 1); }

}  // namespace

at::Tensor im2col(const at::Tensor& x, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                  std::vector<int64_t> padding, std::vector<int64_t> dilation) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4, "compress::conv2d: tensor 'x' must be a 4-D CUDA tensor");
  const at::cuda::OptionalCUDAGuard guard(x.device());
  const int64_t N = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
  const int KH = (int)kernel[0], KW = (int)kernel[1];
  const int Ho = out_size(H, KH, stride[0], padding[0], dilation[0]);
  const int Wo = out_size(W, KW, stride[1], padding[1], dilation[1]);
  auto cols = at::empty({N, C * KH * KW, (int64_t)Ho * Wo}, x.options().memory_format(at::MemoryFormat::Contiguous));
  TORCH_CHECK(cols.numel() < ((int64_t)1 << 31) - 1, "compress::conv2d: column buffer too large (use a smaller chunk)");
  const int total = (int)cols.numel();
  if (total == 0) return cols;
  auto stream = at::cuda::getCurrentCUDAStream();
  CK_DISPATCH(x.scalar_type(), "im2col", [&] {
    im2col_kernel<scalar_t><<<ck::grid_for(total, 256, 16), 256, 0, stream>>>(
        x.data_ptr<scalar_t>(), cols.data_ptr<scalar_t>(), total, (int)C, (int)H, (int)W, KH, KW, Ho, Wo,
        (int)stride[0], (int)stride[1], (int)padding[0], (int)padding[1], (int)dilation[0], (int)dilation[1],
        x.stride(0), x.stride(1), x.stride(2), x.stride(3));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return cols;
}

at::Tensor col2im(const at::Tensor& cols_in, std::vector<int64_t> size, std::vector<int64_t> kernel,
                  std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation) {
  TORCH_CHECK(cols_in.is_cuda() && cols_in.dim() == 3, "compress::conv2d_backward: 'cols' must be 3-D CUDA");
  const at::cuda::OptionalCUDAGuard guard(cols_in.device());
  at::Tensor cols = cols_in.contiguous();
  const int KH = (int)kernel[0], KW = (int)kernel[1];
  const int64_t N = cols.size(0), C = cols.size(1) / (KH * KW), H = size[0], W = size[1];
  const int Ho = out_size(H, KH, stride[0], padding[0], dilation[0]);
  const int Wo = out_size(W, KW, stride[1], padding[1], dilation[1]);
  TORCH_CHECK(cols.size(2) == (int64_t)Ho * Wo, "compress::conv2d_backward: 'cols' has the wrong size");
  auto x = at::empty({N, C, H, W}, cols.options());
  TORCH_CHECK(x.numel() < ((int64_t)1 << 31) - 1 && cols.numel() < ((int64_t)1 << 31) - 1,
              "compress::conv2d_backward: chunk too large for the kernel");
  const int total = (int)x.numel();
  if (total == 0) return x;
  auto stream = at::cuda::getCurrentCUDAStream();
  CK_DISPATCH(cols.scalar_type(), "col2im", [&] {
    col2im_kernel<scalar_t><<<ck::grid_for(total, 256, 16), 256, 0, stream>>>(
        cols.data_ptr<scalar_t>(), x.data_ptr<scalar_t>(), total, (int)C, (int)H, (int)W, KH, KW, Ho, Wo,
        (int)stride[0], (int)stride[1], (int)padding[0], (int)padding[1], (int)dilation[0], (int)dilation[1]);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  });
  return x;
}
