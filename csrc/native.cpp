// The native engine (experimental; dtr/NOTES.md, "The PrivateUse1 route"): managed tensors
// are a C++ TensorImpl carrying the PrivateUse1 dispatch key (device still that of their
// value), and every op reaches one boxed fallback, with no Python on the way: the session
// includes PrivateUse1 in its thread's TLS key set, so ops on plain tensors come here too
// (the job of the Python route's dispatch mode). The bookkeeping is the same C++ Core.
//
// A managed tensor shares its value's StorageImpl. Evicting frees that storage's memory
// (its DataPtr swapped for a null one, with an error message for anything that reads it
// directly); recomputing puts the new value's DataPtr back, so views and autograd's saved
// copies, which share the StorageImpl, see it.
//
// Served (v0): ops that write nothing (views included) on managed tensors, ops on plain
// tensors (writes to a plain tensor a recipe reads pin what depends on it first, as
// Runtime._writes_to_plain), ops that write plain tensors from managed ones (an optimizer
// reading managed gradients), in-place writes to managed tensors (the tensor and what
// reads it are pinned first: no versions yet), random ops (run once, results plain).
// Refused with NotImplementedError naming the op: in-place ops that change a managed
// tensor's shape or storage, tensors not on the CPU. Gradients are managed tensors (counted
// in the budget; the default engine hands them out plain). Trace, timeline, stress mode,
// OOM retry and reserve are not in v0.
#include "native.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/enum_tag.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <atomic>
#include <chrono>
#include <exception>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <vector>

#include "core.h"
#include "protocol.h"

namespace py = pybind11;

namespace dtr {
namespace native {

struct Engine;

namespace {

const char* kEvictedMsg =
    "dtr: this tensor's value is evicted, and reading its memory directly (numpy(), tolist(), "
    "data_ptr(), torch.save) does not recompute it; run an op on it first (t.clone()) or "
    "read it after the block";

std::mutex g_mu;                   // guards g_engine
std::shared_ptr<Engine> g_engine;  // the open session's engine (one at a time)

std::shared_ptr<Engine> active() {
  std::lock_guard<std::mutex> g(g_mu);
  return g_engine;
}

struct Slot {  // where a managed input sits in the recipe's arguments
  size_t arg;
  int64_t item;  // index in a list argument, or -1
  int64_t tid;
};

// Put v (undefined: none) where an argument holds a tensor: the argument itself (item < 0)
// or item `item` of a list argument (a copy: the caller's list is left alone).
void set_item(c10::IValue& iv, int64_t item, const at::Tensor& v) {
  if (item < 0) {
    iv = v.defined() ? c10::IValue(v) : c10::IValue();
  } else if (iv.isTensorList()) {
    auto l = iv.toTensorList().copy();
    l.set(item, v);
    iv = l;
  } else {
    auto l = iv.toList().copy();
    l.set(item, v.defined() ? c10::IValue(v) : c10::IValue());
    iv = l;
  }
}

struct Recipe {
  std::optional<c10::OperatorHandle> op;
  std::vector<c10::IValue> args;  // the call's arguments, managed tensors as None
  std::vector<Slot> slots;
  std::vector<std::pair<size_t, int64_t>> outs;  // per core output: (return, item or -1)
  std::vector<int64_t> out_tids;
  // plain tensors it reads, with their version when recorded (a write dtr did not see)
  std::vector<std::pair<at::Tensor, uint32_t>> plain;
  bool grad = false;
};

}  // namespace

struct Engine : std::enable_shared_from_this<Engine> {
  Engine(const std::string& heuristic, int64_t budget, uint64_t seed)
      : core(heuristic, budget, seed, 0) {}

  Core core;
  std::recursive_mutex mu;
  std::atomic<bool> open{true};
  std::vector<at::Tensor> values;  // per tid: the plain tensor over the shared StorageImpl
  std::vector<Recipe> recipes;     // per recipe id
  std::unordered_map<const c10::StorageImpl*, int64_t> const_tid;  // constant storages
  std::vector<c10::Storage> const_storage;                         // per tid, kept alive
  std::mutex pending_mu;
  std::vector<int64_t> pending;  // handles dropped since the last op
  double recompute_seconds = 0.0;

  // ---- handles
  void retain(int64_t tid) {
    std::lock_guard<std::recursive_mutex> g(mu);
    if (open) core.retain(tid);
  }
  void dropped(int64_t tid) {  // from a destructor: any thread, maybe inside an op
    std::lock_guard<std::mutex> g(pending_mu);
    pending.push_back(tid);
  }
  void flush() {
    while (true) {
      std::vector<int64_t> now;
      {
        std::lock_guard<std::mutex> g(pending_mu);
        now.swap(pending);
      }
      if (now.empty()) return;
      if (open)
        for (int64_t tid : now) core.release(tid);
      drain();
    }
  }

  // ---- mirror the core: free what it evicted, forget what it dropped
  void drain() {
    auto [evicted, dropped_tids, dropped_recipes] = core.drain();
    for (int64_t t : evicted) free_value(t);
    for (int64_t t : dropped_tids) {
      if (t < static_cast<int64_t>(values.size())) values[t] = at::Tensor();
      if (t < static_cast<int64_t>(const_storage.size()) && const_storage[t]) {
        const_tid.erase(const_storage[t].unsafeGetStorageImpl());
        const_storage[t] = c10::Storage();
      }
    }
    for (int64_t r : dropped_recipes)
      if (r < static_cast<int64_t>(recipes.size())) recipes[r] = Recipe();
  }
  void free_value(int64_t t) {
    if (t >= static_cast<int64_t>(values.size()) || !values[t].defined()) return;
    c10::StorageImpl* s = values[t].storage().unsafeGetStorageImpl();
    if (s->_mutable_data_ptr_no_checks().get() == nullptr) return;  // a view of it went first
    at::DataPtr old =
        s->set_data_ptr(at::DataPtr(nullptr, s->_mutable_data_ptr_no_checks().device()));
    s->release_data_and_set_meta_custom_data_ptr_error_msg_(std::string(kEvictedMsg));
  }
  bool resident(int64_t t) const {
    return values[t].defined() &&
           values[t].storage().unsafeGetStorageImpl()->_mutable_data_ptr_no_checks().get() !=
               nullptr;
  }
  void set(std::vector<at::Tensor>& v, int64_t t, at::Tensor x) {
    if (static_cast<int64_t>(v.size()) <= t) v.resize(t + 1);
    v[t] = std::move(x);
  }

  // ---- constants (Runtime._constant): one per storage, counted while a recipe reads it
  int64_t constant(const at::Tensor& t, std::vector<int64_t>& fresh) {
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    auto it = const_tid.find(s);
    if (it != const_tid.end()) return it->second;
    int64_t tid = core.new_constant(static_cast<int64_t>(t.storage().nbytes()));
    const_tid[s] = tid;
    if (static_cast<int64_t>(const_storage.size()) <= tid) const_storage.resize(tid + 1);
    const_storage[tid] = t.storage();
    fresh.push_back(tid);
    return tid;
  }

  // ---- Driver.invalidate (csrc/protocol.h): what reads `seeds` is materialized and pinned
  void invalidate(const std::vector<int64_t>& seeds) {
    dtr::invalidate(core, seeds, [&](int64_t t) { rematerialize(t); }, [&] { drain(); });
  }
  void writes_to_plain(const at::Tensor& t) {
    auto it = const_tid.find(t.storage().unsafeGetStorageImpl());
    if (it != const_tid.end() && core.has_consumers(it->second)) invalidate({it->second});
  }

  // ---- Driver.rematerialize (csrc/protocol.h)
  void rematerialize(int64_t tid) {
    dtr::rematerialize(
        core, tid, [&](int64_t rid) { core.remat_done(rid, rerun(rid), {}); },
        [&](int64_t, int64_t need) {
          throw c10::OutOfMemoryError(
              {__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
              "dtr: the budget (" + std::to_string(core.budget) +
                  " bytes) cannot hold a recomputation's " + std::to_string(need) +
                  " bytes: " + std::to_string(core.resident_bytes) + " bytes resident, " +
                  std::to_string(core.pinned_bytes()) + " pinned, " +
                  std::to_string(core.constant_bytes()) + " constants, " +
                  std::to_string(core.locked_bytes()) + " locked");
        },
        [&] { drain(); });
  }

  std::vector<int64_t> rerun(int64_t rid) {
    Recipe& rec = recipes.at(rid);
    for (auto& [t, version] : rec.plain)
      if (t._version() != version)
        throw std::runtime_error(
            "dtr: a tensor this recomputation reads was written in place where dtr could not "
            "see it (another thread, or code outside any op)");
    torch::jit::Stack stack(rec.args.begin(), rec.args.end());
    for (const Slot& s : rec.slots) set_item(stack[s.arg], s.item, values.at(s.tid));
    auto start = std::chrono::steady_clock::now();
    {
      at::AutoGradMode grad(rec.grad);
      call_below(*rec.op, &stack);
    }
    recompute_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::vector<int64_t> nbytes;
    for (size_t k = 0; k < rec.outs.size(); ++k) {
      auto [i, j] = rec.outs[k];
      at::Tensor fresh = j < 0 ? stack[i].toTensor() : stack[i].toTensorList().get(j);
      int64_t tid = rec.out_tids[k];
      nbytes.push_back(static_cast<int64_t>(fresh.storage().nbytes()));
      if (tid < 0 || tid >= static_cast<int64_t>(values.size()) || !values[tid].defined()) continue;
      c10::StorageImpl* dst = values[tid].storage().unsafeGetStorageImpl();
      c10::StorageImpl* src = fresh.storage().unsafeGetStorageImpl();
      if (dst == src || dst->_mutable_data_ptr_no_checks().get() != nullptr) continue;
      if (src->nbytes() != dst->nbytes())
        throw std::runtime_error("dtr: a recomputation made a storage of another size");
      at::DataPtr data = src->set_data_ptr(at::DataPtr(nullptr, src->device()));
      dst->clear_data_ptr_access_error_msg_();
      dst->set_data_ptr_noswap(std::move(data));
    }
    return nbytes;
  }

  static void call_below(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
    // Below autograd (the managed tensor's own autograd key recorded the graph), and
    // without the session's PrivateUse1 key: the kernels see plain tensors only.
    auto local = c10::impl::tls_local_dispatch_key_set();
    c10::impl::ForceDispatchKeyGuard guard(
        local.included_.remove_backend(c10::BackendComponent::PrivateUse1Bit),
        local.excluded_ | c10::autograd_dispatch_keyset_with_ADInplaceOrView);
    op.callBoxed(stack);
  }

  void close() {
    std::lock_guard<std::recursive_mutex> g(mu);
    if (!open) return;
    std::exception_ptr error;  // the engine closes whatever happens (an interrupt, OOM)
    try {
      flush();
      // Everything still held is materialized (read after the block); then no lineage.
      core.budget = -1;
      for (int64_t t : core.alive())
        if (t < static_cast<int64_t>(values.size()) && values[t].defined() && !resident(t) &&
            !core.is_constant(t)) {
          core.lock(t);
          rematerialize(t);
          core.unlock(t);
        }
    } catch (...) {
      error = std::current_exception();
    }
    open = false;
    recipes.clear();
    values.clear();  // the program's tensors keep their own storages
    const_tid.clear();
    const_storage.clear();
    {
      std::lock_guard<std::mutex> p(pending_mu);
      pending.clear();
    }
    if (error) std::rethrow_exception(error);
  }
};

namespace {

// ---------------------------------------------------------------- the tensor
struct NativeImpl final : public c10::TensorImpl {
  NativeImpl(std::shared_ptr<Engine> eng, int64_t tid, const at::Tensor& value)
      : c10::TensorImpl(c10::DispatchKeySet(c10::DispatchKey::PrivateUse1), value.dtype(),
                        value.device()),
        eng_(std::move(eng)),
        tid_(tid) {
    storage_ = value.storage();
    sizes_and_strides_.set_sizes(value.sizes());
    sizes_and_strides_.set_strides(value.strides());
    storage_offset_ = value.storage_offset();
    refresh_numel();
    refresh_contiguous();
  }
  ~NativeImpl() override {
    if (eng_ && tid_ >= 0 && eng_->open) eng_->dropped(tid_);
  }

  template <typename VC>
  c10::intrusive_ptr<c10::TensorImpl> copy_core(VC&& vc, bool allow_meta_change) const {
    auto impl = c10::make_intrusive<NativeImpl>(Empty{}, eng_, key_set_, data_type_, device_opt_);
    copy_tensor_metadata(this, impl.get(), std::forward<VC>(vc), allow_meta_change);
    impl->tid_ = tid_;
    if (eng_ && tid_ >= 0) eng_->retain(tid_);  // the copy holds a handle of its own
    impl->refresh_numel();
    impl->refresh_contiguous();
    return impl;
  }
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      const c10::VariableVersion& vc, bool allow_meta_change) const override {
    return copy_core(vc, allow_meta_change);
  }
  c10::intrusive_ptr<c10::TensorImpl> shallow_copy_and_detach(
      c10::VariableVersion&& vc, bool allow_meta_change) const override {
    return copy_core(std::move(vc), allow_meta_change);
  }
  void shallow_copy_from(const c10::intrusive_ptr<c10::TensorImpl>& impl) override {
    auto* other = dynamic_cast<NativeImpl*>(impl.get());
    TORCH_CHECK(other != nullptr, "dtr: assigning a plain tensor's data to a managed one");
    copy_tensor_metadata(impl.get(), this, version_counter(), allow_tensor_metadata_change());
    if (other->eng_ && other->tid_ >= 0) other->eng_->retain(other->tid_);
    if (eng_ && tid_ >= 0) eng_->dropped(tid_);
    eng_ = other->eng_;
    tid_ = other->tid_;
    refresh_numel();
    refresh_contiguous();
  }
  const char* tensorimpl_type_name() const override { return "dtr.NativeImpl"; }

  struct Empty {};
  NativeImpl(Empty, std::shared_ptr<Engine> eng, c10::DispatchKeySet ks, caffe2::TypeMeta dtype,
             std::optional<c10::Device> device)
      : c10::TensorImpl(ks, dtype, device), eng_(std::move(eng)), tid_(-1) {}

  std::shared_ptr<Engine> eng_;
  int64_t tid_;
};

inline NativeImpl* as_native(const at::Tensor& t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->key_set().has(c10::DispatchKey::PrivateUse1))
    return nullptr;
  return dynamic_cast<NativeImpl*>(t.unsafeGetTensorImpl());
}

// A plain tensor over a managed one's storage and metadata (after the block, or a
// tensor of another session).
at::Tensor plain_view(const at::Tensor& t) {
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      c10::Storage(t.storage()), c10::DispatchKeySet(c10::DispatchKey::CPU), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}

struct Leaf {
  size_t arg;
  int64_t item;
  at::Tensor tensor;
  NativeImpl* native;  // managed by the active engine, else null
};

template <typename F>
void for_each_tensor(torch::jit::Stack* stack, size_t begin, size_t n, F f) {
  for (size_t i = 0; i < n; ++i) {
    const c10::IValue& iv = (*stack)[begin + i];
    if (iv.isTensor()) {
      f(i, -1, iv.toTensor());
    } else if (iv.isTensorList()) {
      auto l = iv.toTensorList();
      for (size_t j = 0; j < l.size(); ++j) f(i, static_cast<int64_t>(j), l.get(j));
    } else if (iv.isList()) {
      auto l = iv.toList();
      for (size_t j = 0; j < l.size(); ++j) {
        c10::IValue e = l.get(j);
        if (e.isTensor()) f(i, static_cast<int64_t>(j), e.toTensor());
      }
    }
  }
}

[[noreturn]] void refuse(const c10::OperatorHandle& op, const std::string& why) {
  throw c10::NotImplementedError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                 "dtr: the native engine does not serve " + op.schema().name() +
                                     " yet (" + why +
                                     "); use dtr.enable() (the default engine) for this program");
}

// ---------------------------------------------------------------- the fallback
void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t begin = stack->size() - n;
  std::shared_ptr<Engine> eng = active();
  std::vector<Leaf> leaves;
  bool managed = false, foreign = false, wants = false;
  for_each_tensor(stack, begin, n, [&](size_t i, int64_t j, const at::Tensor& t) {
    NativeImpl* impl = as_native(t);
    if (impl != nullptr && eng && impl->eng_ == eng && eng->open) {
      managed = true;
      leaves.push_back({i, j, t, impl});
    } else {
      if (impl != nullptr) foreign = true;
      if (t.defined() && t.requires_grad()) wants = true;
      leaves.push_back({i, j, t, nullptr});
    }
  });
  if (foreign)  // after the block, or another session's: plain values
    for (Leaf& l : leaves)
      if (!l.native && as_native(l.tensor)) {
        l.tensor = plain_view(l.tensor);
        set_item((*stack)[begin + l.arg], l.item, l.tensor);
      }
  wants = wants && at::GradMode::is_enabled();
  std::vector<size_t> written;  // argument positions the op writes
  for (size_t i = 0; i < n; ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite()) written.push_back(i);
  }
  auto is_written = [&](size_t i) {
    for (size_t w : written)
      if (w == i) return true;
    return false;
  };
  // A view of plain tensors stays plain (a parameter's t() in a linear layer).
  bool view = !schema.returns().empty();
  for (const auto& r : schema.returns())
    if (r.alias_info() == nullptr || r.alias_info()->isWrite()) view = false;
  if (!eng || !eng->open || (!managed && (!wants || view))) {
    if (eng && eng->open && !written.empty()) {
      std::lock_guard<std::recursive_mutex> g(eng->mu);
      eng->flush();
      for (const Leaf& l : leaves)
        if (is_written(l.arg)) eng->writes_to_plain(l.tensor);
    }
    Engine::call_below(op, stack);
    return;
  }
  Engine& e = *eng;
  std::lock_guard<std::recursive_mutex> g(e.mu);
  e.flush();
  bool writes_managed = false;
  for (const Leaf& l : leaves) {
    if (l.native && is_written(l.arg)) writes_managed = true;
    if (l.tensor.defined() && !l.tensor.is_cpu()) refuse(op, "v0 manages CPU tensors only");
  }
  const std::string& name = schema.name();
  if (writes_managed && (op.hasTag(at::Tag::inplace_view) || name == "aten::resize_" ||
                         name == "aten::resize_as_" || name == "aten::set_"))
    refuse(op, "it changes a managed tensor's shape or storage in place");
  // Random ops are not replayed yet: their results are plain tensors (never evicted;
  // counted while a recipe reads them), so nothing needs their generator state again.
  const bool seeded = op.hasTag(at::Tag::nondeterministic_seeded);
  Core& core = e.core;
  std::vector<int64_t> fresh, locked;
  auto finish = [&] {
    for (int64_t t : locked) core.unlock(t);
    for (int64_t t : fresh) core.release(t);
    locked.clear();
    fresh.clear();
  };
  try {
    // inputs: managed ones locked and rebuilt if evicted; plain ones registered as constants
    std::vector<int64_t> tids(leaves.size(), -1);
    for (size_t k = 0; k < leaves.size(); ++k) {
      Leaf& l = leaves[k];
      if (l.native) {
        tids[k] = l.native->tid_;
        core.lock(tids[k]);
        locked.push_back(tids[k]);
      }
    }
    for (size_t k = 0; k < leaves.size(); ++k) {
      Leaf& l = leaves[k];
      if (!l.native) {
        if (l.tensor.defined() && !is_written(l.arg)) tids[k] = e.constant(l.tensor, fresh);
        continue;
      }
      if (!e.resident(tids[k])) e.rematerialize(tids[k]);
      set_item((*stack)[begin + l.arg], l.item, e.values[tids[k]]);
    }
    const bool record = written.empty() && !seeded;
    // An in-place write to a managed tensor: no version yet (step 3), so the tensor and
    // everything whose lineage reads it are materialized and pinned first (Invariant 4,
    // the aliased case): no recipe will read the old value again.
    for (size_t k = 0; k < leaves.size(); ++k) {
      const Leaf& l = leaves[k];
      if (!is_written(l.arg)) continue;
      if (l.native) {
        e.invalidate(core.members(tids[k]));
      } else {
        e.writes_to_plain(l.tensor);
      }
    }
    std::vector<c10::IValue> args;  // the recipe's (recorded ops only)
    if (record) args.assign(stack->begin() + begin, stack->end());
    auto start = std::chrono::steady_clock::now();
    Engine::call_below(op, stack);
    double cost = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (!record) {  // a write (an optimizer reading managed gradients), or a random op
      // the program gets back the managed tensors it wrote, not their plain values
      const size_t nret = schema.returns().size();
      for (size_t i = stack->size() - nret; i < stack->size(); ++i) {
        c10::IValue& r = (*stack)[i];
        if (!r.isTensor()) continue;
        for (size_t k = 0; k < leaves.size(); ++k)
          if (leaves[k].native && is_written(leaves[k].arg) &&
              r.toTensor().is_same(e.values[tids[k]])) {
            r = leaves[k].tensor;
            break;
          }
      }
      finish();
      e.drain();
      return;
    }
    // outputs: a view of an input (same storage), of an earlier output, or fresh
    const size_t nret = schema.returns().size();
    const size_t rbegin = stack->size() - nret;
    std::vector<int64_t> kinds, refs, nbytes;
    std::vector<std::pair<size_t, int64_t>> outs;
    std::vector<at::Tensor> produced;
    std::vector<const c10::StorageImpl*> fresh_storage;
    for (size_t i = 0; i < nret; ++i) {
      auto take = [&](int64_t j, const at::Tensor& t) {
        if (!t.defined() || t.layout() != c10::kStrided) return;
        const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
        int64_t src = -1;  // the last input sharing its storage (a managed tensor shares
                           // its value's)
        for (size_t k = leaves.size(); k-- > 0;)
          if (tids[k] >= 0 && leaves[k].tensor.storage().unsafeGetStorageImpl() == s) {
            src = static_cast<int64_t>(k);
            break;
          }
        int64_t earlier = -1;
        for (size_t q = 0; q < fresh_storage.size(); ++q)
          if (fresh_storage[q] == s) earlier = static_cast<int64_t>(q);
        if (src >= 0) {
          if (!leaves[src].native) return;  // a view of a constant stays plain
          kinds.push_back(kView);
          refs.push_back(tids[src]);
          nbytes.push_back(0);
          fresh_storage.push_back(nullptr);
        } else if (earlier >= 0) {
          kinds.push_back(kView);
          refs.push_back(-(earlier + 1));
          nbytes.push_back(0);
          fresh_storage.push_back(nullptr);
        } else {
          kinds.push_back(kNew);
          refs.push_back(-1);
          nbytes.push_back(static_cast<int64_t>(t.storage().nbytes()));
          fresh_storage.push_back(s);
        }
        outs.emplace_back(i, j);
        produced.push_back(t);
      };
      const c10::IValue& r = (*stack)[rbegin + i];
      if (r.isTensor()) {
        take(-1, r.toTensor());
      } else if (r.isTensorList()) {
        auto l = r.toTensorList();
        for (size_t j = 0; j < l.size(); ++j) take(static_cast<int64_t>(j), l.get(j));
      }
    }
    std::vector<int64_t> out_tids;
    if (!kinds.empty()) {
      std::vector<int64_t> inputs;
      Recipe rec;
      rec.op = op;
      rec.grad = at::GradMode::is_enabled();
      for (size_t k = 0; k < leaves.size(); ++k) {
        if (tids[k] < 0) continue;
        inputs.push_back(tids[k]);
        if (leaves[k].native) {
          rec.slots.push_back({leaves[k].arg, leaves[k].item, tids[k]});
        } else {
          rec.plain.emplace_back(leaves[k].tensor, leaves[k].tensor._version());
        }
      }
      // the recipe holds no managed value: its slots are filled at each replay
      rec.args = std::move(args);
      for (const Slot& s : rec.slots) set_item(rec.args[s.arg], s.item, at::Tensor());
      rec.outs = outs;
      out_tids = core.record(inputs, cost, kinds, refs, nbytes);
      rec.out_tids = out_tids;
      int64_t rid = core.recipe_of(out_tids[0]);
      if (static_cast<int64_t>(e.recipes.size()) <= rid) e.recipes.resize(rid + 1);
      e.recipes[rid] = std::move(rec);
      for (size_t q = 0; q < out_tids.size(); ++q) e.set(e.values, out_tids[q], produced[q]);
      // the program's result: managed tensors for the recorded outputs
      for (size_t q = 0; q < out_tids.size(); ++q) {
        auto [i, j] = outs[q];
        at::Tensor w = at::detail::make_tensor<NativeImpl>(eng, out_tids[q], produced[q]);
        set_item((*stack)[rbegin + i], j, w);
      }
    }
    finish();
    e.drain();
    // the op boundary (Runtime._settle): its fresh outputs protected while choosing
    for (int64_t t : out_tids) core.lock(t);
    bool ok = core.make_room(0);
    for (int64_t t : out_tids) core.unlock(t);
    e.drain();
    if (!ok)
      throw c10::OutOfMemoryError({__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                                  "dtr: the budget (" + std::to_string(core.budget) +
                                      " bytes) cannot be met after " + schema.name() + ": " +
                                      std::to_string(core.resident_bytes) + " bytes resident, " +
                                      std::to_string(core.pinned_bytes()) + " pinned, " +
                                      std::to_string(core.locked_bytes()) + " locked");
  } catch (...) {
    finish();
    e.drain();
    throw;
  }
}

// The registrations live as long as the process (never deregistered at exit, when
// the dispatcher may already be gone).
torch::Library* g_fallback_lib = nullptr;
torch::Library* g_routed_lib = nullptr;

}  // namespace

// Registered on first use, not at import: a process may have a real PrivateUse1 backend.
void install(const std::vector<std::string>& composite_ops) {
  if (g_fallback_lib) return;
  g_fallback_lib = new torch::Library(
      torch::Library::IMPL, "_", std::optional<c10::DispatchKey>(c10::DispatchKey::PrivateUse1),
      __FILE__, __LINE__);
  g_fallback_lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
  // Ops with a CompositeExplicitAutograd kernel take it at PrivateUse1 before any
  // fallback: route them here too.
  g_routed_lib = new torch::Library(torch::Library::IMPL, "aten",
                                    std::optional<c10::DispatchKey>(c10::DispatchKey::PrivateUse1),
                                    __FILE__, __LINE__);
  for (const auto& name : composite_ops)
    g_routed_lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
}

void bind(py::module_& m) {
  py::class_<Engine, std::shared_ptr<Engine>>(m, "NativeEngine")
      .def(py::init<const std::string&, int64_t, uint64_t>(), py::arg("heuristic") = "dtr",
           py::arg("budget") = -1, py::arg("seed") = 0)
      .def("activate",
           [](std::shared_ptr<Engine> self) {
             std::lock_guard<std::mutex> g(g_mu);
             if (g_engine && g_engine->open)
               throw std::runtime_error("dtr: a native session is already open");
             g_engine = self;
           })
      .def("close",
           [](std::shared_ptr<Engine> self) {
             auto deactivate = [&] {
               std::lock_guard<std::mutex> g(g_mu);
               if (g_engine == self) g_engine.reset();
             };
             try {
               // without the GIL: an op holding the engine's lock may need it (a tensor
               // whose Python object it frees)
               py::gil_scoped_release nogil;
               self->close();
             } catch (...) {
               deactivate();
               throw;
             }
             deactivate();
           })
      .def_property_readonly("open", [](Engine& e) { return e.open.load(); })
      .def("stats",
           [](Engine& e) {
             std::lock_guard<std::recursive_mutex> g(e.mu);
             py::dict d;
             d["ops"] = e.core.ops;
             d["evictions"] = e.core.evictions;
             d["eager_evictions"] = e.core.eager_evictions;
             d["remats"] = e.core.remats;
             d["recompute_seconds"] = e.recompute_seconds;
             d["peak_resident_bytes"] = e.core.peak_bytes;
             d["max_transient_bytes"] = e.core.max_bytes;
             d["resident_bytes"] = e.core.resident_bytes;
             d["pinned_bytes"] = e.core.pinned_bytes();
             d["constant_bytes"] = e.core.constant_bytes();
             d["search_seconds"] = e.core.search_seconds;
             return d;
           })
      .def("check", [](Engine& e) {
        std::lock_guard<std::recursive_mutex> g(e.mu);
        e.core.check();
      });
  m.def("native_install", &install, py::arg("composite_ops"));
  m.def("is_native", [](const at::Tensor& t) { return as_native(t) != nullptr; });
}

}  // namespace native
}  // namespace dtr
