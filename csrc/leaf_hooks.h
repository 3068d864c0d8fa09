// The leaf whose gradient hook a read calls for (dtr/leaf_hooks.py's leaf_to_hook: the
// same rule for the C++ paths of both engines; docs/design.md, "Gradient hooks").
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <c10/core/AutogradState.h>
#include <c10/core/InferenceMode.h>

namespace dtr {

// Whether the reads of the op running now call for gradient hooks: under grad mode (a
// graph may accumulate into the leaf), or inside a custom autograd.Function's forward,
// which runs with grad mode and forward-mode AD both off (its backward accumulates into
// the parameters it read). Plain no_grad code and backward keep forward-mode AD on, and
// inference mode builds no graph: their reads (an optimizer's, Module._apply's, which
// torch.utils.swap_tensors must find without a hook's weak reference) call for none.
inline bool reads_call_for_hooks() {
  if (at::GradMode::is_enabled()) return true;
  return !c10::AutogradState::get_tls_state().get_fw_grad_mode() &&
         !c10::InferenceMode::is_enabled();
}

// Under grad mode, the leaf t is or views. With grad mode off (a custom
// autograd.Function's forward), the base of a view when the base is such a leaf: a view
// made without grad mode (`weight.t()` in the forward) is a leaf of its own that no graph
// accumulates into; a leaf view of a base that needs no gradient
// (`big[:k].requires_grad_()`) is its own leaf.
// Undefined when there is none to hook.
inline at::Tensor leaf_to_hook(const at::Tensor& t) {
  if (!t.defined() || !t.requires_grad()) return {};
  auto hookable = [](const at::Tensor& x) {
    return x.defined() && x.is_leaf() && x.requires_grad();
  };
  if (t.is_view() && !(at::GradMode::is_enabled() && t.is_leaf())) {
    const at::Tensor base(t._base());
    if (hookable(base)) return base;
  }
  return hookable(t) ? t : at::Tensor();
}

}  // namespace dtr
