// The CPU kernel of `branchspec::linear` (model/matmul.py) in C++: x @ w.T through oneDNN
// with w's packed copy, found in a table keyed by the weight's memory and packed again when
// the weight changed in place or its memory was freed and reused (the same rules as the
// Python kernel's `_Packed.holds`).
//
// A compiled step calls the operator through the dispatcher from its C++ wrapper; with
// the Python kernel every call crossed into Python and back (15-20 us a call on the CPUs
// measured, a dozen calls a decode step). This library registers nothing when loaded: the
// operator `branchspec_native::use(on)` puts its kernel in place of the Python one, or
// takes it out again (matmul.native_kernel).

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

namespace {

// One weight's packed copy, and what tells that it is still that weight's.
struct Packed {
  c10::weak_intrusive_ptr<c10::StorageImpl> storage;
  int64_t version;  // -1: an inference tensor, which keeps no version counter
  std::vector<int64_t> sizes, strides;
  int64_t offset;
  at::Tensor packed;
};

int64_t version_of(const at::Tensor& w) {
  return w.is_inference() ? -1 : static_cast<int64_t>(w._version());
}

bool holds(const Packed& p, const at::Tensor& w) {
  return !p.storage.expired() && p.version == version_of(w) && w.sizes() == c10::IntArrayRef(p.sizes) &&
         w.strides() == c10::IntArrayRef(p.strides) && p.offset == w.storage_offset();
}

std::mutex table_mutex;
std::unordered_map<const void*, Packed> table;  // w.data_ptr() -> its packed copy

at::Tensor packed_weight(const at::Tensor& w) {
  static auto reorder = c10::Dispatcher::singleton()
                            .findSchemaOrThrow("mkldnn::_reorder_linear_weight", "")
                            .typed<at::Tensor(const at::Tensor&, std::optional<int64_t>)>();
  std::lock_guard<std::mutex> lock(table_mutex);
  auto it = table.find(w.data_ptr());
  if (it != table.end() && holds(it->second, w)) {
    return it->second.packed;
  }
  for (auto e = table.begin(); e != table.end();) {  // weights since freed
    e = e->second.storage.expired() ? table.erase(e) : std::next(e);
  }
  Packed p{w.storage().getWeakStorageImpl(), version_of(w), w.sizes().vec(), w.strides().vec(),
           w.storage_offset(), reorder.call(w.contiguous(), std::nullopt)};
  return table.insert_or_assign(w.data_ptr(), std::move(p)).first->second.packed;
}

// x [..., in] @ w.T with w [out, in] -> [..., out]
at::Tensor packed_linear(const at::Tensor& x, const at::Tensor& w) {
  static auto linear =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("mkldnn::_linear_pointwise", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                            c10::string_view, c10::List<std::optional<at::Scalar>>,
                            std::optional<c10::string_view>)>();
  at::Tensor flat = x.reshape({-1, x.size(-1)}).contiguous();  // [M, in]
  at::Tensor out = linear.call(flat, packed_weight(w), std::nullopt, "none",
                               c10::List<std::optional<at::Scalar>>(), c10::string_view(""));
  std::vector<int64_t> shape = x.sizes().vec();
  shape.back() = w.size(0);
  return out.view(shape);
}

std::mutex use_mutex;
std::unique_ptr<torch::Library> in_use;  // the registration; destroying it takes the kernel out

void use(bool on) {
  std::lock_guard<std::mutex> lock(use_mutex);
  if (on && !in_use) {
    in_use = std::make_unique<torch::Library>(torch::Library::IMPL, "branchspec", c10::DispatchKey::CPU,
                                              __FILE__, __LINE__);
    in_use->impl("linear", TORCH_FN(packed_linear));
  } else if (!on) {
    in_use.reset();
  }
}

}  // namespace

TORCH_LIBRARY(branchspec_native, m) {
  m.def("use(bool on) -> ()", use);
}
