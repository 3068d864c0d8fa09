// The fast path's recomputation: Runtime.rematerialize (the driver loop of
// dtr/core/rebuild.py), Runtime.rerun and Recipe.replay (dtr/engines/subclass/recipe.py) in C++, so that with
// the C++ core every recomputation, from the op path or from Runtime.rematerialize, is
// made here. The comments name the Python each step mirrors;
// tests/engines/subclass/test_fastpath.py checks that both make the same core calls.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <chrono>
#include <optional>
#include <vector>

#include "subclass/fastpath_impl.h"
#include "core/rebuild.h"

namespace dtr {
namespace fast {

// Runtime.rematerialize (Rebuilder.rematerialize in dtr/core/rebuild.py): rerun the recipes
// that rebuild tid, in the order the core schedules them. The caller holds tid locked.
void FastPath::rematerialize(int64_t tid) {
  Core& core = *core_;
  py::none none;
  set(rt_, s_stealing_, none);
  try {
    dtr::rematerialize(
        core, tid,
        [&](int64_t rid) {
          std::vector<int64_t> stolen = core.steals(rid);
          std::vector<int64_t> nbytes = rerun(rid, stolen);
          core.remat_done(rid, nbytes, stolen);
          if (!stolen.empty()) set(rt_, s_stealing_, none);  // the core knows: nothing to undo
        },
        [&](int64_t rid, int64_t need) { raise_exc(rt_.attr(s_out_of_budget_)(rid, need)); },
        [&] { drain(); });
  } catch (...) {
    // A rerun that wrote into the storage of the version it updates was interrupted
    // before remat_done (Runtime._after_interrupted_steal says what that needs).
    if (!get(rt_, s_stealing_).is_none()) rt_.attr(s_after_steal_)();
    throw;
  }
}

// Runtime.rerun: rerun recipe rid and give its outputs their values; returns the
// storage size of each. stolen: its outputs computed in their old version's storage.
std::vector<int64_t> FastPath::rerun(int64_t rid, const std::vector<int64_t>& stolen) {
  PyObject* item = PyList_GetItem(get(rt_, s_recipes_).ptr(), static_cast<Py_ssize_t>(rid));
  if (item == nullptr) throw py::error_already_set();
  py::object rec = py::reinterpret_borrow<py::object>(item);
  if (!stolen.empty()) {  // what Runtime._after_interrupted_steal needs to know
    py::list stolen_list(stolen.size());
    for (size_t k = 0; k < stolen.size(); ++k) stolen_list[k] = py::int_(stolen[k]);
    set(rt_, s_stealing_, py::make_tuple(rec, stolen_list));
  }
  auto start = std::chrono::steady_clock::now();
  py::object values = replay(rec, stolen);
  double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  double total = get(rt_, s_recompute_seconds_).cast<double>() + seconds;
  set(rt_, s_recompute_seconds_, py::float_(total));
  std::vector<int64_t> nbytes;
  py::object outputs = get(rec, s_outputs_);
  Py_ssize_t m = PyList_GET_SIZE(values.ptr());
  for (Py_ssize_t q = 0; q < m && q < PyList_GET_SIZE(outputs.ptr()); ++q) {
    py::handle node(PyList_GET_ITEM(outputs.ptr(), q));
    PyObject* value = PyList_GET_ITEM(values.ptr(), q);
    if (get(node, s_tid_).cast<int64_t>() >= 0 && get(node, s_value_).is_none())
      set(node, s_value_, value);
    nbytes.push_back(static_cast<int64_t>(THPVariable_Unpack(value).storage().nbytes()));
  }
  return nbytes;
}

// A warning handler that drops what it is given.
struct DropWarnings : c10::WarningHandler {
  void process(const c10::Warning&) override {}
};

// dtr/engines/subclass/recipe.py's Quiet, around the replay of an out= op (it would warn again of a
// resize), and a C++ handler that drops warnings too: in backward, autograd's worker
// thread keeps warnings for its caller rather than giving them to Python's filters.
struct Quiet {
  py::object quiet;
  DropWarnings drop;
  std::optional<c10::WarningUtils::WarningHandlerGuard> guard;
  explicit Quiet(const py::object& facts) {
    if (!facts.attr("out_form").cast<bool>()) return;
    guard.emplace(&drop);
    quiet = py::module_::import("dtr.engines.subclass.recipe").attr("Quiet")();
    quiet.attr("__enter__")();
  }
  ~Quiet() {
    if (quiet) call_keeping_error(quiet.ptr(), intern("close").ptr(), nullptr);
  }
};

// Recipe.replay (dtr/engines/subclass/recipe.py): run the op again on its inputs' current values (a
// stand-in's meta tensor, a copy of an argument it writes unless its output is computed
// in place, the RNG state it first drew from); the values of its outputs, in core
// order. The inputs are materialized and locked.
py::object FastPath::replay(const py::object& rec, const std::vector<int64_t>& stolen) {
  py::object inputs = get(rec, s_inputs_);
  const Py_ssize_t n = PyList_GET_SIZE(inputs.ptr());
  std::vector<py::object> vals(n);
  PyTypeObject* stand_in = reinterpret_cast<PyTypeObject*>(stand_in_type_.ptr());
  PyTypeObject* rebuilt = reinterpret_cast<PyTypeObject*>(rebuilt_type_.ptr());
  bool sparse = false;  // it reads a sparse constant (dtr/engines/subclass/recipe.py, sparse_kernels)
  for (Py_ssize_t k = 0; k < n; ++k) {
    py::handle x(PyList_GET_ITEM(inputs.ptr(), k));
    if (THPVariable_Check(x.ptr())) {
      const at::Tensor& t = THPVariable_Unpack(x.ptr());
      sparse = sparse || t.layout() != c10::kStrided;
      // freed outside dtr's view (a sparse constant: dtr/engines/subclass/storage_keys.py checks its parts)
      if (t.layout() == c10::kStrided ? t.numel() != 0 && t.storage().nbytes() == 0
                                      : py::cast<bool>(storage_freed_(x)))
        throw_from(recipe_freed_, get(rec, s_facts_).attr("name"), x);
      vals[k] = py::reinterpret_borrow<py::object>(x);
    } else if (Py_TYPE(x.ptr()) == stand_in) {
      vals[k] = x.attr("get")();
    } else if (Py_TYPE(x.ptr()) == rebuilt) {  // a sparse transpose taken again (dtr/engines/subclass/rebuildable_plain.py)
      vals[k] = x.attr("get")();
      sparse = true;
    } else {
      vals[k] = get(x, s_value_);
    }
  }
  for (py::handle entry : get(rec, s_versions_)) {
    Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry.ptr(), 0));
    int64_t version = PyLong_AsLongLong(PyTuple_GET_ITEM(entry.ptr(), 1));
    void* key = PyLong_AsVoidPtr(PyTuple_GET_ITEM(entry.ptr(), 2));
    if (PyErr_Occurred()) throw py::error_already_set();
    const at::Tensor& t = THPVariable_Unpack(vals[k].ptr());
    // swapped in with no op (`p.data =`); a sparse constant is named by itself
    const void* now = t.layout() == c10::kStrided
                          ? static_cast<const void*>(t.storage().unsafeGetStorageImpl())
                          : static_cast<const void*>(t.unsafeGetTensorImpl());
    if (now != key) throw_from(recipe_replaced_, get(rec, s_facts_).attr("name"), vals[k]);
    if (version >= 0 && t._version() != version)  // written behind dtr
      throw_from(recipe_written_, get(rec, s_facts_).attr("name"), vals[k]);
  }
  py::object specs = get(rec, s_specs_);
  std::vector<Py_ssize_t> in_place;  // leaves whose new version takes their storage
  for (int64_t q : stolen)
    in_place.push_back(PyLong_AsSsize_t(PyTuple_GET_ITEM(PyList_GET_ITEM(specs.ptr(), q), 1)));
  for (py::handle c : get(rec, s_clone_)) {  // written arguments: work on a copy
    Py_ssize_t k = PyLong_AsSsize_t(c.ptr());
    if (std::find(in_place.begin(), in_place.end(), k) == in_place.end())
      vals[k] = call(copy_layout_, {vals[k]});
  }
  // dtr/engines/subclass/tensor_args.py's substitute(rec.args, rec.kwargs, rec.where, vals), on copies: the
  // recipe's own args, kwargs and lists keep None for every tensor, or they would hold
  // the values of this run after it (pybind11's py::list(x) and py::dict(x) do not copy
  // a list or a dict, hence PySequence_List and PyDict_Copy).
  py::object rec_args = get(rec, s_args_);
  py::list args = py::reinterpret_steal<py::list>(PySequence_List(rec_args.ptr()));
  if (!args) throw py::error_already_set();
  py::object kw = get(rec, s_kwargs_);
  py::dict kwargs =
      kw.is_none() ? py::dict() : py::reinterpret_steal<py::dict>(PyDict_Copy(kw.ptr()));
  if (!kwargs) throw py::error_already_set();
  py::object where = get(rec, s_where_);
  for (Py_ssize_t k = 0; k < n; ++k) {
    PyObject* w = PyList_GET_ITEM(where.ptr(), k);
    py::handle key(PyTuple_GET_ITEM(w, 0));
    Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(w, 1));
    bool positional = PyLong_Check(key.ptr());
    py::object slot = positional ? py::object(args[key]) : py::object(kwargs[key]);
    if (j < 0) {
      slot = vals[k];
    } else {
      // a fresh list the first time this argument is filled in (the recipe's own, a
      // list or a tuple, stays as it was); later items of it go into the same copy
      py::object own = positional ? py::object(rec_args[key]) : py::object(kw[key]);
      const bool fresh = slot.ptr() == own.ptr();
      py::list copy = fresh ? py::reinterpret_steal<py::list>(PySequence_List(slot.ptr()))
                            : py::reinterpret_borrow<py::list>(slot);
      if (!copy) throw py::error_already_set();
      copy[j] = vals[k];
      slot = copy;
    }
    if (positional) {
      args[key] = slot;
    } else {
      kwargs[key] = slot;
    }
  }
  py::object func = get(rec, s_func_);
  const OpInfo& op = info(func);
  py::tuple real_args(args);
  py::object captured = get(rec, s_rng_);
  py::object out;
  {
    Quiet quiet(get(rec, s_facts_));
    Replaying rng(captured);  // rng.replaying(rec.rng)
    at::AutoGradMode grad(get(rec, s_grad_).cast<bool>());
    std::optional<c10::impl::ExcludeDispatchKeyGuard> no_bump;
    if (sparse) no_bump.emplace(c10::DispatchKey::ADInplaceOrView);
    PyObject* raw = PyObject_Call(op.op.ptr(), real_args.ptr(), kwargs.ptr());
    if (raw != nullptr) {
      out = py::reinterpret_steal<py::object>(raw);
    } else {
      py::error_already_set exc;
      if (!exc.matches(oom_type_)) throw exc;
      // not retried when the op wrote into an input's own storage (a stolen one)
      out = call(get(rt_, s_retry_),
                 {exc.value(), func, real_args, kwargs, py::bool_(in_place.empty()), captured});
    }
  }
  py::list produced;
  for (py::handle spec : specs) {
    Py_ssize_t i = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec.ptr(), 0));
    Py_ssize_t j = PyLong_AsSsize_t(PyTuple_GET_ITEM(spec.ptr(), 1));
    if (i < 0) {  // (VERSION_SPEC, leaf): the written argument itself
      produced.append(vals[j]);
      continue;
    }
    py::object r = op.nreturns == 1 ? out : py::object(py::tuple(out)[i]);
    produced.append(j < 0 ? r : py::object(r[py::int_(j)]));
  }
  return produced;
}

}  // namespace fast
}  // namespace dtr
