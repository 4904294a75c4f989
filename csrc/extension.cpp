// The extension module seq2seq_fast._C: its Python entry point (loading it runs the op
// registrations of every file in csrc/) and the test hooks of the kernel tables.
#include <Python.h>
#include <torch/library.h>
#include <torch/types.h>

#include <string>

#include "kernels/tanh_coeffs.h"
#include "runtime.h"

namespace seq2seq_fast {
namespace {

using at::Tensor;

// tanh(x + y) elementwise exactly as the kernels evaluate it. path: 0 = product (needs
// |x|, |y| <= the product limit and |x| + |y| <= the safe sum), 1 = rational, 2 = capped product
// (|x|, |y| <= the product limit), 3 = the bfloat16 rows' product (float32; any x, y). Lets tests
// bound the error against torch.tanh.
Tensor fast_tanh(const Tensor& x, const Tensor& y, int64_t path) {
  TORCH_CHECK(x.sizes() == y.sizes() && x.scalar_type() == y.scalar_type(),
              "_fast_tanh: x and y must have one shape and dtype");
  TORCH_CHECK(path == kProduct || path == kRational || path == kProductCapped ||
                  path == kProductBf16,
              "_fast_tanh: path must be 0 (product), 1 (rational), 2 (capped product) or 3 ",
              "(bfloat16 rows' product), got ", path);
  auto run = [&](auto tag) {
    using T = decltype(tag);
    const auto& kt = runtime_kernels<T>();
    const int64_t numel = x.numel();
    const int64_t padded = round_up(std::max<int64_t>(numel, 1), kPadTo);
    Tensor a = at::zeros({padded}, x.options()), b = at::zeros({padded}, x.options());
    a.narrow(0, 0, numel).copy_(x.reshape(-1));
    b.narrow(0, 0, numel).copy_(y.reshape(-1));
    if (path == kProductBf16) {
      a.mul_(S2S_TWO_LOG2E);
    } else if (path != kRational) {
      kt.exp_inplace(a.data_ptr<T>(), padded, T(2));
      kt.exp_inplace(b.data_ptr<T>(), padded, T(2));
    }
    Tensor out = at::empty({padded}, x.options());
    kt.tanh_pairs(int(path), a.data_ptr<T>(), b.data_ptr<T>(), out.data_ptr<T>(), padded);
    return out.narrow(0, 0, numel).reshape(x.sizes()).clone();
  };
  if (x.scalar_type() == at::kDouble) return run(double{});
  TORCH_CHECK(x.scalar_type() == at::kFloat, "_fast_tanh: float32 or float64, got ",
              x.scalar_type());
  return run(float{});
}


std::string cpu_isa() { return runtime_kernels<float>().name; }

}  // namespace
}  // namespace seq2seq_fast

TORCH_LIBRARY_FRAGMENT(seq2seq_fast, m) {
  m.def("_fast_tanh(Tensor x, Tensor y, int path) -> Tensor");
  m.def("_cpu_isa() -> str", &seq2seq_fast::cpu_isa);
}

TORCH_LIBRARY_IMPL(seq2seq_fast, CPU, m) { m.impl("_fast_tanh", &seq2seq_fast::fast_tanh); }

// `from seq2seq_fast import _C` loads the library (running the registrations).
extern "C" {
PyMODINIT_FUNC PyInit__C(void) {
  static struct PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}
}
