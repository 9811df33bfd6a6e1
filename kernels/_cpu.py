"""Small C++ CPU kernels, compiled on first use with the system C++ compiler and called through ctypes.

No PyTorch headers: one source (``SOURCE``), one ``c++ -O3 -shared`` call (~6 s on 2 cores, once), cached as a
shared library in ``$COMPRESS_KERNELS_CACHE`` or ``~/.cache/compress_kernels/cpu``, named by a hash of the source,
the compiler, the flags and the machine. With GCC on x86-64 the float32 entry points are ``target_clones``
(AVX-512, AVX2, baseline x86-64), so one library runs on any x86-64 CPU. Where this cannot work (no compiler, a
compile or load error, or ``COMPRESS_KERNELS_NO_CPU=1``) ``lib()`` returns ``None``, after ONE warning unless the
variable asked for it, and the ops keep their PyTorch CPU path. The kernels are single-threaded: they are memory-
bound passes (in a 1-thread PiX ResNet-50 forward they run at about the speed of a copy of their input).

PiX, semantics as ``compress::pix`` / ``compress::pix_squeeze`` and the CUDA kernels:
``y[b,g] = p[b,g] * max_k x[b,g*Z+k]`` if ``p[b,g] < tau`` (tau cast to x's dtype) else
``p[b,g] * (sum_k x[b,g*Z+k] / Z)``; the max keeps the first value on ties and NaNs (``v > m ? v : m``), the sum
runs over k in order. x and y are contiguous in the same layout (NCHW or channels_last).

- ``pix_{nchw,cl}_{f32,f64}(x, p, y, B, G, Z, HW, tau)``: the fusion for a given p (B, G), one pass.
- ``pix_squeeze_{nchw,cl}_{f32,f64}(x, w, pooled, y, B, C, Z, HW, tau)``: the whole block. Pass 1 reads x once
  for pooled = mean_hw(x) (B, C) (partial sums in T, totals in double) and every group's max and sum (into y and
  a scratch s); p = sigmoid(pooled @ w^T) (w (G, C) in x's dtype; ``pix_predict``); pass 2 selects and scales
  y in place (reading y and s, each 1/Z of x).
- ``pix_predict_{f32,f64}(pooled, w, p, B, C, G)``: that predictor alone (the CPU backward recomputes p with it).

Every function returns 0, or 1 if a scratch allocation failed.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings

__all__ = ["lib", "reset_for_tests", "SOURCE"]

SOURCE = r"""
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <math.h>
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define CLONES
#endif
// Everything below is inlined into the entry points, so each clone compiles it for its instruction set.
#define INL static inline __attribute__((always_inline))

// Max (first value wins ties and NaNs: `a > m ? a : m`) and in-order sum of one group's Z contiguous values.
template <typename T>
INL void group_max_sum(const T* __restrict__ v, int Z, T& m, T& s) {
  m = s = v[0];
  for (int k = 1; k < Z; ++k) {
    const T a = v[k];
    m = a > m ? a : m;
    s += a;
  }
}

// NCHW: x (B*G, Z, HW), y (B*G, HW); per row one branch, k outer and hw inner over L1-sized chunks of y.
template <typename T, int ZC>
INL void nchw_row(const T* __restrict__ xr, T* __restrict__ yr, int64_t HW, int Zr, bool pick, T pv) {
  const int Z = ZC > 0 ? ZC : Zr;
  const int64_t CH = 512;
  for (int64_t h0 = 0; h0 < HW; h0 += CH) {
    const int64_t n = HW - h0 < CH ? HW - h0 : CH;
    T* __restrict__ out = yr + h0;
    const T* __restrict__ x0 = xr + h0;
    for (int64_t i = 0; i < n; ++i) out[i] = x0[i];
    if (pick) {
      for (int k = 1; k < Z; ++k) {
        const T* __restrict__ xk = x0 + k * HW;
        for (int64_t i = 0; i < n; ++i) out[i] = xk[i] > out[i] ? xk[i] : out[i];
      }
      for (int64_t i = 0; i < n; ++i) out[i] = pv * out[i];
    } else {
      for (int k = 1; k < Z; ++k) {
        const T* __restrict__ xk = x0 + k * HW;
        for (int64_t i = 0; i < n; ++i) out[i] += xk[i];
      }
      for (int64_t i = 0; i < n; ++i) out[i] = pv * (out[i] / (T)Z);
    }
  }
}

template <typename T>
INL int nchw(const T* x, const T* p, T* y, int64_t B, int64_t G, int Z, int64_t HW, T tau) {
  for (int64_t r = 0; r < B * G; ++r) {
    const bool pick = p[r] < tau;
    const T* xr = x + r * Z * HW;
    T* yr = y + r * HW;
    switch (Z) {
      case 1: nchw_row<T, 1>(xr, yr, HW, Z, pick, p[r]); break;
      case 2: nchw_row<T, 2>(xr, yr, HW, Z, pick, p[r]); break;
      case 4: nchw_row<T, 4>(xr, yr, HW, Z, pick, p[r]); break;
      case 8: nchw_row<T, 8>(xr, yr, HW, Z, pick, p[r]); break;
      default: nchw_row<T, 0>(xr, yr, HW, Z, pick, p[r]); break;
    }
  }
  return 0;
}

// channels_last: x (B, HW, G, Z), y (B, HW, G); max and sum of each group in registers, selected per g.
template <typename T, int ZC>
INL void cl_pixel(const T* __restrict__ xp, T* __restrict__ yp, const T* __restrict__ pv, const T* __restrict__ pk,
                  int64_t G, int Zr) {
  const int Z = ZC > 0 ? ZC : Zr;
  for (int64_t g = 0; g < G; ++g) {
    T m, s;
    group_max_sum(xp + g * Z, Z, m, s);
    const T mean = s / (T)Z;
    const T r = pk[g] != (T)0 ? m : mean;
    yp[g] = pv[g] * r;
  }
}

template <typename T>
INL int cl(const T* x, const T* p, T* y, int64_t B, int64_t G, int Z, int64_t HW, T tau) {
  T* pk = (T*)malloc(sizeof(T) * (G > 0 ? G : 1));
  if (!pk) return 1;
  for (int64_t b = 0; b < B; ++b) {
    const T* pb = p + b * G;
    for (int64_t g = 0; g < G; ++g) pk[g] = pb[g] < tau ? (T)1 : (T)0;
    for (int64_t i = 0; i < HW; ++i) {
      const T* xp = x + (b * HW + i) * G * Z;
      T* yp = y + (b * HW + i) * G;
      switch (Z) {
        case 1: cl_pixel<T, 1>(xp, yp, pb, pk, G, Z); break;
        case 2: cl_pixel<T, 2>(xp, yp, pb, pk, G, Z); break;
        case 4: cl_pixel<T, 4>(xp, yp, pb, pk, G, Z); break;
        case 8: cl_pixel<T, 8>(xp, yp, pb, pk, G, Z); break;
        default: cl_pixel<T, 0>(xp, yp, pb, pk, G, Z); break;
      }
    }
  }
  free(pk);
  return 0;
}

// ---- The PiX block (compress::pix_squeeze): pass 1, the predictor, pass 2.
// Pass 1 reads x once: pooled[b,c] = mean_hw x[b,c], y = max and s = sum of each group.
// Pass 2, given p (B, G): y = p < tau ? p * y : p * (s / Z), in place, reading y and s (each 1/Z of x).
template <typename T>
INL void acc16(double* __restrict__ lanes, const T* __restrict__ v, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += (double)v[i + j];
  for (; i < n; ++i) lanes[i & 15] += (double)v[i];
}

template <typename T, int ZC>
INL void sq1_nchw(const T* x, T* pooled, T* ym, T* ys, double* lanes, int64_t R, int Zr, int64_t HW) {
  if (ZC > 0) {  // Z known: one read of each x vector updates max, sum and the pool lanes held in registers
    constexpr int Z = ZC > 0 ? ZC : 1;
    typedef T V __attribute__((vector_size(64)));
    constexpr int L = 64 / sizeof(T);
    for (int64_t r = 0; r < R; ++r) {
      const T* __restrict__ xr = x + r * Z * HW;
      T* __restrict__ mo = ym + r * HW;
      T* __restrict__ so = ys + r * HW;
      double tot[Z];
      for (int k = 0; k < Z; ++k) tot[k] = 0.0;
      int64_t i = 0;
      while (i + L <= HW) {  // pool lanes in T for up to 32 vectors, then into double
        const int64_t nv = (HW - i) / L < 32 ? (HW - i) / L : 32;
        const int64_t stop = i + nv * L;
        V lk[Z];
        for (int k = 0; k < Z; ++k) lk[k] = V{} ;
        for (; i < stop; i += L) {
          V m, s;
          memcpy(&m, xr + i, sizeof(V));
          s = m;
          lk[0] += m;
          for (int k = 1; k < Z; ++k) {
            V a;
            memcpy(&a, xr + k * HW + i, sizeof(V));
            m = a > m ? a : m;
            s += a;
            lk[k] += a;
          }
          memcpy(mo + i, &m, sizeof(V));
          memcpy(so + i, &s, sizeof(V));
        }
        for (int k = 0; k < Z; ++k)
          for (int j = 0; j < L; ++j) tot[k] += (double)lk[k][j];
      }
      for (; i < HW; ++i) {
        T m = xr[i], s = xr[i];
        tot[0] += (double)xr[i];
        for (int k = 1; k < Z; ++k) {
          const T a = xr[k * HW + i];
          m = a > m ? a : m;
          s += a;
          tot[k] += (double)a;
        }
        mo[i] = m;
        so[i] = s;
      }
      for (int k = 0; k < Z; ++k) pooled[r * Z + k] = (T)(tot[k] / (double)HW);
    }
    return;
  }
  const int Z = Zr;  // any Z: chunks of y and s, k outer, pool lanes in memory
  const int64_t CH = 512;
  for (int64_t r = 0; r < R; ++r) {
    const T* xr = x + r * Z * HW;
    for (int j = 0; j < Z * 16; ++j) lanes[j] = 0.0;
    for (int64_t h0 = 0; h0 < HW; h0 += CH) {
      const int64_t n = HW - h0 < CH ? HW - h0 : CH;
      const T* __restrict__ x0 = xr + h0;
      T* __restrict__ mo = ym + r * HW + h0;
      T* __restrict__ so = ys + r * HW + h0;
      for (int64_t i = 0; i < n; ++i) { mo[i] = x0[i]; so[i] = x0[i]; }
      acc16(lanes, x0, n);
      for (int k = 1; k < Z; ++k) {
        const T* __restrict__ xk = x0 + k * HW;
        for (int64_t i = 0; i < n; ++i) {
          const T a = xk[i];
          mo[i] = a > mo[i] ? a : mo[i];
          so[i] += a;
        }
        acc16(lanes + k * 16, xk, n);
      }
    }
    for (int k = 0; k < Z; ++k) {
      double t = 0.0;
      for (int j = 0; j < 16; ++j) t += lanes[k * 16 + j];
      pooled[r * Z + k] = (T)(t / (double)HW);
    }
  }
}

template <typename T, int ZC>
INL void sq1_cl(const T* x, T* pooled, T* ym, T* ys, double* acc, int64_t B, int64_t G, int Zr, int64_t HW) {
  const int Z = ZC > 0 ? ZC : Zr;
  const int64_t C = G * Z;
  T* accT = (T*)(acc + C);  // per-channel sums of up to 32 pixels in T, then into double
  for (int64_t b = 0; b < B; ++b) {
    for (int64_t c = 0; c < C; ++c) acc[c] = 0.0;
    for (int64_t i0 = 0; i0 < HW; i0 += 32) {
      const int64_t i1 = HW - i0 < 32 ? HW : i0 + 32;
      for (int64_t c = 0; c < C; ++c) accT[c] = (T)0;
      for (int64_t i = i0; i < i1; ++i) {
        const T* __restrict__ xp = x + (b * HW + i) * C;
        T* __restrict__ mo = ym + (b * HW + i) * G;
        T* __restrict__ so = ys + (b * HW + i) * G;
        T* __restrict__ a = accT;
        for (int64_t c = 0; c < C; ++c) a[c] += xp[c];
        for (int64_t g = 0; g < G; ++g) group_max_sum(xp + g * Z, Z, mo[g], so[g]);
      }
      for (int64_t c = 0; c < C; ++c) acc[c] += (double)accT[c];
    }
    for (int64_t c = 0; c < C; ++c) pooled[b * C + c] = (T)(acc[c] / (double)HW);
  }
}

template <typename T, int ZC>
INL void sq2_nchw(const T* p, T* ym, const T* ys, int64_t R, int Zr, int64_t HW, T tau) {
  const int Z = ZC > 0 ? ZC : Zr;
  for (int64_t r = 0; r < R; ++r) {
    const T pv = p[r];
    T* __restrict__ m = ym + r * HW;
    const T* __restrict__ s = ys + r * HW;
    if (pv < tau) {
      for (int64_t i = 0; i < HW; ++i) m[i] = pv * m[i];
    } else {
      for (int64_t i = 0; i < HW; ++i) m[i] = pv * (s[i] / (T)Z);
    }
  }
}

template <typename T, int ZC>
INL void sq2_cl(const T* p, T* ym, const T* ys, T* pk, int64_t B, int64_t G, int Zr, int64_t HW, T tau) {
  const int Z = ZC > 0 ? ZC : Zr;
  for (int64_t b = 0; b < B; ++b) {
    const T* __restrict__ pb = p + b * G;
    for (int64_t g = 0; g < G; ++g) pk[g] = pb[g] < tau ? (T)1 : (T)0;
    for (int64_t i = 0; i < HW; ++i) {
      T* __restrict__ m = ym + (b * HW + i) * G;
      const T* __restrict__ s = ys + (b * HW + i) * G;
      for (int64_t g = 0; g < G; ++g) {
        const T mean = s[g] / (T)Z;
        const T r = pk[g] != (T)0 ? m[g] : mean;
        m[g] = pb[g] * r;
      }
    }
  }
}

#define ZDISPATCH(F, ...)                          \
  switch (Z) {                                     \
    case 1: F<T, 1>(__VA_ARGS__); break;           \
    case 2: F<T, 2>(__VA_ARGS__); break;           \
    case 4: F<T, 4>(__VA_ARGS__); break;           \
    case 8: F<T, 8>(__VA_ARGS__); break;           \
    default: F<T, 0>(__VA_ARGS__); break;          \
  }

template <typename T>
INL int sq1(bool cl, const T* x, T* pooled, T* ym, T* ys, int64_t B, int64_t C, int Z, int64_t HW) {
  const int64_t G = C / Z;
  double* work = (double*)malloc(sizeof(double) * (cl ? 2 * (C > 0 ? C : 1) : 16 * (int64_t)Z));
  if (!work) return 1;
  if (cl) {
    ZDISPATCH(sq1_cl, x, pooled, ym, ys, work, B, G, Z, HW)
  } else {
    ZDISPATCH(sq1_nchw, x, pooled, ym, ys, work, B * G, Z, HW)
  }
  free(work);
  return 0;
}

template <typename T>
INL int sq2(bool cl, const T* p, T* ym, const T* ys, int64_t B, int64_t G, int Z, int64_t HW, T tau) {
  if (cl) {
    T* pk = (T*)malloc(sizeof(T) * (G > 0 ? G : 1));
    if (!pk) return 1;
    ZDISPATCH(sq2_cl, p, ym, ys, pk, B, G, Z, HW, tau)
    free(pk);
  } else {
    ZDISPATCH(sq2_nchw, p, ym, ys, B * G, Z, HW, tau)
  }
  return 0;
}

// p = sigmoid(pooled @ w^T): pooled (B, C), w (G, C), p (B, G). Each w row is read once for up to 4 samples; the
// dot products run in 32 lanes of T (like a BLAS GEMV), summed and passed through the sigmoid in double.
template <typename T, int NB>
INL void predict_rows(const T* __restrict__ wg, const T* __restrict__ pooled, T* __restrict__ p, int64_t C,
                      int64_t G) {
  typedef T V __attribute__((vector_size(64)));
  constexpr int L = 64 / sizeof(T);
  V acc[NB][2];
  for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = V{};
  int64_t i = 0;
  for (; i + 2 * L <= C; i += 2 * L) {
    V w0, w1;
    memcpy(&w0, wg + i, sizeof(V));
    memcpy(&w1, wg + i + L, sizeof(V));
    for (int b = 0; b < NB; ++b) {
      V a0, a1;
      memcpy(&a0, pooled + b * C + i, sizeof(V));
      memcpy(&a1, pooled + b * C + i + L, sizeof(V));
      acc[b][0] += w0 * a0;
      acc[b][1] += w1 * a1;
    }
  }
  for (int b = 0; b < NB; ++b) {
    double z = 0.0;
    for (int j = 0; j < L; ++j) z += (double)acc[b][0][j] + (double)acc[b][1][j];
    for (int64_t t = i; t < C; ++t) z += (double)wg[t] * (double)pooled[b * C + t];
    p[b * G] = (T)(1.0 / (1.0 + exp(-z)));
  }
}

template <typename T>
INL void predict(const T* pooled, const T* w, T* p, int64_t B, int64_t C, int64_t G) {
  for (int64_t g = 0; g < G; ++g) {
    const T* wg = w + g * C;
    int64_t b = 0;
    for (; b + 4 <= B; b += 4) predict_rows<T, 4>(wg, pooled + b * C, p + b * G + g, C, G);
    for (; b < B; ++b) predict_rows<T, 1>(wg, pooled + b * C, p + b * G + g, C, G);
  }
}

// The whole block: pass 1, the predictor, pass 2 (s and p are scratch).
template <typename T>
INL int squeeze(bool cl, const T* x, const T* w, T* pooled, T* y, int64_t B, int64_t C, int Z, int64_t HW, T tau) {
  const int64_t G = C / Z;
  T* s = (T*)malloc(sizeof(T) * (B * G * HW + B * G));
  if (!s) return 1;
  T* p = s + B * G * HW;
  int err = sq1<T>(cl, x, pooled, y, s, B, C, Z, HW);
  if (!err) {
    predict<T>(pooled, w, p, B, C, G);
    err = sq2<T>(cl, p, y, s, B, G, Z, HW, tau);
  }
  free(s);
  return err;
}

// Entry points. float32 runs in clones for AVX-512, AVX2 and baseline x86-64; float64 (tests, references) only
// in the baseline build.
#define ENTRIES(SUF, T, ATTR)                                                                                     \
  ATTR int pix_nchw_##SUF(const T* x, const T* p, T* y, int64_t B, int64_t G, int64_t Z, int64_t HW,            \
                          double tau) {                                                                         \
    return nchw<T>(x, p, y, B, G, (int)Z, HW, (T)tau);                                                          \
  }                                                                                                             \
  ATTR int pix_cl_##SUF(const T* x, const T* p, T* y, int64_t B, int64_t G, int64_t Z, int64_t HW, double tau) { \
    return cl<T>(x, p, y, B, G, (int)Z, HW, (T)tau);                                                            \
  }                                                                                                             \
  ATTR int pix_squeeze_nchw_##SUF(const T* x, const T* w, T* pooled, T* y, int64_t B, int64_t C, int64_t Z,     \
                                  int64_t HW, double tau) {                                                     \
    return squeeze<T>(false, x, w, pooled, y, B, C, (int)Z, HW, (T)tau);                                        \
  }                                                                                                             \
  ATTR int pix_squeeze_cl_##SUF(const T* x, const T* w, T* pooled, T* y, int64_t B, int64_t C, int64_t Z,       \
                                int64_t HW, double tau) {                                                       \
    return squeeze<T>(true, x, w, pooled, y, B, C, (int)Z, HW, (T)tau);                                         \
  }                                                                                                             \
  ATTR int pix_predict_##SUF(const T* pooled, const T* w, T* p, int64_t B, int64_t C, int64_t G) {              \
    predict<T>(pooled, w, p, B, C, G);                                                                          \
    return 0;                                                                                                   \
  }

extern "C" {
ENTRIES(f32, float, CLONES)
ENTRIES(f64, double, )
}
"""

# -fno-trapping-math lets GCC turn the per-group select into vector blends (results are unchanged: no fast-math).
FLAGS = ["-O3", "-fno-trapping-math", "-shared", "-fPIC"]
_PTR, _I64, _F64 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_double
SIGNATURES = {}  # argtypes; every function returns an int (0, or 1 when out of memory)
for _t in ("f32", "f64"):
    for _l in ("nchw", "cl"):
        SIGNATURES[f"pix_{_l}_{_t}"] = [_PTR] * 3 + [_I64] * 4 + [_F64]  # x, p, y, B, G, Z, HW, tau
        SIGNATURES[f"pix_squeeze_{_l}_{_t}"] = [_PTR] * 4 + [_I64] * 4 + [_F64]  # x, w, pooled, y, B, C, Z, HW, tau
    SIGNATURES[f"pix_predict_{_t}"] = [_PTR] * 3 + [_I64] * 3  # pooled, w, p, B, C, G

_lock = threading.Lock()
_state: dict[str, object] = {}


def _compiler() -> str | None:
    for cand in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if cand and shutil.which(cand):
            return shutil.which(cand)
    return None


def _warn(why: str) -> None:
    warnings.warn(f"compress kernels: the C++ CPU kernels are unavailable ({why}); CPU tensors use the slower "
                  "PyTorch path.", RuntimeWarning, stacklevel=4)


def _build(cxx: str) -> str:
    tag = hashlib.sha256("\0".join([SOURCE, cxx, *FLAGS, platform.machine(), platform.system()]).encode())
    root = os.environ.get("COMPRESS_KERNELS_CACHE") or os.path.join(os.path.expanduser("~"), ".cache",
                                                                     "compress_kernels")
    d = os.path.join(root, "cpu")
    os.makedirs(d, exist_ok=True)
    so = os.path.join(d, f"compress_cpu_{tag.hexdigest()[:16]}.so")
    if os.path.exists(so):
        return so
    with tempfile.TemporaryDirectory(dir=d) as tmp:  # build privately, then rename: safe with parallel processes
        src, out = os.path.join(tmp, "kernels.cpp"), os.path.join(tmp, "kernels.so")
        with open(src, "w") as f:
            f.write(SOURCE)
        print(f"compress kernels: compiling the C++ CPU kernels into {d} (first use only, a few seconds) ...",
              file=sys.stderr, flush=True)
        r = subprocess.run([cxx, *FLAGS, "-o", out, src], capture_output=True, text=True, timeout=300)
        if r.returncode != 0:
            lines = (r.stderr or r.stdout or f"exit status {r.returncode}").strip().splitlines()
            raise RuntimeError(next((ln for ln in lines if "error" in ln), lines[-1])[:300])
        os.replace(out, so)
    return so


def lib() -> ctypes.CDLL | None:
    """The loaded library (its functions with argtypes set), or None (one warning) where it cannot be built."""
    if "lib" in _state:
        return _state["lib"]  # type: ignore[return-value]
    with _lock:
        if "lib" in _state:
            return _state["lib"]  # type: ignore[return-value]
        handle = None
        if os.environ.get("COMPRESS_KERNELS_NO_CPU", "") not in ("", "0"):
            pass  # asked for the PyTorch path: no warning
        elif (cxx := _compiler()) is None:
            _warn("no C++ compiler found; set CXX")
        else:
            try:
                handle = ctypes.CDLL(_build(cxx))
                for name, args in SIGNATURES.items():
                    fn = getattr(handle, name)
                    fn.argtypes, fn.restype = args, ctypes.c_int
            except Exception as e:  # noqa: BLE001 - any build or load failure means: fall back, with one warning
                _warn(f"{type(e).__name__}: {e}")
                handle = None
        _state["lib"] = handle
        return handle


def reset_for_tests() -> None:
    """Forget the loaded library (tests only; the cached file stays)."""
    with _lock:
        _state.clear()
