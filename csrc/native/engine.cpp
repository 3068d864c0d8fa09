// The native engine (experimental; docs/design.md, "The private-key route"): managed tensors
// are a C++ TensorImpl carrying the engine's dispatch key (kKey: device still that of their
// value), and every op reaches one boxed fallback, with no Python on the way: the session
// includes kKey in its thread's TLS key set, so ops on plain tensors come here too
// (the job of the Python route's dispatch mode). The bookkeeping is the same C++ Core.
//
// A managed tensor shares its value's StorageImpl. Evicting frees that storage's memory
// (its DataPtr swapped for a null one, with an error message for anything that reads it
// directly); recomputing puts the new value's DataPtr back, so views and autograd's saved
// copies, which share the StorageImpl, see it.
//
// Served: ops that write nothing (views included) on managed tensors, ops on plain
// tensors (writes to a plain tensor a recipe reads pin what depends on it first, as
// Runtime._writes_to_plain), ops that write plain tensors from managed ones (an optimizer
// reading managed gradients), in-place writes to managed tensors (Invariant 4: a new
// version when the tensor is private, else what reads it is pinned; a recipe that must
// read a written argument's old value reads a copy taken before the op), in-place view ops
// (x.squeeze_(): the view op, x naming its result), random ops (replayed from the
// generator state captured before they ran, Invariant 1), and ops on sparse, quantized or
// nested tensors (left plain; a plain sparse tensor a managed op reads is a constant of
// its recipe, but a COO transpose is taken again from its source and torch.sparse.mm's
// zeros is read as a managed copy: dtr/engines/subclass/rebuildable_plain.py, Made below). Refused with
// dtr.UnsupportedError naming the op: in-place ops that replace a managed tensor's
// storage (resize_, set_; set_ also with a managed source, as the subclass engine
// refuses it), a managed tensor mixed with a sparse one. Values may be on any device
// with memory (proven on the CPU and the tests' emulated accelerator): a plain value is a
// tensor of its storage's device (over()), a random op replays from that device's
// generator. Gradients accumulated into a leaf's .grad are handed out plain, as by the default
// engine. A budget that cannot be met raises dtr.BudgetError with the numbers. Before an
// op runs under a budget, room is made for the bytes the last call with the same op and
// input shapes allocated (dtr/engines/subclass/kernel_peaks.py).
// Stress mode evicts everything evictable after every op. A trace (csrc/native/trace.h)
// records the core calls in the subclass engine's format, for dtr.sim. torch.distributed's
// collectives get plain tensors and are not recorded (collective(), below). An op on a
// device other than the CPU whose allocator runs out of memory is run again after dtr
// evicts (NativeEngine::call_evicting).
#include "native/engine.h"
#include "cpu_cache.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/record_function.h>
#include <ATen/core/enum_tag.h>
#include <c10/core/TensorImpl.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/extension.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <regex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include "core/core.h"
#include "leaf_hooks.h"
#include "native/trace.h"
#include "core/rebuild.h"
#include "core/roofline.h"

namespace py = pybind11;

namespace dtr {
namespace native {

// The engine's backend: PrivateUse3, which no backend of stock PyTorch claims
// (out-of-tree accelerators take PrivateUse1 and rename it), so the engine runs beside
// such a backend. Every key the engine registers at or carries is derived from it here
// (dtr/engines/native/key.py names the same key for Python).
constexpr c10::BackendComponent kBackend = c10::BackendComponent::PrivateUse3Bit;
constexpr c10::DispatchKey per_backend(c10::DispatchKey functionality) {
  return c10::toRuntimePerBackendFunctionalityKey(functionality, kBackend);
}
constexpr c10::DispatchKey kKey = per_backend(c10::DispatchKey::Dense);
constexpr c10::DispatchKey kAutogradKey = per_backend(c10::DispatchKey::AutogradFunctionality);
// a managed op's sparse, quantized or nested arguments or results (left plain)
constexpr c10::DispatchKey kOtherLayoutKeys[] = {
    per_backend(c10::DispatchKey::Sparse), per_backend(c10::DispatchKey::SparseCsr),
    per_backend(c10::DispatchKey::Quantized), per_backend(c10::DispatchKey::NestedTensor)};

struct NativeEngine;

namespace {

const char* kEvictedMsg =
    "dtr: this tensor's value is evicted, and reading its memory directly (numpy(), tolist(), "
    "data_ptr(), torch.save) does not recompute it; run an op on it first (t.clone()) or "
    "read it after the block";
// An evicted tensor the program still held when its block ended with a BudgetError
// (NativeEngine::close; dtr/engines/subclass/tensor.py's LOST_MESSAGE is the same text).
const char* kLostMsg =
    "dtr: this tensor was evicted when its dtr.enable() block ended with a BudgetError, and "
    "is not rebuilt after it (that would take memory past the budget); compute it again "
    "(in a block with a larger budget)";

std::mutex g_mu;                   // guards g_engine
std::shared_ptr<NativeEngine> g_engine;  // the open session's engine (one at a time)

std::shared_ptr<NativeEngine> active() {
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

// The tensor an argument holds: the argument itself (item < 0) or item `item` of a list.
at::Tensor get_item(const c10::IValue& iv, int64_t item) {
  if (item < 0) return iv.toTensor();
  return iv.isTensorList() ? iv.toTensorList().get(item) : iv.toList().get(item).toTensor();
}

// Output sizes learned per op and input shapes (dtr/engines/subclass/kernel_peaks.py): a call allocates about
// what the last call with the same op, shapes and dtypes did, so that much is evicted
// before the op runs rather than sitting on top of the budget until the boundary after
// it (an LSTM layer's 30 MiB workspace).
struct SizeKeyHash {
  size_t operator()(const std::vector<int64_t>& v) const {
    uint64_t h = 1469598103934665603ull;
    for (int64_t x : v) h = (h ^ static_cast<uint64_t>(x)) * 1099511628211ull;
    return static_cast<size_t>(h);
  }
};
constexpr size_t kMaxSizeEntries = 100000;  // ever-new shapes: forget and start again

bool contains(const std::vector<int64_t>& v, int64_t x) {
  for (int64_t y : v)
    if (y == x) return true;
  return false;
}

// dtr::BudgetExceeded (core.h): raised to Python as dtr.BudgetError (a
// torch.OutOfMemoryError), converted where no engine lock is held.

// The whole message: the numbers, then dtr.errors.budget_advice's advice (one wording for
// both engines). Called where the error goes to Python, with no engine lock held.
std::string budget_text(const BudgetExceeded& b) {
  std::string text = b.what();
  if (b.budget < 0) return text;
  py::gil_scoped_acquire gil;
  py::object errors = py::module_::import("dtr.errors");
  py::object floor = errors.attr("Floor")(b.floor, b.floor_need, b.floor_op, b.floor_in_step,
                                          b.free_peak);
  return text + errors.attr("budget_advice")(b.budget, b.constants, b.what_for, b.requested, floor)
                    .cast<std::string>();
}

// An op the engine does not serve on managed tensors: raised to Python as
// dtr.UnsupportedError (a NotImplementedError), converted as BudgetExceeded is.
struct Unsupported : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The allocator ran out of memory inside an op and dtr could not (or would not) evict and
// run it again: raised to Python as dtr.BudgetError, worded by
// dtr/engines/subclass/oom.py's oom_message from the numbers taken when it failed.
struct OutOfMemory : std::runtime_error {
  OutOfMemory(const std::string& said, std::string op, bool retried, int64_t resident,
              int64_t pinned, int64_t locked)
      : std::runtime_error(said), op(std::move(op)), retried(retried), resident(resident),
        pinned(pinned), locked(locked) {}
  std::string op;
  bool retried;
  int64_t resident, pinned, locked;
};

// The allocation that failed, read from the allocator's message as
// dtr/engines/subclass/oom.py's requested_bytes does (0: not said).
int64_t requested_bytes(const std::string& said) {
  static const std::regex kRequest(R"([Tt]ried to allocate ([\d.]+) ?(B|bytes|KiB|MiB|GiB|TiB))");
  std::smatch m;
  if (!std::regex_search(said, m, kRequest)) return 0;
  const std::string unit = m[2];
  const int shift = unit == "KiB" ? 10 : unit == "MiB" ? 20 : unit == "GiB" ? 30 : unit == "TiB" ? 40 : 0;
  return static_cast<int64_t>(std::stod(m[1]) * static_cast<double>(int64_t{1} << shift));
}

// How Python names an op overload (str(torch.ops.aten.squeeze_.dim)): the subclass engine's
// messages name ops so, and the two engines' messages are the same.
std::string py_name(const c10::FunctionSchema& schema) {
  std::string name = schema.name();
  const size_t colon = name.find("::");
  if (colon != std::string::npos) name.replace(colon, 2, ".");
  return name + "." + (schema.overload_name().empty() ? "default" : schema.overload_name());
}

// A managed tensor's identity. Every NativeImpl naming the same core tensor (an op's
// result, autograd's saved copies of it, detach()) shares one Cell, so that an in-place
// write giving that tensor a new version (Core::version) renames all of them at once.
struct Cell {
  int64_t tid;
};

struct Out {     // where a recipe's core output comes from
  size_t ret;    // the return it is (or an item of), when slot < 0
  int64_t item;  // index in a list return, or -1
  int64_t slot;  // a new version: the index in `slots` of the argument written in place
  // A pool version's follower (Core::follow): another member of the storage the version
  // in `slot` was computed in (its value keeps its own geometry over that storage).
  bool follows = false;
};

// The sparse layouts whose plain tensors a recipe may read, and the parts whose storages
// hold such a tensor's memory, each a constant of what reads it (dtr/engines/subclass/storage_keys.py).
bool is_sparse_layout(const at::Tensor& t) {
  const c10::Layout l = t.layout();
  return l == c10::kSparse || l == c10::kSparseCsr || l == c10::kSparseCsc ||
         l == c10::kSparseBsr || l == c10::kSparseBsc;
}

std::vector<at::Tensor> sparse_parts(const at::Tensor& t) {
  switch (t.layout()) {
    case c10::kSparse:
      return {t._indices(), t._values()};
    case c10::kSparseCsr:
    case c10::kSparseBsr:
      return {t.crow_indices(), t.col_indices(), t.values()};
    case c10::kSparseCsc:
    case c10::kSparseBsc:
      return {t.ccol_indices(), t.row_indices(), t.values()};
    default:
      return {};
  }
}

// A plain tensor a recipe reads, as it was when recorded. What can happen to it with no op
// the engine sees: a write (another thread: its version moves), `p.data = new` or
// Module.half() (its storage is swapped), FSDP2's reshard (its storage resized to 0).
// The storage is held, as the subclass engine holds a constant's.
struct PlainRead {
  at::Tensor t;
  uint32_t version;
  c10::Storage storage;
  explicit PlainRead(const at::Tensor& x)
      : t(x), version(x._version()), storage(x.has_storage() ? x.storage() : c10::Storage()) {}
};

// A plain sparse tensor a recipe reads that it takes again from the tensor it was made
// from when it replays, rather than hold (dtr/engines/subclass/recipe.py's Rebuilt, dtr/engines/subclass/rebuildable_plain.py):
// autograd's adj.t() per backward product of torch.sparse.mm, which for a COO adj copies
// its indices and values. Made below autograd at each replay and dropped after it, so it
// is never counted.
struct Rebuilt {
  size_t arg;                     // where it sits in the recipe's arguments
  int64_t item;                   // index in a list argument, or -1
  c10::OperatorHandle op;         // t or transpose.int
  std::vector<c10::IValue> args;  // its arguments, the source first (held while it may replay)
};

struct Recipe {
  std::optional<c10::OperatorHandle> op;
  std::vector<c10::IValue> args;  // the call's arguments, managed tensors as None
  std::vector<Slot> slots;
  std::vector<Out> outs;  // per core output
  std::vector<int64_t> out_tids;
  std::vector<PlainRead> plain;  // a Rebuilt's source stands for it here
  std::vector<Rebuilt> rebuilt;
  // a random op: its generator and that generator's state before the op first ran
  std::optional<at::Generator> gen;
  at::Tensor rng_state;
  // written arguments that are copies taken before the op: each replay writes a copy of
  // the copy, so that the next one reads the same value
  std::vector<std::pair<size_t, int64_t>> scratch;
  bool grad = false;
  bool out_form = false;  // it writes an out= argument, which it may resize (OpFacts)
};

// A warning handler that drops what it is given.
struct DropWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// Below the session: without its key (kernels see plain tensors only) and
// below autograd (a managed tensor's own autograd key recorded the graph).
struct Below {
  Below()
      : local_(c10::impl::tls_local_dispatch_key_set()),
        guard_(local_.included_.remove_backend(kBackend),
               local_.excluded_ | c10::autograd_dispatch_keyset_with_ADInplaceOrView) {}
  c10::impl::LocalDispatchKeySet local_;
  c10::impl::ForceDispatchKeyGuard guard_;
};

// The keys of t's value that are part of its meaning, not of its device: a lazy
// conjugate or negation (a conj() view's bit, ifft's result), a zero tensor. A tensor
// standing for t must carry them, or it reads as another value.
c10::DispatchKeySet meaning_keys(const at::Tensor& t) {
  constexpr c10::DispatchKeySet kMeaning(
      {c10::DispatchKey::Conjugate, c10::DispatchKey::Negative, c10::DispatchKey::ZeroTensor});
  return t.unsafeGetTensorImpl()->key_set() & kMeaning;
}

// A plain tensor with t's metadata over `storage`, on the storage's device (its backend's
// key: the kernels below the engine's are that device's).
at::Tensor over(const at::Tensor& t, c10::Storage storage) {
  const c10::DispatchKey backend =
      c10::computeDispatchKey(std::nullopt, c10::kStrided, storage.device());
  auto impl = c10::make_intrusive<c10::TensorImpl>(
      std::move(storage), c10::DispatchKeySet(backend) | meaning_keys(t), t.dtype());
  impl->set_sizes_and_strides(t.sizes(), t.strides(), t.storage_offset());
  return at::Tensor(std::move(impl));
}

// A copy of t's whole storage, with t's metadata: an in-place op run on it writes the same
// bytes as on t (bitwise the same layout), and its storage has t's size.
at::Tensor copy_storage(const at::Tensor& t) {
  Below below;
  const int64_t nbytes = static_cast<int64_t>(t.storage().nbytes());
  auto bytes = at::empty({0}, t.options().dtype(at::kByte));
  bytes.set_(t.storage(), 0, {nbytes}, {1});
  return over(t, bytes.clone().storage());
}

// A storage of nbytes holding nothing, that reports kEvictedMsg when read (guarded; else
// its data pointer reads as null). Resizable, as the storage a kernel makes is: an out= op
// recomputed in it may resize it.
c10::Storage empty_storage(size_t nbytes, c10::Device device, bool guarded = true) {
  c10::Storage s(c10::Storage::use_byte_size_t(), nbytes, at::DataPtr(nullptr, device),
                 c10::GetAllocator(device.type()), /*resizable=*/true);
  if (guarded)
    s.unsafeGetStorageImpl()->release_data_and_set_meta_custom_data_ptr_error_msg_(
        std::string(kEvictedMsg));
  return s;
}

// dtr/engines/subclass/rebuildable_plain.py: plain tensors made in the block that a recipe can make again rather than
// hold. Entries are keyed by the tensor's TensorImpl and lead with a weak reference (a
// transpose's to the tensor, which keeps the address from being reused by another tensor
// while the entry lives, so an entry found by a live tensor's address is that tensor's;
// a fill's to its storage once settled, see MadeByFill), never holding the tensor's
// memory. Entries whose referent died are dropped once the table has doubled since the
// last pruning (rebuildable_plain.py's _Made).
//
// A new entry's versions are settled when the next op comes to the engine: the op that
// made the tensor is not done when the engine returns it, since the kernel above it
// (ADInplaceOrView) then bumps a fill's version and gives a view its base's version
// counter (a COO adj.t() is a copy that autograd treats as a view). Each entry's
// settle() reads them then, or returns false if they moved in any other way.
template <typename Entry>
struct Made {
  static constexpr size_t kPruneAt = 4096;
  std::unordered_map<const c10::TensorImpl*, Entry> entries;
  std::vector<const c10::TensorImpl*> unsettled;
  size_t prune_at = kPruneAt;

  void add(const at::Tensor& t, Entry entry) {
    if (entries.size() >= prune_at) {
      for (auto it = entries.begin(); it != entries.end();)
        it = it->second.expired() ? entries.erase(it) : std::next(it);
      prune_at = std::max(kPruneAt, 2 * entries.size());
    }
    entries.insert_or_assign(t.unsafeGetTensorImpl(), std::move(entry));
    unsettled.push_back(t.unsafeGetTensorImpl());
  }
  void settle() {
    for (const c10::TensorImpl* key : unsettled) {
      auto it = entries.find(key);
      if (it != entries.end() && !it->second.settle()) entries.erase(it);
    }
    unsettled.clear();
  }
  const Entry* find(const at::Tensor& t) const {
    auto it = entries.find(t.unsafeGetTensorImpl());
    return it == entries.end() || !it->second.settled ? nullptr : &it->second;
  }
  void clear() {
    entries.clear();
    unsettled.clear();
    prune_at = kPruneAt;
  }
};

c10::weak_intrusive_ptr<c10::TensorImpl> weak(const at::Tensor& t) {
  return c10::weak_intrusive_ptr<c10::TensorImpl>(t.getIntrusivePtr());
}

// A plain tensor filled whole with one value and untouched since (FreshFactories): the
// factory call that makes that value again. Once settled, the entry holds a weak
// reference to the tensor's storage (whose address is then not reused), not to the
// tensor: torch.utils.swap_tensors refuses a tensor that has one. (Until then it needs
// the tensor's version counter, read through a weak reference to the tensor; holding the
// counter itself would make the factory's Python binding copy the tensor.) A tensor found
// at the entry's TensorImpl address holds the value if it covers that storage whole, with
// the fill's sizes and dtype, at the settled version.
struct MadeByFill {
  c10::weak_intrusive_ptr<c10::TensorImpl> unsettled;  // until settled
  c10::weak_intrusive_ptr<c10::StorageImpl> ref;
  std::vector<int64_t> sizes;
  at::ScalarType dtype;
  c10::OperatorHandle op;         // zeros or full
  std::vector<c10::IValue> args;  // no tensors
  int64_t version;                // before the fill's own bump, until settled
  bool settled = false;

  bool expired() const { return ref.expired(); }
  bool settle() {
    c10::intrusive_ptr<c10::TensorImpl> t = unsettled.lock();
    unsettled.reset();
    if (!t) return false;
    const int64_t now = t->version_counter().current_version();
    if (now != version && now != version + 1) return false;
    version = now;
    settled = true;
    return true;
  }
  bool holds_value_of(const at::Tensor& t) const {
    c10::intrusive_ptr<c10::StorageImpl> storage = ref.lock();
    return storage && t.has_storage() && t.storage().unsafeGetStorageImpl() == storage.get() &&
           t.scalar_type() == dtype && t.sizes() == c10::IntArrayRef(sizes) &&
           t.is_contiguous() && t.storage_offset() == 0 && t.nbytes() == storage->nbytes() &&
           t._version() == version;
  }
};

// A transpose of a plain COO tensor (FreshTransposes): its source, by weak reference too
// (the registry must not keep a program's sparse tensors alive), and both versions.
// Compressed layouts (CSR, CSC, ...) are left out: their transpose shares every part with
// its source, so holding it costs nothing, and their TensorImpl keeps its parts until the
// last weak reference to it is gone (a COO one releases them with the last strong one).
struct MadeByTranspose {
  c10::weak_intrusive_ptr<c10::TensorImpl> ref;
  c10::weak_intrusive_ptr<c10::TensorImpl> source;
  c10::OperatorHandle op;
  std::vector<c10::IValue> args;  // the call's arguments, the source's as None
  int64_t version;                // its own counter's, until settled
  int64_t source_version;
  bool settled = false;

  bool expired() const { return ref.expired(); }

  bool settle() {
    c10::intrusive_ptr<c10::TensorImpl> t = ref.lock();
    c10::intrusive_ptr<c10::TensorImpl> s = source.lock();
    if (!t || !s) return false;
    const int64_t now = t->version_counter().current_version();
    const int64_t source_now = s->version_counter().current_version();
    // its own counter, or its source's (autograd's view), and the source unwritten
    if ((now != version && now != source_now) || source_now != source_version) return false;
    version = now;
    settled = true;
    return true;
  }
};

c10::Device device_of(const torch::jit::Stack& stack, size_t begin);

}  // namespace

struct NativeEngine : std::enable_shared_from_this<NativeEngine> {
  NativeEngine(const std::string& heuristic, int64_t budget, uint64_t seed, bool roofline)
      : core(heuristic, budget, seed, 0), seed(seed), roofline(roofline) {}

  Core core;
  const uint64_t seed;  // the random heuristic's (a trace records it)
  std::recursive_mutex mu;
  std::atomic<bool> open{true};
  std::vector<at::Tensor> values;  // per tid: the plain tensor over the shared StorageImpl
  // per tid: the Cell the program's tensors naming it share (a pool version renames the
  // cells of the written storage's other members)
  std::vector<std::weak_ptr<Cell>> cells;
  std::vector<Recipe> recipes;     // per recipe id
  std::vector<std::pair<int64_t, size_t>> output_of;  // per tid: (recipe, output) or -1
  std::unordered_map<const c10::StorageImpl*, int64_t> const_tid;  // constant storages
  std::vector<c10::Storage> const_storage;                         // per tid, kept alive
  std::mutex pending_mu;
  // Handles dropped since the last op. Cells, not ids: a write in between may have given
  // the tensor a new version, which took its handles over.
  std::vector<std::shared_ptr<Cell>> pending;
  double recompute_seconds = 0.0;
  int64_t oom_retries = 0;  // ops run again after the allocator ran out and dtr evicted
  bool steal_broken = false;  // a rerun that wrote into an old version's storage failed
  // Gradients are handed out plain (Runtime._grad_ready): Python's hook for a leaf, set by
  // dtr.engines.native.session, called once per leaf; the leaves hooked so far (weak: a pointer is not
  // reused while its weak reference is held).
  py::object leaf_hook;
  std::unordered_map<const c10::TensorImpl*, c10::weak_intrusive_ptr<c10::TensorImpl>> hooked;
  size_t prune_hooked_at = 64;
  // values handed out plain: their storage, per tid (a write to it invalidates readers)
  std::unordered_map<const c10::StorageImpl*, int64_t> escaped;
  std::vector<const c10::StorageImpl*> escaped_storage;
  // Every storage handed out plain, while it lives (weak: the pointer is not reused while
  // held). Its tensor's pin ends when that tensor is dropped, and its pool can then be
  // evicted for the other members' sake; the memory is the program's from then on.
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> handed_out;
  size_t prune_handed_out_at = 64;
  // Plain storages handed out by address in the block (p.detach().numpy(), from_dlpack,
  // untyped_storage(), data_ptr(): dtr/plain_exports.py), while they live (weak: the
  // pointer is not reused while held): volatile from then on, as foreign memory is.
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>>
      exported_plain;
  size_t prune_exported_plain_at = 64;
  // The latest snapshot of each volatile storage, while a recipe holds it (weak: the table
  // never keeps a copy alive): dtr/engines/subclass/volatile.py's Snapshots.
  std::unordered_map<const c10::StorageImpl*, c10::weak_intrusive_ptr<c10::StorageImpl>> snapshots;
  size_t prune_snapshots_at = 64;
  // Plain tensors made in the block that a recipe makes again rather than hold
  // (dtr/engines/subclass/rebuildable_plain.py): torch.sparse.mm's zeros, autograd's transposed copy of a COO adj.
  Made<MadeByFill> made_by_fill;
  Made<MadeByTranspose> made_by_transpose;
  std::unordered_map<std::vector<int64_t>, int64_t, SizeKeyHash> out_sizes;  // reserve
  // An op's cost: its measured wall time, or the roofline estimate (csrc/core/roofline.h),
  // with which the same program under the same budget evicts the same tensors each run.
  const bool roofline;
  bool reserve = true;           // make room before an op (tests and benchmarks turn it off)
  bool stress = false;           // evict everything evictable after every op (testing mode)
  std::unique_ptr<Trace> trace;  // the operator trace being written, if any
  bool check = false;            // verify the core's invariants after every op (tests)
  // The newest timeline_limit op boundaries (dtr/timeline.py's columns), if any.
  struct Row {
    int64_t ops;
    c10::OperatorHandle op;
    bool backward;
    int64_t before, resident, evictions, remats;
  };
  size_t timeline_limit = 0;
  std::deque<Row> timeline;
  void timeline_row(const c10::OperatorHandle& op, int64_t before) {
    if (timeline.size() >= timeline_limit) timeline.pop_front();
    timeline.push_back({core.ops, op, torch::autograd::get_current_graph_task_id() != -1, before,
                        core.resident_bytes, core.evictions, core.remats});
  }
  // (peak resident, peak transient) when the block ended, before close() materialized
  std::optional<std::pair<int64_t, int64_t>> closing_peaks;

  ~NativeEngine() {
    if (!leaf_hook) return;
    if (Py_IsInitialized()) {
      py::gil_scoped_acquire gil;
      leaf_hook = py::object();
    } else {
      leaf_hook.release();  // the interpreter is gone: nothing to decrement
    }
  }

  // ---- handles
  void retain(const Cell& cell) {
    std::lock_guard<std::recursive_mutex> g(mu);
    if (open) core.retain(cell.tid);
  }
  void dropped(std::shared_ptr<Cell> cell) {  // from a destructor: any thread, maybe in an op
    std::lock_guard<std::mutex> g(pending_mu);
    pending.push_back(std::move(cell));
  }
  void flush() {
    settle_made();
    while (true) {
      std::vector<std::shared_ptr<Cell>> now;
      {
        std::lock_guard<std::mutex> g(pending_mu);
        now.swap(pending);
      }
      if (now.empty()) return;
      if (open)
        for (const auto& cell : now) {
          // the trace gives a tensor one handle: its RELEASE is the program's last one
          if (trace && core.ext(cell->tid) == 1) trace->release(cell->tid);
          core.release(cell->tid);
        }
      drain();
    }
  }

  // ---- mirror the core: free what it evicted, forget what it dropped
  void drain() {
    auto [evicted, dropped_tids, dropped_recipes] = core.drain();
    for (int64_t t : evicted) free_value(t);
    for (int64_t t : dropped_tids) {
      if (t < static_cast<int64_t>(values.size())) values[t] = at::Tensor();
      if (t < static_cast<int64_t>(output_of.size()) && output_of[t].first >= 0) {
        // its id may be reused: the recipe that made it must not write there any more
        auto [r, k] = output_of[t];
        if (r < static_cast<int64_t>(recipes.size()) && k < recipes[r].out_tids.size() &&
            recipes[r].out_tids[k] == t)
          recipes[r].out_tids[k] = -1;
        output_of[t] = {-1, 0};
      }
      if (t < static_cast<int64_t>(const_storage.size()) && const_storage[t]) {
        const_tid.erase(const_storage[t].unsafeGetStorageImpl());
        const_storage[t] = c10::Storage();
      }
      if (t < static_cast<int64_t>(escaped_storage.size()) && escaped_storage[t]) {
        escaped.erase(escaped_storage[t]);
        escaped_storage[t] = nullptr;
      }
    }
    for (int64_t r : dropped_recipes)
      if (r < static_cast<int64_t>(recipes.size())) recipes[r] = Recipe();
  }
  void free_value(int64_t t) {
    if (t >= static_cast<int64_t>(values.size()) || !values[t].defined()) return;
    c10::StorageImpl* s = values[t].storage().unsafeGetStorageImpl();
    if (s->_mutable_data_ptr_no_checks().get() == nullptr) return;  // a view of it went first
    auto out = handed_out.find(s);
    if (out != handed_out.end() && !out->second.expired()) {
      // The program holds this memory as a plain tensor (a gradient that is a view of a
      // larger buffer, exported and then dropped while the buffer's other views live on
      // as lineage): it stays the program's. The pool's members move to a storage of
      // their own, empty until recomputed, as an old version's do.
      c10::Storage fresh = empty_storage(s->nbytes(), values[t].device());
      for (int64_t m : core.members(t))
        if (m < static_cast<int64_t>(values.size()) && values[m].defined() &&
            values[m].storage().unsafeGetStorageImpl() == s)
          values[m] = over(values[m], fresh);
      return;
    }
    at::DataPtr old =
        s->set_data_ptr(at::DataPtr(nullptr, s->_mutable_data_ptr_no_checks().device()));
    s->release_data_and_set_meta_custom_data_ptr_error_msg_(std::string(kEvictedMsg));
  }
  void rename(const std::shared_ptr<Cell>& cell, int64_t tid) {
    cell->tid = tid;
    if (static_cast<int64_t>(cells.size()) <= tid) cells.resize(tid + 1);
    cells[tid] = cell;
  }
  std::shared_ptr<Cell> cell_of(int64_t tid) const {
    if (tid >= static_cast<int64_t>(cells.size())) return nullptr;
    std::shared_ptr<Cell> cell = cells[tid].lock();
    return cell && cell->tid == tid ? cell : nullptr;
  }
  // A write to tid where other members of its storage are held (Invariant 4): a pool
  // version when every held member's tensors can be renamed, the op is recorded in a
  // form whose replay recomputes the whole storage (not an out= op, which may resize
  // it), and no other argument it writes shares the storage.
  bool pool_version_ok(int64_t tid) const {
    if (!core.can_version(tid)) return false;
    for (int64_t m : core.members(tid))
      if (m != tid && core.ext(m) > 0 && !cell_of(m)) return false;
    return true;
  }
  void set(std::vector<at::Tensor>& v, int64_t t, at::Tensor x) {
    if (static_cast<int64_t>(v.size()) <= t) v.resize(t + 1);
    v[t] = std::move(x);
  }

  // ---- constants (Runtime._constant): one per storage, counted while a recipe reads it
  int64_t constant(const at::Tensor& t, std::vector<int64_t>& fresh) {
    if (t.requires_grad() && reads_call_for_hooks()) hook_leaf(t);
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    auto it = const_tid.find(s);
    if (it != const_tid.end()) return it->second;
    int64_t tid = core.new_constant(static_cast<int64_t>(t.storage().nbytes()));
    if (trace) trace->constant(tid, static_cast<int64_t>(t.storage().nbytes()));
    const_tid[s] = tid;
    if (static_cast<int64_t>(const_storage.size()) <= tid) const_storage.resize(tid + 1);
    const_storage[tid] = t.storage();
    fresh.push_back(tid);
    return tid;
  }

  // Runtime._export_version: the new version, with no lineage, that a value handed out
  // becomes. It takes over the storage and the program's handles (cell); the old value
  // moves to an evicted pool with its recipe and readers.
  int64_t export_version(const std::shared_ptr<Cell>& cell) {
    const int64_t old = cell->tid;
    const int64_t tid = core.record({old}, 0.0, {kVersion}, {old}, {0})[0];
    if (trace) trace->exported(old, tid);
    set(values, tid, values.at(old));
    detach_old_version(old);
    rename(cell, tid);
    core.pin(tid);
    return tid;
  }

  // ---- volatile memory (dtr/engines/subclass/volatile.py): what can change with no op the engine sees, a
  // managed value handed out by address or a plain tensor's foreign memory (NumPy's)
  bool is_volatile(const at::Tensor& t, bool managed) const {
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    return escaped.count(s) > 0 ||
           (!managed && (!s->resizable() || exported_plain.count(s) > 0));
  }
  // A plain tensor's memory handed out by address (Runtime.plain_exported): a write of
  // unknown content now and at any time after. What read it so far is materialized and
  // pinned, as before an op writes it; later recipes read snapshots of it.
  void plain_exported(const at::Tensor& t) {
    if (t.layout() != c10::kStrided) {
      for (const at::Tensor& p : sparse_parts(t)) plain_exported(p);
      return;
    }
    // (a managed value's storage, handed out by export_value, is already volatile)
    if (!t.has_storage() || escaped.count(t.storage().unsafeGetStorageImpl()) > 0) return;
    writes_to_plain(t);
    if (exported_plain.size() >= 2 * prune_exported_plain_at) {
      for (auto h = exported_plain.begin(); h != exported_plain.end();)
        h = h->second.expired() ? exported_plain.erase(h) : std::next(h);
      prune_exported_plain_at = std::max<size_t>(64, exported_plain.size());
    }
    exported_plain.insert_or_assign(t.storage().unsafeGetStorageImpl(),
                                    c10::weak_intrusive_ptr<c10::StorageImpl>(
                                        t.storage().getWeakStorageImpl()));
  }
  // A tensor with t's metadata over a copy of t's storage as it is now; the latest copy
  // of that storage when it still holds the same bytes.
  at::Tensor snapshot(const at::Tensor& t) {
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    auto it = snapshots.find(s);
    if (it != snapshots.end()) {
      c10::intrusive_ptr<c10::StorageImpl> kept = it->second.lock();
      const size_t n = s->nbytes();
      // (another device's memory is not the host's to compare: a fresh copy is taken)
      if (kept && kept->nbytes() == n && kept->device().is_cpu() &&
          (n == 0 || std::memcmp(kept->data(), s->data(), n) == 0))
        return over(t, c10::Storage(std::move(kept)));
    }
    at::Tensor snap = copy_storage(t);
    if (snapshots.size() >= 2 * prune_snapshots_at) {
      for (auto h = snapshots.begin(); h != snapshots.end();)
        h = h->second.expired() ? snapshots.erase(h) : std::next(h);
      prune_snapshots_at = std::max<size_t>(64, snapshots.size());
    }
    snapshots.insert_or_assign(
        s, c10::weak_intrusive_ptr<c10::StorageImpl>(snap.storage().getWeakStorageImpl()));
    return snap;
  }

  // ---- plain tensors a recipe can make again (dtr/engines/subclass/rebuildable_plain.py)
  void settle_made() {
    if (!made_by_fill.unsettled.empty()) made_by_fill.settle();
    if (!made_by_transpose.unsettled.empty()) made_by_transpose.settle();
  }
  // A plain tensor just filled by zero_() or fill_(value) (`args`) in the block. The
  // subclass engine remembers the outputs of zeros/ones/full; here those ops never reach
  // the engine (their BackendSelect kernel sends them to the CPU's), only the fill of the
  // empty tensor they make does. A tensor that such a fill covers whole (contiguous, its
  // storage's only bytes) holds what zeros/full would make: that call is remembered.
  void remember_fill(const std::vector<c10::IValue>& args) {
    static const c10::OperatorHandle zeros =
        c10::Dispatcher::singleton().findSchemaOrThrow("aten::zeros", "");
    static const c10::OperatorHandle full =
        c10::Dispatcher::singleton().findSchemaOrThrow("aten::full", "");
    if (args.empty() || !args[0].isTensor()) return;
    const at::Tensor& t = args[0].toTensor();
    // (one that requires grad is a leaf whose gradient is handed out plain only if a recipe
    // reads the leaf itself: hook_leaf)
    if (!t.defined() || t.layout() != c10::kStrided || t.is_meta() || t.is_inference() ||
        t.requires_grad() || t.is_conj() || t.is_neg() || !t.is_contiguous() || !t.has_storage() ||
        t.storage_offset() != 0 || t.storage().nbytes() != t.nbytes())
      return;
    std::vector<c10::IValue> call{c10::IValue(t.sizes().vec())};
    if (args.size() > 1) call.push_back(args[1]);  // fill_'s value (full's fill_value)
    call.emplace_back(t.scalar_type());
    call.emplace_back(c10::kStrided);
    call.emplace_back(t.device());
    call.emplace_back();  // pin_memory
    made_by_fill.add(t, {weak(t), t.storage().getWeakStorageImpl(), t.sizes().vec(),
                         t.scalar_type(), args.size() > 1 ? full : zeros, std::move(call),
                         t._version()});
  }
  // The factory call that makes t's value again, if t was filled whole and nothing has
  // written it since; else null.
  const MadeByFill* fill_call_for(const at::Tensor& t) const {
    if (t.layout() != c10::kStrided || t.is_inference()) return nullptr;
    const MadeByFill* made = made_by_fill.find(t);
    return made != nullptr && made->holds_value_of(t) ? made : nullptr;
  }
  // The output `out` of t/transpose.int, called with `args` on plain tensors in the block.
  void remember_transpose(const c10::OperatorHandle& op, std::vector<c10::IValue> args,
                          const c10::IValue& out) {
    if (!out.isTensor() || args.empty() || !args[0].isTensor()) return;
    const at::Tensor& t = out.toTensor();
    const at::Tensor source = args[0].toTensor();
    auto coo = [](const at::Tensor& x) {
      return x.defined() && x.layout() == c10::kSparse && !x.is_inference();
    };
    if (!coo(t) || !coo(source)) return;
    args[0] = c10::IValue();
    made_by_transpose.add(
        t, {weak(t), weak(source), op, std::move(args), t._version(), source._version()});
  }
  // How a recipe reads t: taken again from its source when it replays, if t is a
  // remembered transpose that still matches its source (neither written since); else
  // nullopt (the recipe holds t). arg and item are the caller's to set.
  std::optional<Rebuilt> rebuilt_for(const at::Tensor& t) const {
    if (t.layout() != c10::kSparse || t.is_inference()) return std::nullopt;
    const MadeByTranspose* made = made_by_transpose.find(t);
    if (made == nullptr) return std::nullopt;
    c10::intrusive_ptr<c10::TensorImpl> source = made->source.lock();
    if (!source) return std::nullopt;
    at::Tensor s(std::move(source));
    if (t._version() != made->version || s._version() != made->source_version) return std::nullopt;
    Rebuilt r{0, -1, made->op, made->args};
    r.args[0] = s;
    return r;
  }

  // ---- Rebuilder.invalidate (csrc/core/rebuild.h): what reads `seeds` is materialized and pinned
  void invalidate(const std::vector<int64_t>& seeds) {
    if (trace) trace->invalidate(seeds);
    dtr::invalidate(core, seeds, [&](int64_t t) { rematerialize(t); }, [&] { drain(); });
  }
  void writes_to_plain(const at::Tensor& t) {
    if (t.layout() != c10::kStrided) {  // a sparse tensor: its parts (dtr/engines/subclass/storage_keys.py)
      for (const at::Tensor& p : sparse_parts(t)) writes_to_plain(p);
      return;
    }
    const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
    auto it = const_tid.find(s);
    if (it != const_tid.end() && core.has_consumers(it->second)) invalidate({it->second});
    auto out = escaped.find(s);  // a value handed out plain (a gradient clipped in place)
    if (out != escaped.end()) invalidate(core.members(out->second));
  }

  // Called for a plain tensor an op reads that requires grad: the leaf the read calls for
  // (leaf_to_hook) gets Python's hook, so that a gradient accumulated into its .grad is
  // handed out plain.
  void hook_leaf(const at::Tensor& t) {
    if (!leaf_hook) return;
    const at::Tensor leaf = leaf_to_hook(t);
    if (!leaf.defined()) return;
    const c10::TensorImpl* impl = leaf.unsafeGetTensorImpl();
    auto it = hooked.find(impl);
    if (it != hooked.end() && !it->second.expired()) return;
    if (hooked.size() >= 2 * prune_hooked_at) {  // input leaves add one per step
      for (auto h = hooked.begin(); h != hooked.end();)
        h = h->second.expired() ? hooked.erase(h) : std::next(h);
      prune_hooked_at = std::max<size_t>(64, hooked.size());
    }
    hooked.insert_or_assign(impl, c10::weak_intrusive_ptr<c10::TensorImpl>(leaf.getIntrusivePtr()));
    py::gil_scoped_acquire gil;
    leaf_hook(leaf);
  }

  // Runtime._budget_error's message: the numbers, and what cannot be evicted.
  BudgetExceeded budget_error(int64_t requested, const std::string& what) const {
    std::string largest;
    for (auto [t, nbytes] : core.largest_pinned(5)) {
      if (!largest.empty()) largest += ", ";
      std::string name = "a constant";  // a plain tensor a recipe reads (a parameter)
      if (t < static_cast<int64_t>(output_of.size()) && output_of[t].first >= 0 &&
          output_of[t].first < static_cast<int64_t>(recipes.size()) &&
          recipes[output_of[t].first].op && t < static_cast<int64_t>(values.size()) &&
          values[t].defined()) {
        std::string shape;
        for (int64_t d : values[t].sizes()) shape += (shape.empty() ? "" : "x") + std::to_string(d);
        name = py_name(recipes[output_of[t].first].op->schema()) + "[" + shape + "]";
      }
      largest += name + " " + format_bytes(nbytes);
    }
    return BudgetExceeded(
        "dtr: cannot stay within the memory budget of " + format_bytes(core.budget) + " while " +
            what + ": " + format_bytes(core.resident_bytes) + " resident, " +
            format_bytes(requested) + " requested, " + format_bytes(core.pinned_bytes()) +
            " pinned (constants and tensors that cannot be recomputed) and " +
            format_bytes(core.locked_bytes()) +
            " locked by the running op, none of which can be evicted. Largest unevictable: " +
            (largest.empty() ? std::string("none") : largest) + ".",
        core.budget, core.constant_bytes(), what, requested, core);
  }

  // A value the program reads or takes out of the engine (value_copy, export_value):
  // locked while it is recomputed if evicted. On a failure the lock is released and what
  // the recomputation evicted is freed before the error goes on.
  void make_resident(int64_t tid) {
    core.lock(tid);
    try {
      if (!core.is_materialized(tid)) rematerialize(tid);
    } catch (...) {
      core.unlock(tid);
      drain();
      throw;
    }
    core.unlock(tid);
  }

  // ---- Rebuilder.rematerialize (csrc/core/rebuild.h)
  void rematerialize(int64_t tid) {
    try {
      dtr::rematerialize(
          core, tid, [&](int64_t rid) { rerun(rid); },
          [&](int64_t rid, int64_t need) {
            const Recipe* rec =
                rid < static_cast<int64_t>(recipes.size()) ? &recipes[rid] : nullptr;
            throw budget_error(
                need, "recomputing " + (rec && rec->op ? py_name(rec->op->schema()) : "a tensor"));
          },
          [&] { drain(); });
    } catch (...) {
      if (steal_broken) {
        // The old version's storage may hold part of the new value while the core counts
        // it resident (Runtime._after_interrupted_steal): evict all that can be rebuilt.
        steal_broken = false;
        core.evict_all();
        drain();
      }
      throw;
    }
  }

  // The subclass engine's checks and messages (dtr/engines/subclass/recipe.py: freed_error, replaced_error,
  // written_error): a replay must not read what the program no longer holds.
  static void check_plain_read(const Recipe& rec, const PlainRead& p) {
    const char* what = nullptr;
    const bool stored = static_cast<bool>(p.storage);  // else only its version is checked
    if (stored && p.t.numel() > 0 && p.t.storage().nbytes() == 0)
      what =
          "whose storage has since been freed outside dtr's view (storage resize_(0), as "
          "FSDP2's fully_shard does to unsharded parameters). Keep such code out of "
          "dtr.enable(), or run without a budget; see docs/distributed.md, 'Composing with DDP "
          "and FSDP'";
    else if (stored && !p.t.storage().is_alias_of(p.storage))
      what =
          "whose storage has since been replaced without any op dtr could see (`p.data = "
          "...`, or Module.half()/.to() converting parameters that way), so recomputing "
          "would use the new value where the program used the old one. Update tensors in "
          "place instead (`with torch.no_grad(): p.copy_(new)` or `p.sub_(...)`), or "
          "convert the model before dtr.enable()";
    else if (p.t._version() != p.version)
      what =
          "that has since been written in place where dtr could not see it (on another "
          "thread, or by code that bypasses dispatch), so recomputing would use the new "
          "value where the program used the old one. Update parameters on the thread that "
          "runs dtr.enable(), or between steps";
    if (what == nullptr) return;
    std::string shape = "[";
    for (int64_t d = 0; d < p.t.dim(); ++d) shape += (d ? ", " : "") + std::to_string(p.t.size(d));
    throw Unsupported("dtr: cannot recompute " + py_name(rec.op->schema()) +
                      ": it reads a plain tensor of shape " + shape + "] " + what);
  }

  // Whether a recipe's replay writes none of the tensors it is given (no new version, no
  // scratch copy of a written argument): it can be run again after an out-of-memory.
  static bool writes_nothing(const Recipe& rec) {
    return rec.scratch.empty() &&
           std::all_of(rec.outs.begin(), rec.outs.end(), [](const Out& o) { return o.slot < 0; });
  }

  // Rerun recipe rid (its inputs materialized and locked) and tell the core. A new
  // version is computed in a copy of the old value's storage, or in that storage itself
  // when the core allows it (Core::steals: nothing else will read the old value).
  void rerun(int64_t rid) {
    Recipe& rec = recipes.at(rid);
    for (const PlainRead& p : rec.plain) check_plain_read(rec, p);
    const std::vector<int64_t> stolen = core.steals(rid);
    std::vector<at::Tensor> filled(rec.slots.size());
    for (size_t q = 0; q < rec.slots.size(); ++q) filled[q] = values.at(rec.slots[q].tid);
    const bool out_form = rec.out_form;
    for (size_t k = 0; k < rec.outs.size(); ++k) {
      const int64_t q = rec.outs[k].slot;
      if (q < 0 || rec.outs[k].follows) continue;
      if (!contains(stolen, static_cast<int64_t>(k)))
        filled[q] = copy_storage(filled[q]);
      else if (out_form)  // the kernel may resize it: the old value keeps its geometry
        filled[q] = over(filled[q], filled[q].storage());
    }
    torch::jit::Stack stack(rec.args.begin(), rec.args.end());
    for (size_t q = 0; q < rec.slots.size(); ++q)
      set_item(stack[rec.slots[q].arg], rec.slots[q].item, filled[q]);
    for (const Rebuilt& r : rec.rebuilt) {  // its source was checked with rec.plain above
      torch::jit::Stack made(r.args.begin(), r.args.end());
      call_below(r.op, &made, false);
      set_item(stack[r.arg], r.item, made.back().toTensor());
    }
    for (auto [arg, item] : rec.scratch)
      set_item(stack[arg], item, copy_storage(get_item(stack[arg], item)));
    auto start = std::chrono::steady_clock::now();
    steal_broken = !stolen.empty();
    // a replayed out= op would warn again that it resizes its out tensor (dtr/engines/subclass/recipe.py,
    // Quiet)
    DropWarnings quiet;
    std::optional<c10::WarningUtils::WarningHandlerGuard> quieted;
    if (rec.out_form) quieted.emplace(&quiet);
    if (rec.gen) {
      at::Generator& gen = *rec.gen;
      at::Tensor now;
      {
        std::lock_guard<std::mutex> lock(gen.mutex());
        now = gen.get_state();
        gen.set_state(rec.rng_state);
      }
      try {
        call_evicting(*rec.op, &stack, 0, rec.grad, writes_nothing(rec), &gen, rec.rng_state);
      } catch (...) {
        std::lock_guard<std::mutex> lock(gen.mutex());
        gen.set_state(now);
        throw;
      }
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_state(now);  // the program's random stream goes on where it was
    } else {
      call_evicting(*rec.op, &stack, 0, rec.grad, writes_nothing(rec), nullptr, at::Tensor());
    }
    recompute_seconds +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::vector<int64_t> nbytes;
    for (size_t k = 0; k < rec.outs.size(); ++k) {
      const Out& o = rec.outs[k];
      // (a follower: the storage the version it follows was computed in)
      at::Tensor fresh = o.slot >= 0 ? filled[o.slot] : get_item(stack[o.ret], o.item);
      int64_t tid = rec.out_tids[k];
      nbytes.push_back(static_cast<int64_t>(fresh.storage().nbytes()));
      if (tid < 0 || tid >= static_cast<int64_t>(values.size()) || !values[tid].defined()) continue;
      c10::StorageImpl* dst = values[tid].storage().unsafeGetStorageImpl();
      c10::StorageImpl* src = fresh.storage().unsafeGetStorageImpl();
      if (dst == src || dst->_mutable_data_ptr_no_checks().get() != nullptr) continue;
      if (src->nbytes() != dst->nbytes())
        throw std::runtime_error("dtr: recomputing " + py_name(rec.op->schema()) +
                                 " made a storage of " + std::to_string(src->nbytes()) +
                                 " bytes where the first run made " +
                                 std::to_string(dst->nbytes()));
      at::DataPtr data = src->set_data_ptr(at::DataPtr(nullptr, src->device()));
      dst->clear_data_ptr_access_error_msg_();
      dst->set_data_ptr_noswap(std::move(data));
      if (o.slot >= 0 && out_form)  // a stolen storage an out= op resized: the old size back
        src->set_nbytes(static_cast<size_t>(core.pool_bytes(rec.slots[o.slot].tid)));
    }
    core.remat_done(rid, nbytes, stolen);
    steal_broken = false;
  }

  static void call_below(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool grad) {
    Below below;
    at::AutoGradMode mode(grad);
    op.callBoxed(stack);
  }

  // call_below, and for an op on a device other than the CPU (its allocator may run out while
  // dtr's count is under the device's size): on out-of-memory, evict and run it again from
  // its arguments (those from `begin`) until it succeeds or nothing more can be freed
  // (dtr/engines/subclass/oom.py). Only an op that writes none of its arguments is run
  // again (a failed run may have half written one); a random op restarts each time from
  // `rng_state`, the state it first started from.
  void call_evicting(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t begin,
                     bool grad, bool retry, at::Generator* gen, const at::Tensor& rng_state) {
    if (device_of(*stack, begin).is_cpu()) {
      call_below(op, stack, grad);
      return;
    }
    const std::vector<c10::IValue> args(stack->begin() + static_cast<std::ptrdiff_t>(begin),
                                        stack->end());
    while (true) {
      try {
        call_below(op, stack, grad);
        return;
      } catch (const c10::OutOfMemoryError& exc) {
        const std::string said = exc.what_without_backtrace();
        if (!retry || evict_after_oom(requested_bytes(said)) <= 0)
          throw OutOfMemory(said, py_name(op.schema()), retry, core.resident_bytes,
                            core.pinned_bytes(), core.locked_bytes());
      }
      stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(begin), stack->end());
      stack->insert(stack->end(), args.begin(), args.end());
      if (gen != nullptr) {
        std::lock_guard<std::mutex> lock(gen->mutex());
        gen->set_state(rng_state);
      }
    }
  }

  // dtr/engines/subclass/oom.py's rule, after the allocator ran out of memory inside an
  // op: evict at least what it asked for and at least an eighth of the resident bytes (a
  // failing op converges in a few rounds); returns the bytes freed. The running op's
  // inputs are locked, so they stay.
  int64_t evict_after_oom(int64_t requested) {
    const int64_t before = core.resident_bytes;
    const int64_t want = std::max({requested, before / 8, int64_t{1}});
    const int64_t saved = core.budget;
    core.budget = std::max<int64_t>(0, before - want);
    core.make_room(0);
    core.budget = saved;
    drain();
    const int64_t freed = before - core.resident_bytes;
    if (freed > 0) ++oom_retries;
    return freed;
  }

  // The old value of a tensor that just got a new version (Core::version moved it, with
  // the other members of its pool, to a fresh evicted pool): the storage is the new
  // version's now, so the old members get one of their own, empty until recomputed.
  // (The core's size of it: an out= op may have resized the storage it shared.)
  void detach_old_version(int64_t old) {
    c10::Storage fresh = empty_storage(core.pool_bytes(old), values.at(old).device());
    for (int64_t m : core.members(old))
      if (m < static_cast<int64_t>(values.size()) && values[m].defined())
        values[m] = over(values[m], fresh);
  }

  // rebuild: everything still held is materialized (read after the block), with the
  // budget lifted. Without it (the block ends with a BudgetError: rebuilding could take
  // many times the budget) what is evicted stays so, and reading it raises kLostMsg.
  void close(bool rebuild = true) {
    std::lock_guard<std::recursive_mutex> g(mu);
    if (!open) return;
    std::exception_ptr error;  // the engine closes whatever happens (an interrupt, OOM)
    try {
      flush();
      if (trace) trace->close();  // END: what is still held is materialized (as below)
      // The session's peaks are those of the block: what is materialized below, with the
      // budget lifted, is the program's after it (Runtime.closing_peaks).
      closing_peaks = {core.peak_bytes, core.max_bytes};
      if (rebuild) {  // nor a thrash stop: the budget lifted, rebuilding is bounded
        core.budget = -1;
        core.thrash = 0;
      }
      for (int64_t t : core.alive())
        if (t < static_cast<int64_t>(values.size()) && values[t].defined() &&
            !core.is_materialized(t) && !core.is_constant(t)) {
          if (!rebuild) {
            values[t].storage().unsafeGetStorageImpl()
                ->release_data_and_set_meta_custom_data_ptr_error_msg_(std::string(kLostMsg));
            continue;
          }
          core.lock(t);
          rematerialize(t);
          core.unlock(t);
        }
    } catch (...) {
      error = std::current_exception();
    }
    open = false;
    trace.reset();
    recipes.clear();
    output_of.clear();
    values.clear();  // the program's tensors keep their own storages
    const_tid.clear();
    const_storage.clear();
    escaped.clear();
    escaped_storage.clear();
    handed_out.clear();
    exported_plain.clear();
    snapshots.clear();
    made_by_fill.clear();
    made_by_transpose.clear();
    hooked.clear();
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
  NativeImpl(std::shared_ptr<NativeEngine> eng, int64_t tid, const at::Tensor& value)
      : c10::TensorImpl(c10::DispatchKeySet(kKey) | meaning_keys(value),
                        value.dtype(), value.device()),
        eng_(std::move(eng)),
        cell_(std::make_shared<Cell>(Cell{tid})) {
    storage_ = value.storage();
    sizes_and_strides_.set_sizes(value.sizes());
    sizes_and_strides_.set_strides(value.strides());
    storage_offset_ = value.storage_offset();
    refresh_numel();
    refresh_contiguous();
  }
  ~NativeImpl() override {
    if (eng_ && cell_ && eng_->open) eng_->dropped(std::move(cell_));
  }

  template <typename VC>
  c10::intrusive_ptr<c10::TensorImpl> copy_core(VC&& vc, bool allow_meta_change) const {
    auto impl = c10::make_intrusive<NativeImpl>(Empty{}, eng_, key_set_, data_type_, device_opt_);
    copy_tensor_metadata(this, impl.get(), std::forward<VC>(vc), allow_meta_change);
    impl->cell_ = cell_;
    if (eng_ && cell_) eng_->retain(*cell_);  // the copy holds a handle of its own
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
    if (other->eng_ && other->cell_) other->eng_->retain(*other->cell_);
    if (eng_ && cell_) eng_->dropped(cell_);
    eng_ = other->eng_;
    cell_ = other->cell_;
    refresh_numel();
    refresh_contiguous();
  }
  const char* tensorimpl_type_name() const override { return "dtr.NativeImpl"; }
  int64_t tid() const { return cell_->tid; }

  // x.squeeze_() and kin, after the view op made y from x: x names y's tensor from now on
  // (its handle moves over; copies of x taken before, autograd's, keep the old one) and
  // takes y's geometry. The storage is the same.
  void adopt(const NativeImpl& y) {
    eng_->dropped(std::move(cell_));
    cell_ = y.cell_;
    eng_->retain(*cell_);
    take_geometry(y);
  }

  // An out= op resized this tensor's value in its storage (the same one): the tensor
  // takes the value's sizes, strides and offset, as eager's out tensor does.
  void take_geometry(const c10::TensorImpl& v) {
    sizes_and_strides_.set_sizes(v.sizes());
    sizes_and_strides_.set_strides(v.strides());
    storage_offset_ = v.storage_offset();
    refresh_numel();
    refresh_contiguous();
  }

  struct Empty {};
  NativeImpl(Empty, std::shared_ptr<NativeEngine> eng, c10::DispatchKeySet ks, caffe2::TypeMeta dtype,
             std::optional<c10::Device> device)
      : c10::TensorImpl(ks, dtype, device), eng_(std::move(eng)) {}

  std::shared_ptr<NativeEngine> eng_;
  std::shared_ptr<Cell> cell_;  // shared with every copy naming the same tensor
};

inline NativeImpl* as_native(const at::Tensor& t) {
  if (!t.defined() || !t.unsafeGetTensorImpl()->key_set().has(kKey))
    return nullptr;
  return dynamic_cast<NativeImpl*>(t.unsafeGetTensorImpl());
}

// A plain tensor over a managed one's storage and metadata (after the block, or a
// tensor of another session).
at::Tensor plain_view(const at::Tensor& t) { return over(t, t.storage()); }

// ---------------------------------------------------------------- torch.profiler
// torch.profiler(record_shapes=True) reads the data pointer of every tensor input in its
// RecordFunction start callback (RawTensorMetadata: t.storage().data()). An evicted
// value's storage raises kEvictedMsg on that read: the guard that keeps C++ code from
// reading freed memory directly. The profiler needs only the address (null: no memory),
// so while a session is open a global RecordFunction callback of dtr's lifts the guard
// on the evicted storages of a range's managed inputs when the range records inputs, just
// before the profiler's callback reads them (a global callback runs before the
// thread-local ones torch.profiler adds), and puts it back at the first of: the next
// range starting on this thread, the engine serving an op, this range's end. In that
// window only the other callbacks and the op's kernels above dtr's run (autograd's, which
// read metadata, and composites, whose ops start ranges of their own; the composites
// that read memory read their arguments' values first, read_values_first); the guard is
// put back under the engine's lock, so the engine's evictions and recomputations (which
// set and clear it) are never undone.
namespace profiled {

struct Lifted {
  c10::Storage storage;
  std::optional<std::string> msg;
};
thread_local std::vector<Lifted> t_lifted;  // this thread's lifted guards
std::mutex g_handle_mu;
std::optional<at::CallbackHandle> g_handle;

void restore_guards() {
  if (t_lifted.empty()) return;
  std::shared_ptr<NativeEngine> e = active();
  std::unique_lock<std::recursive_mutex> g;
  if (e) g = std::unique_lock<std::recursive_mutex>(e->mu);
  for (Lifted& l : t_lifted) {
    c10::StorageImpl* s = l.storage.unsafeGetStorageImpl();
    const bool guarded = s->get_extra_meta().custom_data_ptr_error_msg_.has_value();
    // recomputed since (memory back), or evicted again (guarded again): nothing to undo
    if (s->_mutable_data_ptr_no_checks().get() == nullptr && !guarded)
      s->release_data_and_set_meta_custom_data_ptr_error_msg_(std::move(l.msg));
  }
  t_lifted.clear();
}

void lift_guard(const at::Tensor& t) {
  if (as_native(t) == nullptr) return;
  c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  if (s->_mutable_data_ptr_no_checks().get() != nullptr) return;  // resident
  std::shared_ptr<NativeEngine> e = active();
  std::unique_lock<std::recursive_mutex> g;
  if (e) g = std::unique_lock<std::recursive_mutex>(e->mu);
  auto& msg = s->get_extra_meta().custom_data_ptr_error_msg_;
  if (s->_mutable_data_ptr_no_checks().get() != nullptr || !msg) return;
  t_lifted.push_back({t.storage(), msg});
  s->clear_data_ptr_access_error_msg_();
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  restore_guards();
  if (!fn.needsInputs()) return nullptr;  // no callback reads the inputs
  for (const c10::IValue& v : fn.inputs()) {
    if (v.isTensor()) {
      lift_guard(v.toTensor());
    } else if (v.isList()) {
      for (const c10::IValue& x : v.toListRef())
        if (x.isTensor()) lift_guard(x.toTensor());
    }
  }
  return nullptr;
}

void on_end(const at::RecordFunction&, at::ObserverContext*) { restore_guards(); }

void install() {
  std::lock_guard<std::mutex> g(g_handle_mu);
  if (!g_handle) g_handle = at::addGlobalCallback(at::RecordFunctionCallback(&on_start, &on_end));
}

void remove() {
  std::lock_guard<std::mutex> g(g_handle_mu);
  if (g_handle) at::removeCallback(*g_handle);
  g_handle.reset();
}

}  // namespace profiled

// A managed tensor's value handed out as a plain tensor over the same storage, to live on
// outside the engine (a gradient in .grad, numpy(), data_ptr(): Runtime.export). The
// memory can be written from now on with no op the engine sees (a NumPy array, ctypes), so
// the value handed out is pinned, its lineage cut, and later recipes read snapshots of it
// (NativeEngine::snapshot). What read it so far keeps the value it read: private, the handed-out
// value is a new version and the old one keeps its lineage (Invariant 4); aliased, the
// readers are materialized and pinned. Writes through an op invalidate readers too
// (writes_to_plain).
at::Tensor export_value(NativeEngine& e, const at::Tensor& t) {
  NativeImpl* impl = as_native(t);
  if (impl == nullptr) return t;
  std::lock_guard<std::recursive_mutex> g(e.mu);
  if (impl->eng_.get() != &e || !e.open) return plain_view(t);
  e.flush();
  int64_t tid = impl->tid();
  // What read the memory: any member of the pool (`v.detach().numpy()` exports an alias
  // no op has read yet, of a value that ops have)
  const std::vector<int64_t> members = e.core.members(tid);
  const bool read = std::any_of(members.begin(), members.end(),
                                [&](int64_t m) { return e.core.has_consumers(m); });
  const bool version = read && e.core.is_private(tid);
  if (e.trace && !version) e.trace->exported(tid);
  e.make_resident(tid);
  if (version) {
    tid = e.export_version(impl->cell_);
  } else {
    e.core.pin(tid);
    if (read) e.invalidate(e.core.members(tid));
  }
  const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
  e.escaped[s] = tid;
  if (e.handed_out.size() >= 2 * e.prune_handed_out_at) {  // gradients: some per step
    for (auto h = e.handed_out.begin(); h != e.handed_out.end();)
      h = h->second.expired() ? e.handed_out.erase(h) : std::next(h);
    e.prune_handed_out_at = std::max<size_t>(64, e.handed_out.size());
  }
  e.handed_out.insert_or_assign(
      s, c10::weak_intrusive_ptr<c10::StorageImpl>(t.storage().getWeakStorageImpl()));
  if (static_cast<int64_t>(e.escaped_storage.size()) <= tid) e.escaped_storage.resize(tid + 1);
  e.escaped_storage[tid] = s;
  e.drain();
  return plain_view(t);
}

// Closes a step (Core::end_step): held values whose lineage reaches into an earlier step
// are materialized and pinned, and the lineage only they kept is dropped.
void end_step(NativeEngine& e) {
  std::lock_guard<std::recursive_mutex> g(e.mu);
  if (!e.open) return;
  e.flush();
  const std::vector<int64_t> old = e.core.end_step();
  if (!old.empty()) e.invalidate(old);
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

bool returns_tensors(const c10::Argument& r) {
  const c10::TypePtr& t = r.type();
  return t->isSubtypeOf(*c10::TensorType::get()) ||
         t->isSubtypeOf(*c10::OptionalType::ofTensor()) ||
         t->isSubtypeOf(*c10::ListType::ofTensors()) ||
         t->isSubtypeOf(*c10::ListType::ofOptionalTensors());
}

// The device an op runs on: that of its first tensor off the CPU (a CPU scalar may join
// another device's tensors), else the CPU.
c10::Device device_of(const torch::jit::Stack& stack, size_t begin) {
  c10::Device device(c10::DeviceType::CPU);
  for_each_tensor(const_cast<torch::jit::Stack*>(&stack), begin, stack.size() - begin,
                  [&](size_t, int64_t, const at::Tensor& t) {
                    if (device.is_cpu() && t.defined() && !t.is_cpu()) device = t.device();
                  });
  return device;
}

// The generator a random op draws from: its Generator argument (aten names it
// `generator`; a custom op may not), else the default generator of the device it runs on
// (dtr/engines/subclass/rng.py's default_generator).
at::Generator generator_of(const c10::FunctionSchema& schema, const torch::jit::Stack& stack,
                           size_t begin) {
  for (size_t i = 0; i < schema.arguments().size(); ++i)
    if (stack[begin + i].isGenerator()) return stack[begin + i].toGenerator();
  const c10::Device device = device_of(stack, begin);
  if (device.is_cpu()) return at::detail::getDefaultCPUGenerator();
  return at::globalContext().defaultGenerator(device);
}

// Whether an op drew from gen: its state differs from `before`, taken when the op began.
// An untagged op that did is replayed from `before` like a tagged one (Invariant 1).
// (States are contiguous CPU byte tensors: compared as bytes, off the dispatcher.)
bool drew(at::Generator& gen, const at::Tensor& before) {
  at::Tensor now;
  {
    std::lock_guard<std::mutex> lock(gen.mutex());
    now = gen.get_state();
  }
  return now.nbytes() != before.nbytes() ||
         std::memcmp(now.const_data_ptr(), before.const_data_ptr(), now.nbytes()) != 0;
}

[[noreturn]] void refuse(const c10::OperatorHandle& op, const std::string& why) {
  throw Unsupported("dtr: the native engine does not serve " + py_name(op.schema()) + " yet (" +
                    why + "); use dtr.enable(engine=\"subclass\") for this program");
}

// An out= op that would resize a managed tensor another one shares (a detach() or .data of
// it, held: the same cell): eager's alias keeps its old geometry over the resized storage,
// which a shared handle cannot give (dtr/engines/subclass/runtime.py, _refuse_shared_resize, says the same).
// What the kernel would do is asked of meta tensors first, only in that case; the op is
// refused before anything is written.
void refuse_shared_resize(const c10::OperatorHandle& op, const torch::jit::Stack& stack,
                          size_t begin, const std::vector<Leaf>& leaves,
                          const std::function<bool(size_t)>& is_written) {
  std::vector<size_t> shared;
  for (size_t k = 0; k < leaves.size(); ++k)
    if (leaves[k].native && is_written(leaves[k].arg) && leaves[k].native->cell_.use_count() > 1)
      shared.push_back(k);
  if (shared.empty()) return;
  bool resizes = true;  // unless the meta kernel says otherwise
  try {
    torch::jit::Stack meta(stack.begin() + static_cast<std::ptrdiff_t>(begin), stack.end());
    std::vector<at::Tensor> metas(leaves.size());
    for (size_t k = 0; k < leaves.size(); ++k) {
      const at::Tensor& t = leaves[k].tensor;
      if (!t.defined()) continue;
      metas[k] = at::empty_strided(t.sizes(), t.strides(), t.options().device(at::kMeta));
      set_item(meta[leaves[k].arg], leaves[k].item, metas[k]);
    }
    DropWarnings quiet;  // (the op's own run warns of a resize, if it comes to run)
    c10::WarningUtils::WarningHandlerGuard quieted(&quiet);
    NativeEngine::call_below(op, &meta, false);
    resizes = false;
    for (size_t k : shared)
      if (metas[k].sizes() != leaves[k].tensor.sizes()) resizes = true;
  } catch (const std::exception&) {  // no meta kernel: it may resize
  }
  if (resizes)
    throw Unsupported("dtr: " + py_name(op.schema()) +
                      " would resize its out= tensor, which another tensor shares (a detach() "
                      "or .data of it is held); pass an out tensor of the result's shape, or use "
                      "the out-of-place form");
}

// In-place view ops (x.squeeze_(), x.t_(), ...; dtr/schema.py's _VIEW_INPLACE) and the view
// op each stands for (squeeze_.dim: squeeze.dim), by py_name; given by dtr.engines.native.session at install.
std::unordered_map<std::string, c10::OperatorName> g_view_forms;

// ---------------------------------------------------------------- facts per op
// What the fallback needs to know of an op on every call, read from its schema once per
// thread (dtr/schema.py's OpFacts, the part this engine uses).
struct OpFacts {
  std::vector<size_t> written;  // argument positions its schema says it writes
  bool view = false;            // every return aliases an argument it does not write
  bool other_returns = false;   // a tensor result that is not a written argument
  bool seeded = false;          // draws random numbers
  bool may_draw = false;        // not aten: may draw untagged, so the op is watched (drew)
  bool reshapes = false;        // changes its argument's shape or storage in place
  // set_, resize_, resize_as_: refused whenever a managed tensor takes part, as a source
  // too (a plain tensor set_ onto a managed value's storage would read it evicted)
  bool replaces_storage = false;
  bool out_form = false;        // writes an out= argument, which it may resize
  bool meta_only = false;       // reads only its tensors' metadata (empty_like, ...)
  bool bn_hidden_writes = false;
  bool fill = false;       // zero_, fill_.Scalar: how zeros/ones/full fill what they make
  bool transpose = false;  // t, transpose.int (TRANSPOSES)
  bool detach = false;     // detach(): names its argument's value (Runtime's _detach)
  std::optional<c10::OperatorHandle> view_form;  // an in-place view op's out-of-place form
  std::vector<size_t> plain_returns;             // returns left plain (dtr/schema.py)
  bool no_autograd = false;  // a library's op with no autograd kernel (lacks_autograd)
};

// dtr/schema.py's lacks_autograd, the one rule for both engines (an op of a library other
// than PyTorch's with no autograd kernel; the engine refuses it when an input requires
// grad). Asked once per op overload (facts_of caches it), before the engine's lock.
bool lacks_autograd(const c10::OperatorHandle& op) {
  py::gil_scoped_acquire gil;
  return py::module_::import("dtr.schema").attr("lacks_autograd")(op.schema().name()).cast<bool>();
}

OpFacts make_facts(const c10::OperatorHandle& op) {
  static const std::unordered_set<std::string> kMetaOnly = {
      "aten::empty_like",        "aten::zeros_like", "aten::ones_like",    "aten::full_like",
      "aten::rand_like",         "aten::randn_like", "aten::randint_like", "aten::new_empty",
      "aten::new_empty_strided", "aten::new_zeros",  "aten::new_ones",     "aten::new_full"};
  // dtr/schema.py's _METADATA_INPLACE
  static const std::unordered_set<std::string> kReplacesStorage = {
      "aten::set_", "aten::resize_", "aten::resize_as_", "aten::resize_as_sparse_"};
  static const std::unordered_set<std::string> kBatchNorm = {
      "aten::native_batch_norm", "aten::cudnn_batch_norm", "aten::miopen_batch_norm"};
  const auto& schema = op.schema();
  OpFacts f;
  for (size_t i = 0; i < schema.arguments().size(); ++i) {
    const auto* alias = schema.arguments()[i].alias_info();
    if (alias != nullptr && alias->isWrite()) {
      f.written.push_back(i);
      if (schema.arguments()[i].kwarg_only()) f.out_form = true;
    }
  }
  f.view = !schema.returns().empty();
  for (const auto& r : schema.returns()) {
    if (r.alias_info() == nullptr || r.alias_info()->isWrite()) f.view = false;
    if ((r.alias_info() == nullptr || !r.alias_info()->isWrite()) && returns_tensors(r))
      f.other_returns = true;
  }
  f.seeded = op.hasTag(at::Tag::nondeterministic_seeded);
  const std::string& name = schema.name();
  // aten's and prims' random ops all carry the tag; an op of another namespace
  // (torch.library, TORCH_LIBRARY) need not, though its kernel may draw (dtr/schema.py's
  // may_draw)
  f.may_draw = !f.seeded && name.rfind("aten::", 0) != 0 && name.rfind("prims::", 0) != 0;
  f.replaces_storage = kReplacesStorage.count(name) > 0;
  f.reshapes = op.hasTag(at::Tag::inplace_view) || f.replaces_storage;
  f.meta_only = kMetaOnly.count(name) > 0;
  f.bn_hidden_writes = kBatchNorm.count(name) > 0;
  const std::string& overload = schema.overload_name();
  f.fill = (name == "aten::zero_" && overload.empty()) ||
           (name == "aten::fill_" && overload == "Scalar");
  f.transpose =
      (name == "aten::t" && overload.empty()) || (name == "aten::transpose" && overload == "int");
  f.detach = name == "aten::detach" && overload.empty();
  // A packed sequence's batch_sizes stays plain: lstm.data and kin read it through
  // data_ptr() in C++ before any dispatch, where an evicted value cannot be rebuilt
  // (dtr/schema.py's _PLAIN_RETURNS; it depends only on the plain lengths)
  if (name == "aten::_pack_padded_sequence") f.plain_returns = {1};
  f.no_autograd = lacks_autograd(op);
  auto form = g_view_forms.find(py_name(schema));
  if (form != g_view_forms.end())
    f.view_form = c10::Dispatcher::singleton().findSchemaOrThrow(
        form->second.name.c_str(), form->second.overload_name.c_str());
  return f;
}

const OpFacts& facts_of(const c10::OperatorHandle& op) {
  thread_local std::unordered_map<const c10::FunctionSchema*, OpFacts> cache;
  const c10::FunctionSchema* key = &op.schema();
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  return cache.emplace(key, make_facts(op)).first->second;
}

// The key of an op call in NativeEngine::out_sizes: the op (its schema's address) and each
// tensor argument's dtype and sizes.
std::vector<int64_t> size_key_of(const c10::FunctionSchema& schema,
                                 const std::vector<Leaf>& leaves) {
  std::vector<int64_t> key;
  key.reserve(1 + 4 * leaves.size());
  key.push_back(static_cast<int64_t>(reinterpret_cast<uintptr_t>(&schema)));
  for (const Leaf& l : leaves) {
    if (!l.tensor.defined()) {
      key.push_back(-1);
      continue;
    }
    key.push_back(static_cast<int64_t>(l.tensor.scalar_type()));
    key.push_back(l.tensor.dim());
    for (int64_t d : l.tensor.sizes()) key.push_back(d);
  }
  return key;
}

// ---------------------------------------------------------------- the fallback
// A tensor on the stack from a session that has ended (or another engine's): replaced
// there by a plain tensor on its storage, the value it had when the session ended.
at::Tensor replace_with_plain(torch::jit::Stack* stack, size_t pos, int64_t item) {
  at::Tensor plain = plain_view(get_item((*stack)[pos], item));
  set_item((*stack)[pos], item, plain);
  return plain;
}

// Serves one op call. With record_plain, the call is recorded even though it reads no
// managed value (a factory's managed copy, adopt_filled).
void serve(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool record_plain = false);

// A plain op in the block whose result a recipe may make again rather than hold
// (dtr/engines/subclass/rebuildable_plain.py): the call is run, and what it made remembered.
void run_and_remember(NativeEngine& e, const c10::OperatorHandle& op, const OpFacts& facts,
                      torch::jit::Stack* stack, size_t begin) {
  std::vector<c10::IValue> args(stack->begin() + begin, stack->end());
  NativeEngine::call_below(op, stack, at::GradMode::is_enabled());
  std::lock_guard<std::recursive_mutex> g(e.mu);
  if (!e.open) return;
  e.settle_made();  // an earlier one's, its op done
  if (facts.fill)
    e.remember_fill(args);
  else
    e.remember_transpose(op, std::move(args), stack->back());
}

// torch.sparse.mm(adj, h) is _sparse_addmm(torch.zeros(...), adj, h): the zeros tensor
// reads nothing managed and is plain, and held as a constant it was one product-sized
// tensor per layer kept from forward to backward. An op with a sparse operand that only
// reads a tensor filled whole and untouched since reads instead a managed copy made by
// the factory call that makes that value, recorded with no inputs, evicted and rebuilt
// (for nothing) like any other value (Runtime._fresh_stand_in). Made before any constant
// of the op is registered, as the subclass engine does; the leaf holds it until the op
// ends.
void adopt_filled(NativeEngine& e, std::vector<Leaf>& leaves, torch::jit::Stack* stack, size_t begin,
                  const std::function<bool(size_t)>& is_written) {
  bool sparse = false;
  for (const Leaf& l : leaves)
    sparse = sparse || (l.tensor.defined() && is_sparse_layout(l.tensor));
  if (!sparse) return;
  for (Leaf& l : leaves) {
    if (l.native || !l.tensor.defined() || is_written(l.arg)) continue;
    const MadeByFill* made = e.fill_call_for(l.tensor);
    if (made == nullptr) continue;
    const c10::OperatorHandle op = made->op;  // (serving it may change the table)
    torch::jit::Stack call(made->args.begin(), made->args.end());
    serve(op, &call, true);
    l.tensor = call.back().toTensor();
    l.native = as_native(l.tensor);
    if (l.native == nullptr)
      throw std::logic_error("dtr: internal error: a factory's managed copy is not managed");
    set_item((*stack)[begin + l.arg], l.item, l.tensor);
  }
}

void serve(const c10::OperatorHandle& op, torch::jit::Stack* stack, bool record_plain) {
  const auto& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t begin = stack->size() - n;
  profiled::restore_guards();
  std::shared_ptr<NativeEngine> eng = active();
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
        l.tensor = replace_with_plain(stack, begin + l.arg, l.item);
      }
  wants = wants && at::GradMode::is_enabled();
  const OpFacts& facts = facts_of(op);
  if (facts.no_autograd && eng && eng->open && at::GradMode::is_enabled()) {
    for (const Leaf& l : leaves)
      if (l.tensor.defined() && l.tensor.requires_grad()) {
        py::gil_scoped_acquire gil;
        throw Unsupported(py::module_::import("dtr.errors")
                              .attr("no_autograd_message")(py_name(op.schema()))
                              .cast<std::string>());
      }
  }
  // x.detach() of a managed tensor names x's value, as the subclass engine's detach
  // aliases x's Ref: a fresh tensor sharing x's Cell (autograd takes it as the
  // non-differentiable alias, as it takes CPU's fresh one). Nothing is read, so an evicted
  // value stays evicted (a recorded view would rebuild it, and need memory, for a tensor
  // that may never be read: autograd detaches saved values it has not unpacked).
  if (facts.detach && managed) {
    c10::TensorImpl* self = leaves[0].tensor.unsafeGetTensorImpl();
    (*stack)[begin] = at::Tensor(self->shallow_copy_and_detach(
        self->version_counter(), self->allow_tensor_metadata_change()));
    return;
  }
  std::vector<size_t> written = facts.written;  // argument positions the op writes
  if (facts.bn_hidden_writes && stack->size() >= begin + 6 && (*stack)[begin + 5].isBool() &&
      (*stack)[begin + 5].toBool() && (*stack)[begin + 3].isTensor()) {
    written.push_back(3);  // native_batch_norm in training updates its running statistics
    written.push_back(4);  // without a (a!) in its schema (dtr/schema.py, _HIDDEN_WRITES)
  }
  auto is_written = [&](size_t i) {
    for (size_t w : written)
      if (w == i) return true;
    return false;
  };
  // A view of plain tensors stays plain (a parameter's t() in a linear layer).
  if (!eng || !eng->open || (!managed && !record_plain && (!wants || facts.view))) {
    if (eng && eng->open && !written.empty()) {
      std::lock_guard<std::recursive_mutex> g(eng->mu);
      eng->flush();
      for (const Leaf& l : leaves)
        if (is_written(l.arg)) eng->writes_to_plain(l.tensor);
    }
    if (eng && eng->open && !at::GradMode::is_enabled() && reads_call_for_hooks()) {
      // A custom autograd.Function's forward on plain tensors: its backward may
      // accumulate a managed gradient into a parameter read here (an optimizer's
      // writes to its parameters are no reads that call for a hook).
      for (const Leaf& l : leaves)
        if (l.tensor.defined() && l.tensor.requires_grad() && !is_written(l.arg)) {
          std::lock_guard<std::recursive_mutex> g(eng->mu);
          eng->hook_leaf(l.tensor);
        }
    }
    const bool remembers =
        facts.fill || (facts.transpose && !leaves.empty() && leaves[0].tensor.defined() &&
                       leaves[0].tensor.layout() == c10::kSparse);  // not a weight's t()
    if (eng && eng->open && remembers)
      run_and_remember(*eng, op, facts, stack, begin);
    else
      NativeEngine::call_below(op, stack, at::GradMode::is_enabled());
    return;
  }
  NativeEngine& e = *eng;
  std::lock_guard<std::recursive_mutex> g(e.mu);
  e.flush();
  bool writes_managed = false;
  for (const Leaf& l : leaves)
    if (l.native && is_written(l.arg)) writes_managed = true;
  if (writes_managed && facts.view_form && (*stack)[begin].isTensor() &&
      as_native((*stack)[begin].toTensor())) {
    // x.squeeze_(), x.t_(), ... (Runtime._run_view_inplace): x becomes a view of what it
    // was and its data does not change, so this is the view op, recorded like any other,
    // with x naming its result and taking its geometry
    at::Tensor self = (*stack)[begin].toTensor();
    torch::jit::Stack call(stack->begin() + begin, stack->end());
    serve(*facts.view_form, &call);
    NativeImpl* view = as_native(call.back().toTensor());
    if (view == nullptr || view->eng_ != eng)
      throw std::logic_error("dtr: internal error: " + py_name(schema) + "'s view is not managed");
    as_native(self)->adopt(*view);
    stack->erase(stack->begin() + static_cast<std::ptrdiff_t>(begin), stack->end());
    stack->push_back(self);
    return;
  }
  if ((writes_managed && facts.reshapes) || (managed && facts.replaces_storage))
    throw Unsupported("dtr: " + py_name(schema) +
                      " replaces the storage of a managed tensor in place, which dtr does not "
                      "support; use the out-of-place op, or dtr.materialize() the tensor first");
  if (writes_managed && facts.out_form) refuse_shared_resize(op, *stack, begin, leaves, is_written);
  if (!facts.meta_only) adopt_filled(e, leaves, stack, begin, is_written);
  Core& core = e.core;
  std::vector<int64_t> fresh, locked, held;
  auto finish = [&] {
    for (int64_t t : locked) core.unlock(t);
    for (int64_t t : fresh) core.release(t);
    for (int64_t t : held) core.release(t);
    locked.clear();
    fresh.clear();
    held.clear();
  };
  try {
    // inputs: managed ones locked and rebuilt if evicted; plain ones registered as constants
    std::vector<int64_t> tids(leaves.size(), -1);
    std::vector<int64_t> part_tids;                   // a sparse input's parts after its first
    std::vector<std::pair<size_t, Rebuilt>> rebuilt;  // per leaf taken again at replay
    std::vector<at::Tensor> passed(leaves.size());    // what the kernel gets
    if (facts.meta_only) {
      // empty_like(x) and kin (Runtime._run_meta_only): x's value is neither read nor kept,
      // by this call or its recomputation, so they get a stand-in with x's metadata and
      // no data. Its data pointer is a plain null, not guarded: the stand-in reaches only
      // this kMetaOnly kernel, which reads no data (and is never recorded), and the
      // profiler's range around that call reads the pointer of every input.
      for (size_t k = 0; k < leaves.size(); ++k) {
        const at::Tensor& t = leaves[k].tensor;
        if (!t.defined()) continue;
        passed[k] = over(t, empty_storage(t.storage().nbytes(), t.device(), false));
        set_item((*stack)[begin + leaves[k].arg], leaves[k].item, passed[k]);
      }
    }
    // as Runtime._run: plain inputs become constants first, then the managed ones are
    // locked, then rebuilt (the order the trace's CONSTANT and INPUTS lines replay)
    for (size_t k = 0; k < leaves.size(); ++k) {
      Leaf& l = leaves[k];
      if (facts.meta_only || l.native) continue;
      // A Python number the op was called with (`h * 1.0001`) arrives as a wrapped 0-dim
      // tensor made for this call alone: a value, which the recipe keeps in its
      // arguments, not memory of the program's (a constant per op would pin 8 bytes for
      // as long as the recipe lives, growing with an unrolled recurrence).
      if (l.tensor.defined() && !is_written(l.arg) &&
          !l.tensor.unsafeGetTensorImpl()->is_wrapped_number()) {
        if (l.tensor.layout() == c10::kStrided) {
          tids[k] = e.constant(l.tensor, fresh);
        } else {  // a sparse tensor: each part's storage is a constant
          // (or its source's, for a transpose the recipe takes again: dtr/engines/subclass/rebuildable_plain.py)
          std::optional<Rebuilt> r = e.rebuilt_for(l.tensor);
          const std::vector<at::Tensor> parts = sparse_parts(r ? r->args[0].toTensor() : l.tensor);
          tids[k] = e.constant(parts[0], fresh);
          for (size_t q = 1; q < parts.size(); ++q)
            part_tids.push_back(e.constant(parts[q], fresh));
          if (r) {
            r->arg = l.arg;
            r->item = l.item;
            rebuilt.emplace_back(k, std::move(*r));
          }
        }
      }
      passed[k] = l.tensor;
    }
    for (size_t k = 0; k < leaves.size(); ++k) {
      Leaf& l = leaves[k];
      if (l.native && !facts.meta_only) {
        tids[k] = l.native->tid();
        core.lock(tids[k]);
        locked.push_back(tids[k]);
      }
    }
    if (e.trace) e.trace->phase(torch::autograd::get_current_graph_task_id() != -1);
    for (size_t k = 0; k < leaves.size(); ++k) {
      Leaf& l = leaves[k];
      if (facts.meta_only || !l.native) continue;
      // the core's view, not the storage's: a view whose base was rebuilt shares its
      // memory but is rebuilt through its own recipe, as the subclass engine and a replay do
      if (!core.is_materialized(tids[k])) e.rematerialize(tids[k]);
      passed[k] = e.values[tids[k]];
      set_item((*stack)[begin + l.arg], l.item, passed[k]);
    }
    // Room for the outputs and the kernel's own buffers before they exist, as much as the
    // last such call had in use (Runtime._run, dtr/engines/subclass/kernel_peaks.py); if it cannot be made, the
    // boundary after the op reports the budget. A trace records the guess with no budget
    // too, for replays under one.
    std::vector<int64_t> size_key;
    int64_t reserve = 0;
    if ((core.budget >= 0 || e.trace) && e.reserve) {
      size_key = size_key_of(schema, leaves);
      auto it = e.out_sizes.find(size_key);
      reserve = it == e.out_sizes.end() ? 0 : it->second;
      if (reserve > 0 && core.budget >= 0 && core.resident_bytes + reserve > core.budget) {
        core.make_room(reserve);
        e.drain();
      }
    }
    if (e.trace) e.trace->inputs(locked, reserve);  // the managed inputs, locked above
    // In-place writes (Invariant 4, Runtime._prepare_writes): a managed tensor that is the
    // only one of its storage the program holds gets a new version (its old value keeps
    // its lineage); any other written tensor has what reads it materialized and pinned.
    std::vector<size_t> versioned, invalid;
    auto shares_written = [&](size_t k) {  // another written argument in k's storage
      for (size_t q = 0; q < leaves.size(); ++q)
        if (leaves[q].native && is_written(leaves[q].arg) && tids[q] != tids[k] &&
            core.pool_of(tids[q]) == core.pool_of(tids[k]))
          return true;
      return false;
    };
    for (size_t k = 0; k < leaves.size(); ++k) {
      if (!is_written(leaves[k].arg) || !leaves[k].tensor.defined()) continue;
      if (leaves[k].native) {
        int times = 0;
        for (size_t q = 0; q < leaves.size(); ++q)
          if (leaves[q].native && is_written(leaves[q].arg) && tids[q] == tids[k]) ++times;
        if (times == 1 && (core.is_private(tids[k]) ||
                           (!facts.out_form && !shares_written(k) && e.pool_version_ok(tids[k])))) {
          versioned.push_back(k);
          continue;
        }
      }
      invalid.push_back(k);
    }
    if (!invalid.empty())
      // invalidating can drop a constant this op reads (written views of one storage
      // share it): each is held until the op ends
      for (size_t k = 0; k < leaves.size(); ++k)
        if (!leaves[k].native && tids[k] >= 0 && !contains(fresh, tids[k])) {
          core.retain(tids[k]);
          held.push_back(tids[k]);
        }
    for (size_t k : invalid) {
      if (leaves[k].native) {
        e.invalidate(core.members(tids[k]));
      } else {
        e.writes_to_plain(leaves[k].tensor);
      }
    }
    const bool record = facts.other_returns || !versioned.empty();
    // A recipe reads the value a written argument without a version had before the op:
    // a copy, taken now (batch norm's running statistics).
    std::vector<int64_t> snap_tid(leaves.size(), -1);
    std::vector<at::Tensor> snap(leaves.size());
    if (record)
      for (size_t k : invalid) {
        snap[k] = copy_storage(passed[k]);
        snap_tid[k] = e.constant(snap[k], fresh);
      }
    // ... and a snapshot of an argument in volatile memory (Runtime._snapshot_volatile). A
    // view's outputs share the argument's pool or stay plain, and are never rebuilt from it.
    if (record && !facts.view && !facts.meta_only)
      for (size_t k = 0; k < leaves.size(); ++k) {
        const at::Tensor& t = passed[k];
        if (snap_tid[k] >= 0 || !t.defined() || t.layout() != c10::kStrided ||
            is_written(leaves[k].arg) || !e.is_volatile(t, leaves[k].native != nullptr))
          continue;
        snap[k] = e.snapshot(t);
        snap_tid[k] = e.constant(snap[k], fresh);
      }
    // A random op replays from its generator's state before it ran (Invariant 1); the
    // saved state is memory its recipe holds, counted as a constant. An op outside aten
    // is watched the same way, and its state kept only if it drew.
    std::optional<at::Generator> gen;
    at::Tensor rng_state;
    if (record && (facts.seeded || facts.may_draw)) {
      gen = generator_of(schema, *stack, begin);
      std::lock_guard<std::mutex> lock(gen->mutex());
      rng_state = gen->get_state();
    }
    // An out= op may resize what it writes: a versioned argument's kernel gets a tensor of
    // its own over the storage, so that the old value keeps its geometry.
    if (facts.out_form)
      for (size_t k : versioned) {
        passed[k] = over(passed[k], passed[k].storage());
        set_item((*stack)[begin + leaves[k].arg], leaves[k].item, passed[k]);
      }
    std::vector<c10::IValue> args;  // the recipe's (recorded ops only)
    if (record) args.assign(stack->begin() + begin, stack->end());
    std::vector<c10::IValue> priced;  // the roofline's view of the arguments
    if (e.roofline) priced.assign(stack->begin() + begin, stack->end());
    // (the CPU allocator's window sees a CPU kernel's buffers only: on another device, the
    // outputs alone are reserved)
    const bool measured = !size_key.empty() && device_of(*stack, begin).is_cpu();
    const int64_t in_use = measured ? cpu_cache::window_mark() : -1;
    auto start = std::chrono::steady_clock::now();
    e.call_evicting(op, stack, begin, at::GradMode::is_enabled(), written.empty(),
                    gen ? &*gen : nullptr, rng_state);
    double cost = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (gen && !facts.seeded && !drew(*gen, rng_state)) gen.reset();
    // what the kernel had in use at most beyond what was in use before it: its outputs
    // and its own buffers (convolution_backward's are larger than its outputs)
    const int64_t kernel_peak = in_use < 0 ? -1 : cpu_cache::window_peak() - in_use;
    // outputs: an argument written in place (the program gets its own tensor back), a
    // view of an input (same storage) or of an earlier output, or fresh
    const size_t nret = schema.returns().size();
    const size_t rbegin = stack->size() - nret;
    if (e.roofline)
      cost = roofline_seconds(schema.name(), priced,
                              c10::ArrayRef<c10::IValue>(stack->data() + rbegin, nret));
    std::vector<int64_t> kinds, refs, nbytes;
    std::vector<Out> outs;
    std::vector<at::Tensor> produced;
    std::vector<const c10::StorageImpl*> fresh_storage;
    for (size_t k : versioned) {
      kinds.push_back(kVersion);
      refs.push_back(tids[k]);
      nbytes.push_back(0);
      outs.push_back({0, -1, -1});  // its slot is set with the recipe's
      produced.push_back(passed[k]);
      fresh_storage.push_back(nullptr);
    }
    for (size_t i = 0; i < nret; ++i) {
      if (std::find(facts.plain_returns.begin(), facts.plain_returns.end(), i) !=
          facts.plain_returns.end())
        continue;
      auto take = [&](int64_t j, const at::Tensor& t) {
        // sparse, quantized and nested results stay plain, as the subclass engine leaves
        // them (a NativeImpl has the engine's keys only: a quantized value would read
        // as its integers)
        if (!t.defined() || t.layout() != c10::kStrided || t.is_quantized() || t.is_nested())
          return;
        for (size_t k = 0; k < leaves.size(); ++k)
          if (is_written(leaves[k].arg) && passed[k].defined() && t.is_same(passed[k])) {
            set_item((*stack)[rbegin + i], j, leaves[k].tensor);
            return;
          }
        const c10::StorageImpl* s = t.storage().unsafeGetStorageImpl();
        int64_t src = -1;  // the last input sharing its storage (a managed tensor shares
                           // its value's)
        for (size_t k = leaves.size(); k-- > 0;)
          if (passed[k].defined() && passed[k].has_storage() &&
              passed[k].storage().unsafeGetStorageImpl() == s) {
            src = static_cast<int64_t>(k);
            break;
          }
        if (src >= 0 && is_written(leaves[src].arg))
          refuse(op, "it returns a view of a tensor it writes in place");
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
        outs.push_back({i, j, -1});
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
    if (!size_key.empty()) {
      int64_t total = 0;
      for (int64_t b : nbytes) total += b;
      if (e.out_sizes.size() >= kMaxSizeEntries && !e.out_sizes.count(size_key))
        e.out_sizes.clear();
      e.out_sizes[std::move(size_key)] = std::max(total, kernel_peak);
    }
    std::vector<int64_t> protect;  // the fresh outputs, protected while settling
    if (!kinds.empty()) {
      std::vector<int64_t> inputs;
      Recipe rec;
      rec.op = op;
      rec.grad = at::GradMode::is_enabled();
      rec.out_form = facts.out_form;
      std::vector<int64_t> slot_of(leaves.size(), -1);
      for (size_t k = 0; k < leaves.size(); ++k) {
        if (snap_tid[k] >= 0) {
          inputs.push_back(snap_tid[k]);
          rec.plain.emplace_back(snap[k]);
          set_item(args[leaves[k].arg], leaves[k].item, snap[k]);
          if (is_written(leaves[k].arg)) rec.scratch.emplace_back(leaves[k].arg, leaves[k].item);
        } else if (leaves[k].native && tids[k] >= 0) {
          inputs.push_back(tids[k]);
          slot_of[k] = static_cast<int64_t>(rec.slots.size());
          rec.slots.push_back({leaves[k].arg, leaves[k].item, tids[k]});
        } else if (tids[k] >= 0) {
          inputs.push_back(tids[k]);
          auto r = std::find_if(rebuilt.begin(), rebuilt.end(),
                                [&](const auto& x) { return x.first == k; });
          if (r == rebuilt.end()) {
            rec.plain.emplace_back(leaves[k].tensor);
          } else {  // the recipe holds its source instead, checked as a plain read
            rec.plain.emplace_back(r->second.args[0].toTensor());
            set_item(args[leaves[k].arg], leaves[k].item, at::Tensor());
            rec.rebuilt.push_back(std::move(r->second));
          }
        }
      }
      inputs.insert(inputs.end(), part_tids.begin(), part_tids.end());
      if (gen) {
        inputs.push_back(e.constant(rng_state, fresh));
        rec.gen = gen;
        rec.rng_state = rng_state;
      }
      for (size_t v = 0; v < versioned.size(); ++v) outs[v].slot = slot_of[versioned[v]];
      // the recipe holds no managed value: its slots are filled at each replay
      rec.args = std::move(args);
      for (const Slot& s : rec.slots) set_item(rec.args[s.arg], s.item, at::Tensor());
      rec.outs = outs;
      const std::vector<int64_t> out_tids =
          core.record(inputs, cost, kinds, refs, nbytes, py_name(schema));
      const size_t declared = kinds.size();
      // A pool version's followers (after the declared outputs): the program's tensors
      // naming the written storage's other held members name their new tensors, over the
      // same storage; their old values move with the written one's (detach_old_version).
      std::vector<std::shared_ptr<Cell>> follower_cells;
      std::vector<int64_t> followed_version;  // per follower: the output it follows
      for (size_t q = declared; q < out_tids.size(); ++q) {
        const int64_t m = core.followed().at(q - declared);
        size_t v = 0;
        while (core.pool_of(out_tids[v]) != core.pool_of(out_tids[q])) ++v;
        rec.outs.push_back({0, -1, outs[v].slot, true});
        outs.push_back(rec.outs.back());
        refs.push_back(m);
        produced.push_back(e.values.at(m));
        follower_cells.push_back(e.cell_of(m));
        followed_version.push_back(static_cast<int64_t>(v));
      }
      if (e.trace) {
        std::vector<int64_t> aliases;  // the trace's ALIAS: an index into ARGS, or past it
        for (size_t q = 0; q < declared; ++q) {
          int64_t a = -1;
          if (refs[q] >= 0) {
            for (size_t k = 0; k < inputs.size() && a < 0; ++k)
              if (inputs[k] == refs[q]) a = static_cast<int64_t>(k);
          } else if (kinds[q] != kNew) {
            a = static_cast<int64_t>(inputs.size()) - refs[q] - 1;  // result -(refs + 1)
          }
          aliases.push_back(a);
        }
        std::vector<int64_t> traced_kinds = kinds, traced_nbytes = nbytes;
        for (int64_t v : followed_version) {
          traced_kinds.push_back(kFollow);
          traced_nbytes.push_back(0);
          aliases.push_back(static_cast<int64_t>(inputs.size()) + v);
        }
        e.trace->call(schema.name(), inputs, out_tids, cost, traced_kinds, aliases, traced_nbytes,
                      fresh);
      }
      rec.out_tids = out_tids;
      int64_t rid = core.recipe_of(out_tids[0]);
      if (static_cast<int64_t>(e.recipes.size()) <= rid) e.recipes.resize(rid + 1);
      e.recipes[rid] = std::move(rec);
      for (size_t q = 0; q < out_tids.size(); ++q) {
        if (static_cast<int64_t>(e.output_of.size()) <= out_tids[q])
          e.output_of.resize(out_tids[q] + 1, {-1, 0});
        e.output_of[out_tids[q]] = {rid, q};
        if (outs[q].follows) {
          e.rename(follower_cells[q - declared], out_tids[q]);
        } else if (outs[q].slot >= 0) {  // a new version: the program's tensor names it now
          e.detach_old_version(refs[q]);
          e.rename(leaves[versioned[q]].native->cell_, out_tids[q]);  // versions come first
        } else {
          protect.push_back(out_tids[q]);
        }
        e.set(e.values, out_tids[q], produced[q]);
      }
      // the program's result: managed tensors for the recorded fresh outputs
      for (size_t q = 0; q < out_tids.size(); ++q) {
        if (outs[q].slot >= 0) continue;
        at::Tensor w = at::detail::make_tensor<NativeImpl>(eng, out_tids[q], produced[q]);
        e.rename(static_cast<NativeImpl*>(w.unsafeGetTensorImpl())->cell_, out_tids[q]);
        set_item((*stack)[rbegin + outs[q].ret], outs[q].item, w);
      }
    }
    if (e.trace && kinds.empty()) e.trace->call(schema.name(), {}, {}, cost, {}, {}, {}, fresh);
    if (facts.out_form)  // the written tensors take what the kernel made of their values
      for (size_t k = 0; k < leaves.size(); ++k) {
        NativeImpl* impl = leaves[k].native;
        if (impl == nullptr || !is_written(leaves[k].arg) || !passed[k].defined()) continue;
        impl->take_geometry(*passed[k].unsafeGetTensorImpl());
        const auto nbytes = static_cast<int64_t>(passed[k].storage().nbytes());
        if (nbytes != core.pool_bytes(impl->tid())) core.resized(impl->tid(), nbytes);
      }
    finish();
    e.drain();
    // the op boundary (Runtime._settle): its fresh outputs protected while choosing
    const int64_t before = core.resident_bytes;  // a timeline's row brackets the evictions
    for (int64_t t : protect) core.lock(t);
    bool ok = core.make_room(0);
    for (int64_t t : protect) core.unlock(t);
    e.drain();
    const bool fits = core.op_fits();
    if (!ok || !fits) {  // its fresh outputs, or all it needed at once (Runtime._settle)
      int64_t requested = 0;
      for (int64_t b : nbytes) requested += b;
      if (!fits) requested = core.last_need - core.constant_bytes();
      BudgetExceeded error = e.budget_error(requested, "running " + py_name(schema));
      core.make_room(0);  // its outputs, unlocked now, can go (Runtime._budget_error)
      e.drain();
      throw error;
    }
    if (e.stress) {  // every later read recomputes (Runtime._settle)
      core.evict_all();
      e.drain();
    }
    if (e.timeline_limit > 0) e.timeline_row(op, before);
    if (e.check) core.check();
  } catch (...) {
    finish();
    e.drain();
    throw;
  }
}

// dtr's error `cls` (a name in dtr.errors) as a pending Python error: torch's op bindings
// and autograd's engine pass it through as it is. Called where the engine's lock is no
// longer held, so taking the GIL cannot deadlock on it.
[[noreturn]] void raise_python(const char* cls, const char* what) {
  py::gil_scoped_acquire gil;
  py::object type = py::module_::import("dtr.errors").attr(cls);
  PyErr_SetString(type.ptr(), what);
  python_error err;
  err.persist();
  throw err;
}

// dtr/engines/subclass/oom.py's message for an out-of-memory dtr could not evict past.
// Called where no engine lock is held.
std::string oom_text(const OutOfMemory& o) {
  py::gil_scoped_acquire gil;
  auto number = [](int64_t n) { return py::cpp_function([n] { return n; }); };
  py::object core = py::module_::import("types").attr("SimpleNamespace")(
      py::arg("resident_bytes") = o.resident, py::arg("pinned_bytes") = number(o.pinned),
      py::arg("locked_bytes") = number(o.locked));
  return py::module_::import("dtr.engines.subclass.oom")
      .attr("oom_message")(o.op, std::string(o.what()), o.retried, core)
      .cast<std::string>();
}

// f(), the engine's refusals raised as dtr's errors.
template <typename F>
void with_python_errors(F&& f) {
  try {
    f();
  } catch (const BudgetExceeded& b) {
    raise_python("BudgetError", budget_text(b).c_str());
  } catch (const Unsupported& u) {
    raise_python("UnsupportedError", u.what());
  } catch (const OutOfMemory& o) {
    raise_python("BudgetError", oom_text(o).c_str());
  }
}

// The boxed fallback.
void fallback(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  with_python_errors([&] { serve(op, stack); });
}

// Ops on sparse, sparse CSR, quantized or nested tensors reach these keys while the
// session's key is included. dtr manages no such tensor's parts, as in the subclass engine:
// an op that only reads plain sparse tensors (a graph's adjacency in torch.sparse.mm) is
// served like any other, the sparse ones constants of its recipe (dtr/engines/subclass/storage_keys.py);
// a sparse result stays plain, and a managed value it is built on (the values of an
// embedding's sparse gradient) is pinned, since eviction would free memory the result
// holds. Other ops run on plain values as they are, after what reads the memory they
// write is invalidated (`adj.mul_(2)` while a recipe reads adj); with a managed tensor
// among their arguments they are refused.
void other_layout_fallback(const c10::OperatorHandle& op, c10::DispatchKeySet,
                           torch::jit::Stack* stack) {
  const size_t n = op.schema().arguments().size();
  const size_t begin = stack->size() - n;
  std::shared_ptr<NativeEngine> eng = active();
  const bool open = eng && eng->open;
  const OpFacts& facts = facts_of(op);
  auto is_written = [&](size_t i) {
    return std::find(facts.written.begin(), facts.written.end(), i) != facts.written.end();
  };
  std::vector<at::Tensor> managed;
  std::vector<std::pair<size_t, int64_t>> foreign;
  bool servable = !facts.meta_only;  // every other-layout argument sparse and only read
  std::vector<at::Tensor> written_plain;
  for_each_tensor(stack, begin, n, [&](size_t i, int64_t j, const at::Tensor& t) {
    NativeImpl* impl = as_native(t);
    if (impl != nullptr) {
      if (open && impl->eng_ == eng)
        managed.push_back(t);
      else
        foreign.emplace_back(i, j);  // after the block, or another session's: plain values
      return;
    }
    if (!t.defined()) return;
    const bool other = t.layout() != c10::kStrided || t.is_quantized() || t.is_nested();
    if (other && (!is_sparse_layout(t) || is_written(i))) servable = false;
    if (is_written(i)) written_plain.push_back(t);
  });
  if (servable) {
    with_python_errors([&] {
      serve(op, stack);
      const size_t nret = op.schema().returns().size();
      for (size_t r = stack->size() - nret; r < stack->size() && !managed.empty(); ++r) {
        if (!(*stack)[r].isTensor()) continue;
        const at::Tensor& out = (*stack)[r].toTensor();
        if (!out.defined() || !is_sparse_layout(out)) continue;
        for (const at::Tensor& part : sparse_parts(out))
          for (const at::Tensor& m : managed)
            if (part.storage().unsafeGetStorageImpl() == m.storage().unsafeGetStorageImpl())
              export_value(*eng, m);
      }
    });
    return;
  }
  if (!managed.empty())
    raise_python("UnsupportedError",
                 ("dtr: " + py_name(op.schema()) +
                  " mixes a managed tensor with a non-strided (sparse or nested) one that dtr "
                  "cannot record (nested, quantized, or a sparse tensor it writes); "
                  "dtr.materialize() the managed tensor first")
                     .c_str());
  for (auto [i, j] : foreign) replace_with_plain(stack, begin + i, j);
  if (open && !written_plain.empty()) {
    std::lock_guard<std::recursive_mutex> g(eng->mu);
    eng->flush();
    for (const at::Tensor& t : written_plain) eng->writes_to_plain(t);
  }
  NativeEngine::call_below(op, stack, at::GradMode::is_enabled());
}

// Composite ops whose PyTorch kernel reads a tensor argument's memory in C++ (through
// data_ptr or item) before any op of theirs reaches the engine: tensor_split's indices,
// ctc_loss's lengths. Those arguments, by position, are replaced by a plain copy of their
// value, recomputed if evicted; the composite kernel then runs as it would have.
const std::unordered_map<std::string, std::vector<size_t>>& value_args() {
  static const std::unordered_map<std::string, std::vector<size_t>> table = {
      {"aten::tensor_split.tensor_indices_or_sections", {1}},
      {"aten::ctc_loss.Tensor", {2, 3}},
  };
  return table;
}

// A managed tensor's value as a plain tensor of its own (the program reads it, as the trace's
// READ: locked, recomputed if evicted, unlocked; nothing pinned).
at::Tensor value_copy(const at::Tensor& t, bool whole_storage = false) {
  NativeImpl* impl = as_native(t);
  if (impl == nullptr) return t;
  // the copy is a plain tensor: made below the session's key (recomputation is not)
  auto plain_copy = [&] {
    if (whole_storage) return copy_storage(plain_view(t));  // (below the session itself)
    Below below;  // (the value's own device's kernels, which may redispatch: _copy_from)
    return plain_view(t).clone();
  };
  std::shared_ptr<NativeEngine> eng = impl->eng_;
  if (!eng || !eng->open) return plain_copy();  // after the block: its last value
  std::lock_guard<std::recursive_mutex> g(eng->mu);
  eng->flush();
  const int64_t tid = impl->tid();
  if (eng->trace) eng->trace->read(tid);
  eng->make_resident(tid);
  // (under the engine's lock, and made below it: nothing can evict it before the copy)
  at::Tensor copy = plain_copy();
  eng->drain();
  return copy;
}

// A gradient for .grad (dtr/grads.py's hand_out, Python's leaf hook): the value itself
// when it is private (export_value: a new version takes its storage over), a plain copy
// when other live tensors share its memory, as eager's AccumulateGrad copies a gradient
// that something else holds. Exporting shared memory would pin the whole pool and every
// reader of it for good (a profiler recording shapes holds each node's inputs, and then
// every weight's gradient shares its pool with the product it is a transpose of).
at::Tensor grad_value(NativeEngine& e, const at::Tensor& t) {
  NativeImpl* impl = as_native(t);
  if (impl == nullptr) return t;
  {
    std::lock_guard<std::recursive_mutex> g(e.mu);
    if (impl->eng_.get() == &e && e.open) {
      e.flush();
      if (!e.core.is_private(impl->tid())) return value_copy(t);
    }
  }
  return export_value(e, t);
}

void read_values_first(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                       torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t begin = stack->size() - schema.arguments().size();
  const std::string name =
      schema.operator_name().overload_name.empty()
          ? schema.operator_name().name
          : schema.operator_name().name + "." + schema.operator_name().overload_name;
  auto it = value_args().find(name);
  if (it != value_args().end()) {
    try {
      for (size_t i : it->second) {
        c10::IValue& iv = (*stack)[begin + i];
        if (iv.isTensor() && as_native(iv.toTensor())) iv = value_copy(iv.toTensor());
      }
    } catch (const BudgetExceeded& b) {
      raise_python("BudgetError", budget_text(b).c_str());
    } catch (const Unsupported& u) {
      raise_python("UnsupportedError", u.what());
    }
  }
  // below autograd: the composite kernel, whose own ops record their gradients
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

// torch.distributed's ops (namespaces c10d and _c10d_functional), at kAutogradKey, ahead of
// the fallback (with the session's key included, collectives on plain tensors come here
// too). No rank can rerun a collective alone, so none is recorded: as in the subclass engine
// (Runtime._run_collective), managed arguments are handed to it as exported values
// (resident and pinned from then on; the program's tensors read what it writes), what
// reads a written tensor is invalidated first (c10d's in-place collectives declare no
// writes, so every tensor argument of a c10d:: op counts as written), and the op runs
// below the session on plain tensors, with plain results.
void collective(const c10::OperatorHandle& op, c10::DispatchKeySet, torch::jit::Stack* stack) {
  const c10::FunctionSchema& schema = op.schema();
  const size_t n = schema.arguments().size();
  const size_t begin = stack->size() - n;
  std::shared_ptr<NativeEngine> eng = active();
  const bool open = eng && eng->open;
  std::vector<std::pair<size_t, int64_t>> managed, foreign;
  for_each_tensor(stack, begin, n, [&](size_t i, int64_t j, const at::Tensor& t) {
    NativeImpl* impl = as_native(t);
    if (impl == nullptr) return;
    if (open && impl->eng_ == eng)
      managed.emplace_back(i, j);
    else
      foreign.emplace_back(i, j);  // after the block, or another session's: plain values
  });
  for (auto [i, j] : foreign) replace_with_plain(stack, begin + i, j);
  if (open) {
    const bool writes_all = schema.name().rfind("c10d::", 0) == 0;
    const std::vector<size_t>& written = facts_of(op).written;
    try {
      std::lock_guard<std::recursive_mutex> g(eng->mu);
      eng->flush();
      for (auto [i, j] : managed) {
        c10::IValue& iv = (*stack)[begin + i];
        set_item(iv, j, export_value(*eng, get_item(iv, j)));
      }
      for_each_tensor(stack, begin, n, [&](size_t i, int64_t, const at::Tensor& t) {
        if (t.defined() &&
            (writes_all || std::find(written.begin(), written.end(), i) != written.end()))
          eng->writes_to_plain(t);
      });
    } catch (const BudgetExceeded& b) {
      raise_python("BudgetError", budget_text(b).c_str());
    } catch (const Unsupported& u) {
      raise_python("UnsupportedError", u.what());
    }
  }
  NativeEngine::call_below(op, stack, at::GradMode::is_enabled());
}

// The registrations live as long as the process (never deregistered at exit, when
// the dispatcher may already be gone).
torch::Library* g_fallback_lib = nullptr;
torch::Library* g_autograd_lib = nullptr;
torch::Library* g_routed_lib = nullptr;
torch::Library* g_value_args_lib = nullptr;
std::vector<torch::Library*> g_collective_libs;
std::vector<torch::Library*> g_other_libs;

}  // namespace

// Registered on first use, not at import: a process may have a backend of its own at kKey
// (dtr/engines/native/key.py checks that none has).
void install(const std::vector<std::string>& routed_ops,
             const std::vector<std::tuple<std::string, std::string, std::string>>& view_forms,
             const std::vector<std::pair<std::string, std::string>>& collective_ops) {
  if (g_fallback_lib) return;
  for (const auto& [inplace, name, overload] : view_forms)
    g_view_forms.insert_or_assign(inplace, c10::OperatorName(name, overload));
  g_fallback_lib = new torch::Library(
      torch::Library::IMPL, "_", std::optional<c10::DispatchKey>(kKey),
      __FILE__, __LINE__);
  g_fallback_lib->fallback(torch::CppFunction::makeFromBoxedFunction<&fallback>());
  // Ops with no autograd kernel of their own (custom ops: torch.library's, FSDP's fsdp::)
  // get at kAutogradKey the fallback they get at AutogradCPU: PyTorch registers it for
  // the backends it knows and PrivateUse1 only, and without it such an op on a managed
  // tensor, or on any tensor while the session's key is included, would have no kernel.
  g_autograd_lib = new torch::Library(torch::Library::IMPL, "_",
                                      std::optional<c10::DispatchKey>(kAutogradKey), __FILE__,
                                      __LINE__);
  g_autograd_lib->fallback(torch::autograd::basicAutogradNotImplementedFallback());
  for (c10::DispatchKey key : kOtherLayoutKeys) {
    g_other_libs.push_back(new torch::Library(
        torch::Library::IMPL, "_", std::optional<c10::DispatchKey>(key), __FILE__, __LINE__));
    g_other_libs.back()->fallback(
        torch::CppFunction::makeFromBoxedFunction<&other_layout_fallback>());
  }
  // Ops whose composite kernel would take kKey before any fallback: routed here.
  g_routed_lib = new torch::Library(torch::Library::IMPL, "aten",
                                    std::optional<c10::DispatchKey>(kKey),
                                    __FILE__, __LINE__);
  for (const auto& name : routed_ops)
    g_routed_lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&fallback>());
  g_value_args_lib = new torch::Library(
      torch::Library::IMPL, "aten",
      std::optional<c10::DispatchKey>(kAutogradKey), __FILE__, __LINE__);
  for (const auto& [name, args] : value_args())
    g_value_args_lib->impl(name.substr(6).c_str(),  // without "aten::"
                           torch::CppFunction::makeFromBoxedFunction<&read_values_first>());
  // (namespace, name) of each collective; c10d has no kernel of its own at this key
  std::unordered_map<std::string, torch::Library*> by_namespace;
  for (const auto& [ns, name] : collective_ops) {
    torch::Library*& lib = by_namespace[ns];
    if (lib == nullptr) {
      lib =
          new torch::Library(torch::Library::IMPL, ns,
                             std::optional<c10::DispatchKey>(kAutogradKey),
                             __FILE__, __LINE__);
      g_collective_libs.push_back(lib);
    }
    lib->impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&collective>());
  }
  // and at the other layouts' keys (a sparse tensor's is_coalesced would get the composite
  // kernel, which refuses every layout, rather than the sparse one below)
  for (c10::DispatchKey key : kOtherLayoutKeys) {
    g_other_libs.push_back(new torch::Library(
        torch::Library::IMPL, "aten", std::optional<c10::DispatchKey>(key), __FILE__, __LINE__));
    for (const auto& name : routed_ops)
      g_other_libs.back()->impl(
          name.c_str(), torch::CppFunction::makeFromBoxedFunction<&other_layout_fallback>());
  }
}

// What the open session does when the program changes a plain tensor's memory behind
// the engine (`p.data = ...`, an export of its memory): `what` under the engine's lock,
// pending drops flushed first and evictions drained after; nothing with no session open
// or for a managed tensor.
static void on_plain(const at::Tensor& t, void (NativeEngine::*what)(const at::Tensor&)) {
  std::shared_ptr<NativeEngine> eng = active();
  if (!eng || as_native(t) != nullptr) return;
  py::gil_scoped_release nogil;
  with_python_errors([&] {
    std::lock_guard<std::recursive_mutex> g(eng->mu);
    if (!eng->open) return;
    eng->flush();
    ((*eng).*what)(t);
    eng->drain();
  });
}

void bind(py::module_& m) {
  // BudgetExceeded or Unsupported out of a binding (close() or materialize() recomputing)
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const BudgetExceeded& b) {
      py::object cls = py::module_::import("dtr.errors").attr("BudgetError");
      PyErr_SetString(cls.ptr(), budget_text(b).c_str());
    } catch (const Unsupported& u) {
      py::object cls = py::module_::import("dtr.errors").attr("UnsupportedError");
      PyErr_SetString(cls.ptr(), u.what());
    }
  });
  py::class_<NativeEngine, std::shared_ptr<NativeEngine>>(m, "NativeEngine")
      .def(py::init([](const std::string& heuristic, int64_t budget, uint64_t seed,
                       const std::string& cost_model) {
             if (cost_model != "time" && cost_model != "roofline")
               throw std::invalid_argument("dtr: unknown cost_model '" + cost_model +
                                           "'; valid: time, roofline");
             return std::make_shared<NativeEngine>(heuristic, budget, seed, cost_model == "roofline");
           }),
           py::arg("heuristic") = "dtr", py::arg("budget") = -1, py::arg("seed") = 0,
           py::arg("cost_model") = "roofline")
      .def("activate",
           [](std::shared_ptr<NativeEngine> self) {
             std::lock_guard<std::mutex> g(g_mu);
             if (g_engine && g_engine->open)
               throw std::runtime_error("dtr: a native session is already open");
             g_engine = self;
             profiled::install();
           })
      .def("close",
           [](std::shared_ptr<NativeEngine> self, bool rebuild) {
             auto deactivate = [&] {
               {
                 std::lock_guard<std::mutex> g(g_mu);
                 if (g_engine != self) return;
                 g_engine.reset();
               }
               profiled::remove();
             };
             try {
               // without the GIL: an op holding the engine's lock may need it (a tensor
               // whose Python object it frees)
               py::gil_scoped_release nogil;
               self->close(rebuild);
             } catch (...) {
               deactivate();
               self->leaf_hook = py::object();
               throw;
             }
             deactivate();
             self->leaf_hook = py::object();
           },
           py::arg("rebuild") = true)
      .def(
          "set_budget",
          [](NativeEngine& e, int64_t nbytes) {  // -1: none
            std::lock_guard<std::recursive_mutex> g(e.mu);
            e.core.budget = nbytes;
            if (e.trace) e.trace->budget(nbytes);
          },
          py::arg("nbytes"))
      .def_readwrite("reserve", &NativeEngine::reserve)
      .def_readwrite("stress", &NativeEngine::stress)
      .def(
          "start_trace",
          [](NativeEngine& e, const std::string& path, const std::string& cost_model) {
            std::lock_guard<std::recursive_mutex> g(e.mu);
            e.trace =
                std::make_unique<Trace>(path, e.core.heuristic, e.core.budget, cost_model, e.stress,
                                        e.core.search_sample, e.seed, e.core.min_evict_bytes);
          },
          py::arg("path"), py::arg("cost_model"))
      .def_property(
          "thrash", [](NativeEngine& e) { return e.core.thrash; },
          [](NativeEngine& e, double f) { e.core.thrash = f; })
      .def_property(
          "search_sample", [](NativeEngine& e) { return e.core.search_sample; },
          [](NativeEngine& e, int64_t n) { e.core.search_sample = n; })
      .def("log_evictions",
           [](NativeEngine& e, bool on) {
             std::lock_guard<std::recursive_mutex> g(e.mu);
             e.core.log_evictions(on);
           })
      .def("eviction_log",
           [](NativeEngine& e) {
             std::lock_guard<std::recursive_mutex> g(e.mu);
             return e.core.eviction_log();
           })
      .def_readwrite("check_each_op", &NativeEngine::check)
      .def_readwrite("timeline_limit", &NativeEngine::timeline_limit)
      .def_property(
          "min_evict_bytes", [](NativeEngine& e) { return e.core.min_evict_bytes; },
          [](NativeEngine& e, int64_t n) { e.core.min_evict_bytes = n; })
      .def("timeline_rows",
           [](NativeEngine& e) {  // column-wise, oldest first (dtr.timeline.COLUMNS)
             std::lock_guard<std::recursive_mutex> g(e.mu);
             py::list ops, names, backward, before, resident, evictions, remats;
             for (const auto& r : e.timeline) {
               ops.append(r.ops);
               names.append(py_name(r.op.schema()));
               backward.append(r.backward);
               before.append(r.before);
               resident.append(r.resident);
               evictions.append(r.evictions);
               remats.append(r.remats);
             }
             return py::make_tuple(ops, names, backward, before, resident, evictions, remats);
           })
      .def("set_leaf_hook", [](NativeEngine& e, py::function f) { e.leaf_hook = std::move(f); })
      .def("settle_made",  // before torch.utils.swap_tensors (dtr/engines/native/undispatched_reads.py)
           [](NativeEngine& e) {
             std::lock_guard<std::recursive_mutex> g(e.mu);
             e.settle_made();
           })
      .def(
          "export",
          [](NativeEngine& e, const at::Tensor& t) {
            py::gil_scoped_release nogil;
            return export_value(e, t);
          },
          py::arg("tensor"))
      .def(
          "grad_value",
          [](NativeEngine& e, const at::Tensor& t) {
            py::gil_scoped_release nogil;
            return grad_value(e, t);
          },
          py::arg("tensor"))
      .def("end_step",
           [](NativeEngine& e) {
             py::gil_scoped_release nogil;
             end_step(e);
           })
      .def_property_readonly("open", [](NativeEngine& e) { return e.open.load(); })
      .def("stats",
           [](NativeEngine& e) {
             std::lock_guard<std::recursive_mutex> g(e.mu);
             py::dict d;
             d["ops"] = e.core.ops;
             d["evictions"] = e.core.evictions;
             d["eager_evictions"] = e.core.eager_evictions;
             d["remats"] = e.core.remats;
             d["recompute_seconds"] = e.recompute_seconds;
             d["oom_retries"] = e.oom_retries;
             auto [peak, transient] =
                 e.closing_peaks.value_or(std::make_pair(e.core.peak_bytes, e.core.max_bytes));
             d["peak_resident_bytes"] = peak;
             d["max_transient_bytes"] = transient;
             d["resident_bytes"] = e.core.resident_bytes;
             d["pinned_bytes"] = e.core.pinned_bytes();
             d["constant_bytes"] = e.core.constant_bytes();
             d["op_floor_bytes"] = e.core.op_floor_bytes;
             d["search_seconds"] = e.core.search_seconds;
             return d;
           })
      .def("reset_peak",
           [](NativeEngine& e) {
             std::lock_guard<std::recursive_mutex> g(e.mu);
             e.core.reset_peak();
           })
      .def("check", [](NativeEngine& e) {
        std::lock_guard<std::recursive_mutex> g(e.mu);
        e.core.check();
      });
  m.def("native_install", &install, py::arg("routed_ops"), py::arg("view_forms"),
        py::arg("collective_ops"));
  m.def("is_native", [](const at::Tensor& t) { return as_native(t) != nullptr; });
  // the name of the key managed tensors carry, which dtr/engines/native/key.py checks it agrees with
  m.def("native_dispatch_key", [] { return std::string(c10::toString(kKey)); });
  // A native tensor's value as a plain tensor of its own (recomputed if evicted, a READ
  // in the trace, nothing pinned): what tolist() reads in a session (dtr/engines/native/session.py)
  m.def(
      "native_read",
      [](const at::Tensor& t) {
        py::gil_scoped_release nogil;
        return value_copy(t);
      },
      py::arg("tensor"));
  // A copy of a native tensor's whole storage (recomputed if evicted, a READ in the trace,
  // nothing pinned), with the tensor's geometry: copy.deepcopy and torch.save build every
  // tensor of that storage over one copy, as eager does (dtr/copying.py)
  m.def(
      "native_read_storage",
      [](const at::Tensor& t) {
        py::gil_scoped_release nogil;
        return value_copy(t, /*whole_storage=*/true);
      },
      py::arg("tensor"));
  // `p.data = ...` on a plain tensor (dtr/data_setter.py): what reads its old value is
  // materialized and pinned first, as before an op writes it
  m.def(
      "native_plain_written",
      [](const at::Tensor& t) { on_plain(t, &NativeEngine::writes_to_plain); },
      py::arg("tensor"));
  // A plain tensor's memory handed out by address in the block (dtr/plain_exports.py)
  m.def(
      "native_plain_exported",
      [](const at::Tensor& t) { on_plain(t, &NativeEngine::plain_exported); },
      py::arg("tensor"));
  // dtr.materialize() of a native tensor: its value as a plain tensor (pinned while its
  // session is open, as NativeEngine.export), whichever session it belongs to
  m.def(
      "native_materialize",
      [](const at::Tensor& t) {
        NativeImpl* impl = as_native(t);
        if (impl == nullptr) return t;
        py::gil_scoped_release nogil;
        return impl->eng_ ? export_value(*impl->eng_, t) : plain_view(t);
      },
      py::arg("tensor"));
}

}  // namespace native
}  // namespace dtr
