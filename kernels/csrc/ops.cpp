// Python bindings of the compress CUDA kernels. Schemas, autograd and fake kernels are declared in Python
// (kernels/*.py, torch.library); this module only exposes the kernel launchers.
#include <torch/extension.h>

#include <vector>

at::Tensor pix_forward(const at::Tensor& x, const at::Tensor& p, int64_t zeta, double tau, bool cl);
std::vector<at::Tensor> pix_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& p, int64_t zeta,
                                     double tau, bool cl);
std::vector<at::Tensor> pix_squeeze_forward(const at::Tensor& x, const at::Tensor& weight, int64_t zeta, double tau,
                                            bool cl, const c10::optional<at::Tensor>& pooled);
std::vector<at::Tensor> add_relu_pool(const at::Tensor& a, const at::Tensor& b, bool cl);
std::vector<at::Tensor> pix_squeeze_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight,
                                             const at::Tensor& pooled, int64_t zeta, double tau, bool cl);
at::Tensor dw_forward(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias,
                      std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation,
                      bool cl);
std::vector<at::Tensor> dw_backward(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w,
                                    std::vector<int64_t> stride, std::vector<int64_t> padding,
                                    std::vector<int64_t> dilation, bool cl);
at::Tensor im2col(const at::Tensor& x, std::vector<int64_t> kernel, std::vector<int64_t> stride,
                  std::vector<int64_t> padding, std::vector<int64_t> dilation);
at::Tensor col2im(const at::Tensor& cols, std::vector<int64_t> size, std::vector<int64_t> kernel,
                  std::vector<int64_t> stride, std::vector<int64_t> padding, std::vector<int64_t> dilation);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("pix_forward", &pix_forward, "PiX forward (CUDA)");
  m.def("pix_backward", &pix_backward, "PiX backward: dx, dp (CUDA)");
  m.def("pix_squeeze_forward", &pix_squeeze_forward, "PiX block forward: y, pooled (CUDA)", py::arg("x"),
        py::arg("weight"), py::arg("zeta"), py::arg("tau"), py::arg("cl"), py::arg("pooled") = py::none());
  m.def("add_relu_pool", &add_relu_pool, "relu(a + b) and its channel mean (CUDA)");
  m.def("pix_squeeze_backward", &pix_squeeze_backward, "PiX block backward: dx, dweight (CUDA)");
  m.def("dw_forward", &dw_forward, "depthwise conv forward (CUDA)");
  m.def("dw_backward", &dw_backward, "depthwise conv backward: dx, dw (CUDA)");
  m.def("im2col", &im2col, "im2col (CUDA)");
  m.def("col2im", &col2im, "col2im (CUDA)");
}
