// The live runtime's per-op fast path: Runtime.handle -> _run -> _record -> _settle
// (dtr/engines/subclass/runtime.py) for the common op, in one call into C++.
//
// Every op the program runs under dtr.enable() comes here first (when the session uses
// the C++ core and records no trace or timeline). Runtime.fast_route says once per op
// overload what may be served here: ops that write no argument (random ones included),
// in-place ops whose written arguments each get a new version (Invariant 4: managed,
// written once, private), detach, and ops on plain tensors only that dtr need not
// record. In-place views, meta-only ops, batch norm's hidden writes, collectives, writes
// that must pin or snapshot, values of an ended session and non-strided tensors go to
// Runtime.handle, which serves every op. Evicted inputs are rebuilt here as well (the
// driver loop and Recipe.replay). Both paths make the same core calls in the same order (the
// comments name the Python each step mirrors), so a decision never depends on which
// path ran; tests/engines/subclass/test_fastpath.py compares them, and the suite runs on
// both (the pure-Python core never takes this path).
//
// Values, Nodes, Recipes and wrappers stay Python objects shared with the Python path;
// what moves here is the interpreter's work between them: taking the call apart,
// locking, recording, draining, settling, recomputing (docs/design.md, "The per-op fast
// path").
//
// This file: the op path. fastpath_remat.cpp: the recomputation (the driver loop and
// Recipe.replay); fastpath_impl.h: the class; pyglue.h: the CPython helpers.
#include "subclass/fastpath.h"

#include <ATen/core/grad_mode.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/DynamicTypes.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <algorithm>
#include <chrono>
#include <unordered_map>
#include <utility>
#include <vector>

#include "cpu_cache.h"
#include "core/core.h"
#include "subclass/fastpath_impl.h"
#include "leaf_hooks.h"

namespace py = pybind11;

namespace dtr {
namespace fast {

const FastPath::OpInfo& FastPath::info(py::handle func) {
  auto it = ops_.find(func.ptr());
  if (it != ops_.end()) return it->second;
  OpInfo op;
  op.func = py::reinterpret_borrow<py::object>(func);  // keeps the key alive
  py::tuple route = rt_.attr(s_fast_route_)(func);
  op.facts = route[0];
  op.managed = route[1].cast<bool>();
  op.plain = route[2].cast<int64_t>();
  op.detach = route[3].cast<bool>();
  op.writes_managed = route[4].cast<bool>();
  for (py::handle w : op.facts.attr("writes")) op.writes.push_back(w.cast<int64_t>());
  op.seeded = op.facts.attr("seeded").cast<bool>();
  op.may_draw = op.facts.attr("may_draw").cast<bool>();
  op.generator = op.facts.attr("generator").cast<int64_t>();
  op.arg_index = op.facts.attr("arg_index");
  op.arg_names = op.facts.attr("arg_names");
  op.view = op.facts.attr("view").cast<bool>();
  op.plain_recipe = !op.arg_index.contains("non_blocking");
  op.name = op.facts.attr("name");
  op.op_name = op.name.cast<std::string>();
  op.nreturns = op.facts.attr("nreturns").cast<int64_t>();
  op.op = func.attr("_op");
  return ops_.emplace(func.ptr(), std::move(op)).first->second;
}

py::object FastPath::fallback(py::handle func, py::handle args, py::handle kwargs) {
  py::object kw = kwargs.is_none() ? py::dict() : py::reinterpret_borrow<py::object>(kwargs);
  return call(get(rt_, s_handle_), {func, args, kw});
}

py::object FastPath::operator()(py::handle func, py::handle args, py::handle kwargs) {
  const OpInfo& op = info(func);
  if (!PyTuple_Check(args.ptr()) || !(kwargs.is_none() || PyDict_CheckExact(kwargs.ptr())))
    return fallback(func, args, kwargs);
  PyObject* kw = kwargs.is_none() || PyDict_GET_SIZE(kwargs.ptr()) == 0 ? nullptr : kwargs.ptr();
  Held held(lock_.ptr(), s_acquire_.ptr(), s_release_.ptr());  // `with self.lock:`
  // A closed runtime, or a core the program swapped (tests wrap it): the Python path.
  int open = PyObject_IsTrue(get(rt_, s_is_open_).ptr());
  if (open < 0) throw py::error_already_set();
  if (!open || get(rt_, s_core_).ptr() != core_obj_.ptr()) return fallback(func, args, kwargs);
  // (Runtime.view_replay noted a graph hazard: the ops of a create_graph backward go to
  // handle(), which refuses them; a backward that keeps no graph is not one, such as the
  // one torch.utils.checkpoint recomputes its forward in, under grad mode)
  if (watch_graph_ && at::GradMode::is_enabled() && torch::autograd::get_current_node() &&
      torch::autograd::get_current_graph_task_keep_graph())
    return fallback(func, args, kwargs);
  flush();
  if (op.detach) {
    // _detach: a detached managed tensor shares its Ref, even while evicted.
    PyObject* t = PyTuple_GET_SIZE(args.ptr()) == 1 && kw == nullptr
                      ? PyTuple_GET_ITEM(args.ptr(), 0)
                      : nullptr;
    if (t != nullptr && PyObject_TypeCheck(t, reinterpret_cast<PyTypeObject*>(ckpt_type_.ptr()))) {
      py::object ref = get(t, s_ref_);
      if (get(ref, s_runtime_).ptr() == rt_.ptr()) return new_wrapper(ref, t);
    } else if (t != nullptr && THPVariable_Check(t)) {
      // a plain tensor (a parameter AccumulateGrad or an optimizer detaches): _detach
      // runs the op as it is
      PyObject* raw = PyObject_Call(op.op.ptr(), args.ptr(), nullptr);
      if (raw == nullptr) throw py::error_already_set();
      return py::reinterpret_steal<py::object>(raw);
    }
    return fallback(func, args, kwargs);
  }
  std::vector<Leaf> leaves;
  Scan sc = scan(op, args.ptr(), kw, leaves);
  // handle() serves an op reading volatile memory: its recipe reads a snapshot
  if (!sc.simple || (sc.volatile_arg && sc.managed)) return fallback(func, args, kwargs);
  if (sc.managed) {
    if (op.managed) return run(op, args.ptr(), kw, leaves);
    std::vector<size_t> written;
    if (op.writes_managed && versioned_writes(op, leaves, written))
      return run(op, args.ptr(), kw, leaves, written);
    return fallback(func, args, kwargs);
  }
  // Plain tensors only (handle()'s `if not managed:` branch).
  bool direct = false;
  if (op.plain == kPlainWrite) {
    // _writes_to_plain has nothing to do unless dtr knows one of the arguments.
    direct = !known(leaves);
  } else if (op.plain == kPlainRead) {
    direct = op.view || !(at::GradMode::is_enabled() && sc.requires_grad);
    if (!direct && op.managed && !sc.volatile_arg)
      return run(op, args.ptr(), kw, leaves);  // _wants_management
    if (direct && sc.requires_grad && !at::GradMode::is_enabled() && !op.view &&
        reads_call_for_hooks())
      for (const Leaf& l : leaves) {  // Runtime._hook_plain_reads (it writes nothing)
        const at::Tensor& t = THPVariable_Unpack(l.arg);
        if (t.requires_grad()) hook_leaf(l.arg, t);
      }
  }
  if (!direct) return fallback(func, args, kwargs);
  PyObject* raw = PyObject_Call(op.op.ptr(), args.ptr(), kw);
  if (raw == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(raw);
}

// _Mode.__torch_dispatch__ (dtr/engines/subclass/session.py) without its Python frame: bound to the mode
// as its instance attribute (the dispatcher requires a method of the mode), so each op
// goes straight into C++. While Dynamo's frame hook is set (a compiled function is
// running), the runtime runs behind torch._disable_dynamo, as there.
py::object FastPath::torch_dispatch(py::handle mode, py::handle func, py::handle types,
                                    py::handle args, py::handle kwargs) {
  try {
    if (frame_callback_ && !call(frame_callback_, {}).is_none()) {
      py::object kw = kwargs.is_none() ? py::dict() : py::reinterpret_borrow<py::object>(kwargs);
      return call(without_dynamo_, {rt_, func, args, kw});
    }
    return (*this)(func, args, kwargs);
  } catch (py::error_already_set& e) {
    note_raised(e.value());
    throw;
  } catch (const c10::Error& e) {  // a kernel's: pybind11 makes it a RuntimeError
    note_raised(PyExc_RuntimeError, e.what_without_backtrace());
    throw;
  } catch (const std::exception& e) {
    note_raised(PyExc_RuntimeError, e.what());
    throw;
  }
}

// errors.note_raised (dtr/errors.py): the exception leaving the mode, which TorchScript's
// interpreter reads as an empty message; the session raises it again at its end. Never
// throws: the exception in flight is the one that matters.
void FastPath::note_raised(py::handle exc) {
  try {
    py::module_::import("dtr.errors").attr("note_raised")(exc);
  } catch (...) {
  }
}

void FastPath::note_raised(PyObject* type, const char* what) {
  try {
    note_raised(py::handle(type)(py::str(what)));
  } catch (...) {
  }
}

void FastPath::throw_from(const py::object& make, py::handle name, py::handle tensor) {
  raise_exc(call(make, {name, tensor}));
}

// Whether dtr knows the storage of any plain leaf (a constant, or a value handed out).
bool FastPath::known(const std::vector<Leaf>& leaves) {
  for (const Leaf& leaf : leaves) {
    py::object key = storage_key(leaf.arg);
    for (PyObject* dict : {storages_.ptr(), escaped_.ptr()}) {
      if (PyDict_GetItemWithError(dict, key.ptr()) != nullptr) return true;
      if (PyErr_Occurred()) throw py::error_already_set();
    }
  }
  return false;
}

// Whether a tensor's storage key is in one of the runtime's dicts keyed by storage.
bool FastPath::keyed_in(const py::object& dict, PyObject* tensor) {
  if (PyDict_GET_SIZE(dict.ptr()) == 0) return false;
  py::object key = storage_key(tensor);
  if (PyDict_GetItemWithError(dict.ptr(), key.ptr()) != nullptr) return true;
  if (PyErr_Occurred()) throw py::error_already_set();
  return false;
}

// Whether a tensor's storage is a managed value's handed out plain (Runtime.escaped).
bool FastPath::escaped(PyObject* tensor) { return keyed_in(escaped_, tensor); }

// Whether a plain tensor's storage was handed out by address in the block
// (Runtime.exported_plain; a dead storage's key only sends the op to handle()).
bool FastPath::exported_plain(PyObject* tensor) { return keyed_in(exported_plain_, tensor); }

// Runtime._flush: release the handles dropped since the last op (Invariant 5).
void FastPath::flush() {
  while (true) {
    py::object refs = get(rt_, s_pending_);
    if (PyList_GET_SIZE(refs.ptr()) == 0) return;
    set(rt_, s_pending_, py::list());
    const Py_ssize_t n = PyList_GET_SIZE(refs.ptr());
    for (Py_ssize_t k = 0; k < n; ++k) {
      try {
        int64_t tid = get(PyList_GET_ITEM(refs.ptr(), k), s_tid_).cast<int64_t>();
        if (tid >= 0) core_->release(tid);
      } catch (...) {
        // The handles after this one stay pending, or their tensors and lineage would
        // be held for good (Runtime._flush).
        py::object rest = py::reinterpret_steal<py::object>(PyList_GetSlice(refs.ptr(), k + 1, n));
        py::object now = get(rt_, s_pending_);
        if (!rest || PyList_SetSlice(now.ptr(), 0, 0, rest.ptr()) < 0) PyErr_Clear();
        throw;
      }
    }
    drain();
  }
}

void FastPath::set_item(const py::object& list, int64_t index, py::handle value) {
  PyObject* l = list.ptr();
  while (PyList_GET_SIZE(l) <= index)
    if (PyList_Append(l, Py_None) < 0) throw py::error_already_set();
  Py_INCREF(value.ptr());
  PyList_SetItem(l, index, value.ptr());  // steals the reference, drops the old item
}

// Runtime.drain: mirror the core (drop the values it evicted, forget what it dropped).
void FastPath::drain() {
  auto [evicted, dropped, dropped_recipes] = core_->drain();
  PyObject* nodes = nodes_.ptr();
  py::none none;
  auto node_at = [&](int64_t t) -> py::object {
    if (t < 0 || t >= PyList_GET_SIZE(nodes)) return py::none();
    return py::reinterpret_borrow<py::object>(PyList_GET_ITEM(nodes, t));
  };
  for (int64_t t : evicted) {
    py::object node = node_at(t);
    if (!node.is_none()) set(node, s_value_, none);
  }
  py::int_ minus_one(-1);
  for (int64_t t : dropped) {
    py::object node = node_at(t);
    if (!node.is_none()) {
      set(node, s_value_, none);
      set(node, s_tid_, minus_one);
      set_item(nodes_, t, none);
    }
    py::int_ tid(t);
    py::object key = dict_pop(const_keys_.ptr(), tid.ptr());
    if (!key.is_none() && (PyDict_DelItem(storages_.ptr(), key.ptr()) < 0 ||
                           PyDict_DelItem(const_storages_.ptr(), tid.ptr()) < 0))
      throw py::error_already_set();
    key = dict_pop(escaped_keys_.ptr(), tid.ptr());
    if (!key.is_none()) {
      PyObject* held = PyDict_GetItemWithError(escaped_.ptr(), key.ptr());
      if (held == nullptr && PyErr_Occurred()) throw py::error_already_set();
      if (held != nullptr && held == node.ptr() && PyDict_DelItem(escaped_.ptr(), key.ptr()) < 0)
        throw py::error_already_set();
    }
  }
  if (!dropped_recipes.empty()) {
    py::object recipes = get(rt_, s_recipes_);
    for (int64_t r : dropped_recipes) set_item(recipes, r, none);
  }
}

void FastPath::budget_error(const std::vector<int64_t>& fresh, const OpInfo& op, bool fits) {
  drain();
  int64_t requested = 0;  // its fresh outputs, or all it needed at once (Runtime._settle)
  for (int64_t tid : fresh) requested += core_->pool_bytes(tid);
  if (!fits) requested = core_->last_need - core_->constant_bytes();
  py::object what = py::str("running {}").format(op.func);
  raise_exc(rt_.attr(s_budget_error_)(requested, what));
}

FastPath::Scan FastPath::scan(const OpInfo& op, PyObject* args, PyObject* kwargs,
                              std::vector<Leaf>& leaves) {
  Scan sc;
  PyObject* arg_index = op.arg_index.ptr();
  PyTypeObject* ckpt = reinterpret_cast<PyTypeObject*>(ckpt_type_.ptr());
  walk(args, kwargs, [&](PyObject* a, PyObject* key, Py_ssize_t index, Py_ssize_t j) {
    if (!sc.simple) return;
    int64_t position = index;
    if (key != nullptr) {
      PyObject* at = PyDict_GetItemWithError(arg_index, key);
      if (at == nullptr) {
        if (PyErr_Occurred()) throw py::error_already_set();
        sc.simple = false;  // an argument the schema does not name: the op will say
        return;
      }
      position = PyLong_AsLongLong(at);
    }
    Leaf leaf{a, py::object(), py::object(), key, index, j, -1, position};
    if (PyObject_TypeCheck(a, ckpt)) {
      py::object ref = get(a, s_ref_);
      if (get(ref, s_runtime_).ptr() != rt_.ptr()) {
        sc.simple = false;  // a wrapper of an ended session
        return;
      }
      leaf.node = get(ref, s_node_);
      leaf.value = get(leaf.node, s_value_);  // None while evicted: rebuilt in run()
      leaf.tid = get(leaf.node, s_tid_).cast<int64_t>();
      sc.managed = true;
      // (an evicted value was never handed out: that pins its pool)
      if (!leaf.value.is_none() && escaped(leaf.value.ptr())) sc.volatile_arg = true;
    } else {
      // another subclass (a FakeTensor under torch.export's tracing) goes to handle()
      if (Py_TYPE(a) != reinterpret_cast<PyTypeObject*>(THPVariableClass) &&
          Py_TYPE(a) != reinterpret_cast<PyTypeObject*>(parameter_type_.ptr())) {
        sc.simple = false;
        return;
      }
      const at::Tensor& t = THPVariable_Unpack(a);
      if (t.layout() != c10::kStrided || !t.has_storage() || t.is_meta()) {
        sc.simple = false;
        return;
      }
      sc.requires_grad = sc.requires_grad || t.requires_grad();
      if (!t.storage().resizable() || escaped(a) || exported_plain(a)) sc.volatile_arg = true;
      leaf.value = py::reinterpret_borrow<py::object>(a);  // a constant: tid found in run
    }
    leaves.push_back(std::move(leaf));
  });
  return sc;
}

// _prepare_writes for a call whose written arguments may all get a new version: each is
// managed, written once, and private (the only member of its storage the program holds,
// every member recomputable). Fills `written` (leaf indices, in leaf order); false when
// handle() must serve the call (it pins aliased values and snapshots arguments).
bool FastPath::versioned_writes(const OpInfo& op, const std::vector<Leaf>& leaves,
                                std::vector<size_t>& written) {
  for (size_t k = 0; k < leaves.size(); ++k)
    for (int64_t w : op.writes)
      if (leaves[k].position == w) {
        written.push_back(k);
        break;
      }
  for (size_t k : written) {
    if (!leaves[k].node) return false;  // a plain tensor written: _writes_to_plain_leaf
    for (size_t j : written)
      if (j != k && leaves[j].node.ptr() == leaves[k].node.ptr()) return false;
    if (!core_->is_private(leaves[k].tid)) return false;
  }
  return !written.empty();
}

// Runtime._run, _record and _settle for a call that scan() found simple; `written`:
// the leaves it writes, each to get a new version (see versioned_writes).
py::object FastPath::run(const OpInfo& op, PyObject* args, PyObject* kwargs,
                         std::vector<Leaf>& leaves, const std::vector<size_t>& written) {
  Core& core = *core_;
  // ---- Runtime._run
  const size_t n = leaves.size();
  Locks locks(core);
  // The op raised: the constants registered for it may be gone from the core now.
  // Mirror that before the program goes on, or a new tensor whose storage lands at a
  // dead one's address would be taken for it (Runtime._run's `finally`).
  OnUnwind mirror{[&] {
    locks.unlock_all();
    drain();
  }};
  for (Leaf& leaf : leaves)
    if (!leaf.node) leaf.tid = constant(leaf.arg, locks.fresh);
  py::object size_key;
  int64_t reserve = 0;
  if (core.budget >= 0) {
    py::list leaf_list(n);
    for (size_t k = 0; k < n; ++k) leaf_list[k] = py::handle(leaves[k].arg);
    py::tuple predicted = sizes_.attr(s_predict_)(op.func, leaf_list);
    size_key = predicted[0];
    reserve = predicted[1].cast<int64_t>();
  }
  for (const Leaf& leaf : leaves)
    if (leaf.node) locks.lock(leaf.tid);
  for (Leaf& leaf : leaves) {  // Runtime._value: rematerialize what is evicted
    if (!leaf.node || !leaf.value.is_none()) continue;
    leaf.value = get(leaf.node, s_value_);  // (rebuilt already if it is an earlier leaf)
    if (!leaf.value.is_none()) continue;
    rematerialize(leaf.tid);
    leaf.value = get(leaf.node, s_value_);
    if (leaf.value.is_none())  // (it raises the InternalError that says so)
      leaf.value = call(get(rt_, s_value_fn_), {leaf.node});
  }
  if (reserve != 0 && 0 <= core.budget && core.budget < core.resident_bytes + reserve) {
    core.make_room(reserve);  // room for the outputs (dtr/engines/subclass/kernel_peaks.py)
    drain();
  }
  std::vector<int64_t> extra;  // core inputs beyond the leaves: the captured RNG state
  py::object captured = py::none();
  if (op.seeded || op.may_draw) {
    // TensorArgs.argument(facts, facts.generator), then rng.capture(gen, _device_of(leaves))
    py::object gen = py::none();
    if (op.generator >= 0) {
      if (op.generator < PyTuple_GET_SIZE(args)) {
        gen = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(args, op.generator));
      } else if (kwargs != nullptr) {
        PyObject* name = PyTuple_GET_ITEM(op.arg_names.ptr(), op.generator);
        PyObject* g = PyDict_GetItemWithError(kwargs, name);
        if (g == nullptr && PyErr_Occurred()) throw py::error_already_set();
        if (g != nullptr) gen = py::reinterpret_borrow<py::object>(g);
      }
    }
    captured = call(capture_, {gen, get(py::handle(leaves[0].arg), s_device_)});
    // The saved generator state is memory the recipe holds: count it.
    if (op.seeded) extra.push_back(constant(PyTuple_GET_ITEM(captured.ptr(), 1), locks.fresh));
  }
  std::vector<PyObject*> vals(n);
  for (size_t k = 0; k < n; ++k) vals[k] = leaves[k].value.ptr();
  auto [real_args, real_kwargs] = substitute(args, kwargs, vals);
  const int64_t in_use = size_key ? cpu_cache::window_mark() : -1;
  auto start = std::chrono::steady_clock::now();
  PyObject* raw = PyObject_Call(op.op.ptr(), real_args.ptr(), real_kwargs.ptr());
  py::object out;
  if (raw != nullptr) {
    out = py::reinterpret_steal<py::object>(raw);
  } else {
    py::error_already_set exc;
    if (!exc.matches(oom_type_)) throw exc;
    out = call(get(rt_, s_retry_), {exc.value(), op.func, real_args, real_kwargs,
                                    py::bool_(written.empty()), captured});
  }
  double cost = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (op.may_draw) {  // kept as a random op's only if it drew (Runtime._run)
    if (call(drew_, {captured}).cast<bool>())
      extra.push_back(constant(PyTuple_GET_ITEM(captured.ptr(), 1), locks.fresh));
    else
      captured = py::none();
  }
  // the kernel's outputs and own buffers (cpu_cache's meter), as in the native engine
  const int64_t kernel_peak = in_use < 0 ? -1 : cpu_cache::window_peak() - in_use;

  // ---- Runtime._record: the op's tensors, as returns_of lists them
  std::vector<Out> outs;
  auto add_returned = [&](int64_t i, PyObject* r) {
    if (THPVariable_Check(r)) {
      outs.push_back({i, -1, r, py::object()});
    } else if (is_seq(r)) {
      Py_ssize_t m = PySequence_Fast_GET_SIZE(r);
      PyObject** items = PySequence_Fast_ITEMS(r);
      for (Py_ssize_t j = 0; j < m; ++j)
        if (THPVariable_Check(items[j])) outs.push_back({i, j, items[j], py::object()});
    }
  };
  bool first_cpu = true;  // _first_cpu(out)
  if (op.nreturns == 1) {
    add_returned(0, out.ptr());
  } else if (!out.is_none()) {
    py::tuple rets = py::reinterpret_borrow<py::object>(out);
    for (size_t i = 0; i < rets.size(); ++i) add_returned(i, rets[i].ptr());
  }
  if (THPVariable_Check(out.ptr())) {
    first_cpu = THPVariable_Unpack(out.ptr()).is_cpu();
  } else if (PyList_Check(out.ptr()) || PyTuple_Check(out.ptr())) {
    Py_ssize_t m = PySequence_Fast_GET_SIZE(out.ptr());
    PyObject** items = PySequence_Fast_ITEMS(out.ptr());
    for (Py_ssize_t j = 0; j < m; ++j)
      if (THPVariable_Check(items[j])) {
        first_cpu = THPVariable_Unpack(items[j]).is_cpu();
        break;
      }
  }
  if (model_cost_ || !(THPVariable_Unpack(vals[0]).is_cpu() && first_cpu))
    cost = call(roofline_, {op.func, real_args, real_kwargs, out}).cast<double>();

  // The recorded outputs: new versions of the written arguments first, then the fresh
  // tensors it returned, each with its spec (dtr/engines/subclass/recipe.py) and value.
  std::vector<int64_t> kinds, refs, nbytes;
  std::vector<std::pair<int64_t, int64_t>> specs_of;
  std::vector<PyObject*> produced;
  std::vector<Out*> out_of;  // the Out a recorded output came from; null for a version
  // fresh storages of the outputs so far, with their index in kinds (cuDNN returns an
  // RNN's weight gradients as views of one buffer: later ones are views of the first)
  std::vector<std::pair<c10::StorageImpl*, int64_t>> fresh;
  for (size_t k : written) {
    kinds.push_back(kVersion);
    refs.push_back(leaves[k].tid);
    nbytes.push_back(0);
    specs_of.emplace_back(-1, static_cast<int64_t>(k));  // (VERSION_SPEC, leaf)
    produced.push_back(vals[k]);
    out_of.push_back(nullptr);
  }
  for (Out& o : outs) {
    int64_t same = -1;  // _identity: an in-place op returned its argument
    for (size_t k : written)
      if (vals[k] == o.tensor) {
        same = static_cast<int64_t>(k);
        break;
      }
    if (same >= 0) {
      o.wrapper = py::reinterpret_borrow<py::object>(leaves[same].arg);
      continue;
    }
    const at::Tensor& t = THPVariable_Unpack(o.tensor);
    if (t.layout() != c10::kStrided) continue;  // a sparse result stays plain
    c10::StorageImpl* storage = t.storage().unsafeGetStorageImpl();
    int64_t src = -1;  // the last input sharing its storage, as the dict in _record
    for (size_t k = n; k-- > 0;)
      if (THPVariable_Unpack(vals[k]).storage().unsafeGetStorageImpl() == storage) {
        src = static_cast<int64_t>(k);
        break;
      }
    int64_t earlier = -1;
    if (src < 0)
      for (const auto& f : fresh)
        if (f.first == storage) earlier = f.second;
    if (src >= 0) {
      if (!leaves[src].node) continue;  // a view of a constant stays plain
      kinds.push_back(kView);
      refs.push_back(leaves[src].tid);
      nbytes.push_back(0);
    } else if (earlier >= 0) {
      kinds.push_back(kView);
      refs.push_back(-(earlier + 1));
      nbytes.push_back(0);
    } else {
      fresh.emplace_back(storage, static_cast<int64_t>(kinds.size()));
      kinds.push_back(kNew);
      refs.push_back(-1);
      nbytes.push_back(static_cast<int64_t>(t.storage().nbytes()));
    }
    specs_of.emplace_back(o.i, o.j);
    produced.push_back(o.tensor);
    out_of.push_back(&o);
  }
  if (size_key) {
    int64_t total = 0;
    for (int64_t b : nbytes) total += b;
    sizes_.attr(s_learn_)(size_key, std::max(total, kernel_peak));
  }
  std::vector<int64_t> protect;  // the fresh outputs (not versions), kept while settling
  if (!kinds.empty()) {
    std::vector<int64_t> inputs(n);
    for (size_t k = 0; k < n; ++k) inputs[k] = leaves[k].tid;
    inputs.insert(inputs.end(), extra.begin(), extra.end());
    std::vector<int64_t> out_tids =
        core.record(inputs, cost, kinds, refs, nbytes, op.op_name);
    std::vector<PyObject*> nones(n, Py_None);
    auto [t_args, t_kwargs] = substitute(args, kwargs, nones);
    py::list where(n), rec_inputs(n), specs(kinds.size());
    for (size_t k = 0; k < n; ++k) {
      // TensorArgs.where: (index in args or kwarg name, list index or -1)
      const Leaf& leaf = leaves[k];
      py::object name = leaf.key != nullptr ? py::reinterpret_borrow<py::object>(leaf.key)
                                            : py::object(py::int_(leaf.index));
      where[k] = py::make_tuple(name, leaf.j);
      rec_inputs[k] = leaves[k].node ? leaves[k].node : leaves[k].value;
    }
    for (size_t q = 0; q < kinds.size(); ++q)
      specs[q] = py::make_tuple(specs_of[q].first, specs_of[q].second);
    py::tuple clone(written.size());
    for (size_t w = 0; w < written.size(); ++w) clone[w] = py::int_(written[w]);
    py::object rec =
        new_recipe(op, t_args, t_kwargs, where, rec_inputs, clone, specs, captured, leaves);
    py::object rec_outputs = get(rec, s_outputs_);
    for (size_t q = 0; q < kinds.size(); ++q) {
      py::handle value(produced[q]);
      py::int_ tid(out_tids[q]);
      py::object node = new_node(tid, value, op.name, get(value, s_shape_));
      set_item(nodes_, out_tids[q], node);
      if (PyList_Append(rec_outputs.ptr(), node.ptr()) < 0) throw py::error_already_set();
      if (kinds[q] == kVersion) {
        // the program's handle moves to the new version
        set(get(py::handle(leaves[specs_of[q].second].arg), s_ref_), s_node_, node);
      } else {
        protect.push_back(out_tids[q]);
        out_of[q]->wrapper = new_wrapper(new_ref(node), value);
      }
    }
    set_item(get(rt_, s_recipes_), core.recipe_of(out_tids[0]), rec);
    drain();
  }

  // rebuild_returns: the op's result with the managed tensors swapped for wrappers
  auto replacement = [&](int64_t i, int64_t j, PyObject* x) -> PyObject* {
    for (const Out& o : outs)
      if (o.i == i && o.j == j && o.wrapper) return o.wrapper.ptr();
    return x;
  };
  auto rebuild_seq = [&](int64_t i, PyObject* r) -> py::object {
    Py_ssize_t m = PySequence_Fast_GET_SIZE(r);
    PyObject** items = PySequence_Fast_ITEMS(r);
    std::vector<PyObject*> swapped;  // one per tensor item, as substitute_item takes them
    for (Py_ssize_t j = 0; j < m; ++j)
      if (THPVariable_Check(items[j])) swapped.push_back(replacement(i, j, items[j]));
    size_t k = 0;
    return py::reinterpret_steal<py::object>(substitute_item(r, swapped, k));
  };
  bool swapped = false;
  for (const Out& o : outs) swapped = swapped || static_cast<bool>(o.wrapper);
  py::object result;
  if (!swapped) {  // nothing to swap (plain results, or an op returning nothing)
    result = out;
  } else if (op.nreturns == 1) {
    if (THPVariable_Check(out.ptr())) {
      result = py::reinterpret_borrow<py::object>(replacement(0, -1, out.ptr()));
    } else if (is_seq(out.ptr())) {
      result = rebuild_seq(0, out.ptr());
    } else {
      result = out;
    }
  } else {
    py::tuple rets = py::reinterpret_borrow<py::object>(out);
    py::list items(rets.size());
    for (size_t i = 0; i < rets.size(); ++i) {
      PyObject* r = rets[i].ptr();
      if (THPVariable_Check(r)) {
        items[i] = py::handle(replacement(i, -1, r));
      } else if (is_seq(r)) {
        items[i] = rebuild_seq(i, r);
      } else {
        items[i] = py::handle(r);
      }
    }
    result = PyTuple_CheckExact(out.ptr()) ? py::object(py::tuple(items))
                                           : call(py::type::of(out), {items});
  }
  locks.unlock_all();  // the `finally` of Runtime._run
  settle(protect, op);
  return result;
}

// Runtime._constant: the core tensor of a plain tensor an op reads (one per storage); a
// new one is held for the op in flight (listed in fresh) until its recipe is recorded.
int64_t FastPath::constant(PyObject* arg, std::vector<int64_t>& fresh) {
  const at::Tensor& t = THPVariable_Unpack(arg);
  py::object key = storage_key(arg);
  PyObject* known = PyDict_GetItemWithError(storages_.ptr(), key.ptr());
  if (known != nullptr) {
    // Read before hook_leaf runs Python, which could drop the borrowed item.
    int64_t tid = PyLong_AsLongLong(known);
    // Another tensor of a known storage (cuDNN's RNN weights are views of one buffer):
    // gradient hooks are per tensor.
    if (t.requires_grad() && reads_call_for_hooks()) hook_leaf(arg, t);
    return tid;
  }
  if (PyErr_Occurred()) throw py::error_already_set();
  int64_t nbytes = static_cast<int64_t>(t.storage().nbytes());
  int64_t tid = core_->new_constant(nbytes);
  fresh.push_back(tid);  // at once: released by the caller's Locks whatever fails below
  py::handle value(arg);
  py::int_ id(tid);
  set_item(nodes_, tid, new_node(id, py::none(), s_constant_, get(value, s_shape_)));
  // Runtime.const_storages: the storage, kept alive while the constant lives
  py::object storage = py::reinterpret_steal<py::object>(torch::createPyObject(t.storage()));
  if (!storage || PyDict_SetItem(storages_.ptr(), key.ptr(), id.ptr()) < 0 ||
      PyDict_SetItem(const_keys_.ptr(), id.ptr(), key.ptr()) < 0 ||
      PyDict_SetItem(const_storages_.ptr(), id.ptr(), storage.ptr()) < 0)
    throw py::error_already_set();
  if (t.requires_grad() && reads_call_for_hooks()) hook_leaf(arg, t);
  return tid;
}

// Runtime._hook_leaf(t), called only when the leaf a read of t calls for (leaf_to_hook)
// is not hooked already (the common case for parameters read again and again: dict
// lookups, no Python call): LeafHooks.hooked.
void FastPath::hook_leaf(PyObject* arg, const at::Tensor& t) {
  const at::Tensor leaf = leaf_to_hook(t);
  if (!leaf.defined()) return;
  py::object leaf_obj = leaf.unsafeGetTensorImpl() == t.unsafeGetTensorImpl()
                            ? py::reinterpret_borrow<py::object>(arg)
                            : py::reinterpret_steal<py::object>(THPVariable_Wrap(leaf));
  if (!leaf_obj) throw py::error_already_set();
  if (PyDict_GET_SIZE(leaf_handles_.ptr()) > 0) {
    py::object key =
        py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(leaf.unsafeGetTensorImpl()));
    if (!key) throw py::error_already_set();
    PyObject* handle = PyDict_GetItemWithError(leaf_handles_.ptr(), key.ptr());
    if (handle == nullptr && PyErr_Occurred()) throw py::error_already_set();
    if (handle != nullptr) {
      py::object ref = get(py::handle(handle), s_hooks_dict_ref_);
      py::object hooks = py::reinterpret_steal<py::object>(PyObject_CallNoArgs(ref.ptr()));
      if (!hooks) throw py::error_already_set();
      py::object own = get(leaf_obj, s_post_hooks_);
      if (!hooks.is_none() && hooks.ptr() == own.ptr()) return;
    }
  }
  rt_.attr(s_hook_leaf_)(leaf_obj);
}

// CheckpointTensor(ref, like) (dtr/engines/subclass/tensor.py), without the Python frames: a wrapper with
// like's sizes, strides, offset, dtype, device, layout and conjugate/negative bits.
py::object FastPath::new_wrapper(py::handle ref, py::handle like) {
  const at::Tensor& t = THPVariable_Unpack(like.ptr());
  const int64_t dim = t.dim();
  py::tuple sizes(dim), strides(dim);
  for (int64_t d = 0; d < dim; ++d) {
    sizes[d] = py::int_(t.sizes()[d]);
    strides[d] = py::int_(t.strides()[d]);
  }
  py::int_ offset(t.storage_offset());
  py::handle dtype(reinterpret_cast<PyObject*>(torch::getTHPDtype(t.scalar_type())));
  py::object device = py::reinterpret_steal<py::object>(THPDevice_New(t.device()));
  py::handle layout(reinterpret_cast<PyObject*>(torch::getTHPLayout(t.layout())));
  PyObject* argv[] = {ckpt_type_.ptr(), sizes.ptr(),  strides.ptr(), offset.ptr(),
                      dtype.ptr(),      device.ptr(), layout.ptr(),  Py_False};
  PyObject* raw = PyObject_Vectorcall(make_wrapper_.ptr(), argv, 2, wrapper_kwnames_.ptr());
  if (raw == nullptr) throw py::error_already_set();
  py::object w = py::reinterpret_steal<py::object>(raw);
  if (t.is_conj()) call(set_conj_, {w, py::bool_(true)});
  if (t.is_neg()) call(set_neg_, {w, py::bool_(true)});
  set(w, s_ref_, ref);
  return w;
}

// Node(tid, value, name, shape) and Ref(node, runtime) (dtr/engines/subclass/tensor.py), without their
// __init__ frames (change both).
py::object FastPath::new_node(py::handle tid, py::handle value, py::handle name, py::handle shape) {
  py::object node = call(object_new_, {node_type_});
  set(node, s_tid_, tid);
  set(node, s_value_, value);
  set(node, s_name_, name);
  set(node, s_shape_, shape);
  PyObject* serial = PyIter_Next(serials_.ptr());  // next(_serials)
  if (serial == nullptr) throw py::error_already_set();
  set(node, s_serial_, py::reinterpret_steal<py::object>(serial));
  return node;
}

py::object FastPath::new_ref(py::handle node) {
  py::object ref = call(object_new_, {ref_type_});
  set(ref, s_node_, node);
  set(ref, s_runtime_, rt_);
  return ref;
}

// Recipe(func, facts, args, kwargs, where, inputs, clone, specs, captured, grad)
// (dtr/engines/subclass/recipe.py). For an op that writes no argument and draws no random numbers, when
// its __init__ would change nothing (no non_blocking argument), the slots are filled
// here directly.
py::object FastPath::new_recipe(const OpInfo& op, const py::object& args, const py::object& kwargs,
                                const py::list& where, const py::list& inputs,
                                const py::tuple& clone, const py::list& specs,
                                const py::object& captured, const std::vector<Leaf>& leaves) {
  py::bool_ grad(at::GradMode::is_enabled());
  if (!op.plain_recipe || clone.size() > 0 || !captured.is_none())
    return call(recipe_type_,
                {op.func, op.facts, args, kwargs, where, inputs, clone, specs, captured, grad});
  py::object rec = call(object_new_, {recipe_type_});
  set(rec, s_func_, op.func);
  set(rec, s_facts_, op.facts);
  set(rec, s_args_, args);
  set(rec, s_kwargs_, kwargs);
  set(rec, s_where_, where);
  set(rec, s_inputs_, inputs);
  set(rec, s_clone_, py::tuple());
  set(rec, s_specs_, specs);
  set(rec, s_rng_, py::none());
  set(rec, s_grad_, grad);
  set(rec, s_outputs_, py::list());
  // versions: (leaf, version or -1, storage key) of each plain tensor it reads, as
  // Recipe.__init__ says
  py::list versions;
  for (size_t k = 0; k < leaves.size(); ++k) {
    if (leaves[k].node) continue;
    const at::Tensor& t = THPVariable_Unpack(leaves[k].value.ptr());
    int64_t version = t.is_inference() ? -1 : static_cast<int64_t>(t._version());
    versions.append(py::make_tuple(k, version, storage_key(leaves[k].value.ptr())));
  }
  set(rec, s_versions_, py::tuple(versions));
  return rec;
}

// Runtime._settle: evict until the budget holds, the op's fresh outputs protected.
void FastPath::settle(const std::vector<int64_t>& fresh, const OpInfo& op) {
  Core& core = *core_;
  if (metered_) rt_.attr(s_measure_device_)();  // one read of the allocator's count
  {
    Locks held(core);
    for (int64_t tid : fresh) held.lock(tid);
    bool ok = core.make_room(0);
    held.unlock_all();
    const bool fits = core.op_fits();  // the op needed no more than the budget at once
    if (!ok || !fits) budget_error(fresh, op, fits);
  }
  if (stress_) core.evict_all();
  drain();
  if (check_) {
    core.check();
    rt_.attr(s_check_mirror_)();
  }
}

}  // namespace fast

void bind_fastpath(py::module_& m) {
  m.def("graph_kept", &torch::autograd::get_current_graph_task_keep_graph,
        "Whether the backward running on this thread keeps its graph (retain_graph, "
        "create_graph's default); true outside a backward.");
  py::class_<fast::FastPath>(m, "FastPath",
                             "The live runtime's per-op fast path (csrc/subclass/fastpath.cpp); call it as "
                             "the runtime's handle(func, args, kwargs).")
      .def(py::init<py::object, py::object, bool, bool, bool, bool>(), py::arg("runtime"),
           py::arg("types"), py::arg("stress"), py::arg("check"), py::arg("model_cost"),
           py::arg("metered") = false)
      .def("__call__", &fast::FastPath::operator(), py::arg("func"), py::arg("args"),
           py::arg("kwargs") = py::none())
      .def("torch_dispatch", &fast::FastPath::torch_dispatch, py::arg("mode"), py::arg("func"),
           py::arg("types"), py::arg("args") = py::tuple(), py::arg("kwargs") = py::none(),
           "_Mode.__torch_dispatch__ in C++, to be bound to the mode (types.MethodType); "
           "set_mode_hooks first.")
      .def("set_mode_hooks", &fast::FastPath::set_mode_hooks, py::arg("frame_callback"),
           py::arg("without_dynamo"))
      .def("watch_graph", &fast::FastPath::watch_graph,
           "Send the ops of a create_graph backward to handle() from now on.")
      .def("rematerialize", &fast::FastPath::rematerialize_if_own, py::arg("tid"),
           "Runtime.rematerialize in C++; False (nothing done) when the runtime's core is "
           "not the one this fast path was made with.");
}

}  // namespace dtr