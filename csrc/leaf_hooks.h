// The leaf whose gradient hook a read calls for (dtr/leaf_hooks.py's leaf_to_hook: the
// same rule for the C++ paths of both engines; docs/design.md, "Gradient hooks").
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>

namespace dtr {

// Under grad mode, the leaf t is or views. With grad mode off (a custom
// autograd.Function's forward, whose backward still accumulates into the parameters it
// read; backward itself), the base of a view when the base is such a leaf: a view made
// without grad mode is a leaf of its own (backward's `weight.t()`, new every step) that
// no graph accumulates into, and hooking it would add a hook per view per step; a leaf
// view of a base that needs no gradient (`big[:k].requires_grad_()`) is its own leaf.
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
