// The fast path's state and the helpers its two files share: the FastPath class (the
// op path is in fastpath.cpp, the recomputation in fastpath_remat.cpp) and the RAII
// pieces that mirror the runtime's `finally` blocks and context managers.
#pragma once

#include <ATen/core/grad_mode.h>
#include <torch/extension.h>

#include <exception>
#include <functional>
#include <unordered_map>
#include <utility>
#include <vector>

#include "core/core.h"
#include "pyglue.h"

namespace dtr {
namespace fast {

struct Leaf {
  PyObject* arg;     // as the program passed it (borrowed from the call)
  py::object node;   // its Node when managed, else empty
  py::object value;  // the plain tensor the op runs on
  PyObject* key;     // its kwarg name (borrowed), or null when positional
  Py_ssize_t index;  // its position in args (when positional)
  Py_ssize_t j;      // its index in a list argument, or -1
  int64_t tid;
  int64_t position;  // its argument's position in the schema, as TensorArgs.positions
};

struct Out {
  int64_t i, j;
  PyObject* tensor;    // borrowed from the op's result
  py::object wrapper;  // what the program gets instead
};

// The `finally` of Runtime._run, also when it goes out of scope: unlock the inputs,
// then release the constants first registered for this call (now held by the recipe,
// or by nothing).
struct Locks {
  Core& core;
  std::vector<int64_t> tids;
  std::vector<int64_t> fresh;
  explicit Locks(Core& c) : core(c) {}
  void lock(int64_t tid) {
    core.lock(tid);
    tids.push_back(tid);
  }
  void unlock_all() {
    for (int64_t tid : tids) core.unlock(tid);
    tids.clear();
    for (int64_t tid : fresh) core.release(tid);
    fresh.clear();
  }
  ~Locks() {
    try {
      unlock_all();
    } catch (...) {  // an unlock cannot fail on a locked tensor; never throw from here
    }
  }
};

// Runs f when it goes out of scope because an exception is passing (never throws).
struct OnUnwind {
  std::function<void()> f;
  int pending = std::uncaught_exceptions();
  ~OnUnwind() {
    if (std::uncaught_exceptions() <= pending) return;
    try {
      f();
    } catch (...) {  // the exception in flight is the one the program should see
    }
  }
};

// rng.replaying(captured) (dtr/engines/subclass/rng.py): the generator set to the state a random op first
// drew from, and put back as it was when this goes out of scope.
struct Replaying {
  py::object gen, saved;
  const py::object set_state = intern("set_state");
  explicit Replaying(const py::object& captured) {
    if (captured.is_none()) return;
    gen = py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(captured.ptr(), 0));
    saved = gen.attr("get_state")();
    gen.attr(set_state)(py::reinterpret_borrow<py::object>(PyTuple_GET_ITEM(captured.ptr(), 1)));
  }
  ~Replaying() {
    if (gen) call_keeping_error(gen.ptr(), set_state.ptr(), saved.ptr());
  }
};

class FastPath {
 public:
  FastPath(py::object runtime, py::object types, bool stress, bool check, bool model_cost,
           bool metered)
      : rt_(std::move(runtime)),
        stress_(stress),
        check_(check),
        model_cost_(model_cost),
        metered_(metered) {
    ckpt_type_ = types.attr("CheckpointTensor");
    node_type_ = types.attr("Node");
    ref_type_ = types.attr("Ref");
    recipe_type_ = types.attr("Recipe");
    oom_type_ = types.attr("OutOfMemoryError");
    roofline_ = types.attr("roofline");
    make_wrapper_ = types.attr("make_wrapper");
    set_conj_ = types.attr("set_conj");
    set_neg_ = types.attr("set_neg");
    object_new_ = types.attr("object_new");
    capture_ = types.attr("capture");
    drew_ = types.attr("drew");
    recipe_freed_ = types.attr("recipe_freed");
    recipe_written_ = types.attr("recipe_written");
    recipe_replaced_ = types.attr("recipe_replaced");
    stand_in_type_ = types.attr("StandIn");
    rebuilt_type_ = types.attr("Rebuilt");
    copy_layout_ = types.attr("copy_preserving_layout");
    storage_freed_ = types.attr("storage_freed");
    parameter_type_ = types.attr("Parameter");
    serials_ = types.attr("serials");
    wrapper_kwnames_ =
        py::make_tuple("strides", "storage_offset", "dtype", "device", "layout", "requires_grad");
    nodes_ = rt_.attr("nodes");
    storages_ = rt_.attr("storages");
    const_keys_ = rt_.attr("const_keys");
    const_storages_ = rt_.attr("const_storages");
    escaped_ = rt_.attr("escaped");
    escaped_keys_ = rt_.attr("escaped_keys");
    exported_plain_ = rt_.attr("exported_plain");
    sizes_ = rt_.attr("sizes");
    lock_ = rt_.attr("lock");
    core_obj_ = rt_.attr("core");
    core_ = core_obj_.cast<Core*>();
    leaf_handles_ = rt_.attr("leaf_hooks").attr("handles")();
  }

  py::object operator()(py::handle func, py::handle args, py::handle kwargs);
  py::object torch_dispatch(py::handle mode, py::handle func, py::handle types, py::handle args,
                            py::handle kwargs);
  void set_mode_hooks(py::object frame_callback, py::object without_dynamo) {
    frame_callback_ = std::move(frame_callback);
    without_dynamo_ = std::move(without_dynamo);
  }
  // Runtime.view_replay noted a graph hazard (dtr/engines/subclass/view_replay.py): the ops of a
  // create_graph backward go to handle(), which refuses them.
  void watch_graph() { watch_graph_ = true; }
  bool rematerialize_if_own(int64_t tid) {
    if (get(rt_, s_core_).ptr() != core_obj_.ptr()) return false;  // (tests wrap the core)
    rematerialize(tid);
    return true;
  }

 private:
  // How Runtime.fast_route says an op overload may be served here.
  enum Plain : int64_t { kPlainNo = 0, kPlainRead = 1, kPlainWrite = 2 };
  struct OpInfo {
    bool managed = false;      // its calls on managed tensors may be run here
    int64_t plain = kPlainNo;  // what its calls on plain tensors only may do here
    bool detach = false, view = false;
    bool plain_recipe = false;  // Recipe.__init__ would change none of its arguments
    // Its calls that write managed tensors may be run here, as new versions (Invariant
    // 4): it returns only what it writes, and none of handle()'s special cases applies.
    bool writes_managed = false;
    std::vector<int64_t> writes;  // schema positions it writes
    int64_t generator = -1;       // schema position of its Generator, if it draws numbers
    bool seeded = false;
    bool may_draw = false;  // may draw untagged: watched, kept as random if it drew
    py::object arg_index, arg_names;
    py::object func, facts, name, op;  // op: func._op, the C++ callable behind func
    std::string op_name;               // name's text, for the core's floor (Core::note_need)
    int64_t nreturns = 1;
  };
  // Runtime.handle's scan of the leaves: whether the call is simple enough for this
  // path, whether a leaf is managed, and whether a plain one requires grad.
  struct Scan {
    bool simple = true, managed = false, requires_grad = false;
    // an argument in volatile memory (dtr/engines/subclass/volatile.py): a recipe reads a snapshot of it,
    // which Runtime._snapshot_volatile takes
    bool volatile_arg = false;
  };
  bool keyed_in(const py::object& dict, PyObject* tensor);
  bool escaped(PyObject* tensor);
  bool exported_plain(PyObject* tensor);

  const OpInfo& info(py::handle func);
  py::object fallback(py::handle func, py::handle args, py::handle kwargs);
  Scan scan(const OpInfo& op, PyObject* args, PyObject* kwargs, std::vector<Leaf>& leaves);
  bool versioned_writes(const OpInfo& op, const std::vector<Leaf>& leaves,
                        std::vector<size_t>& written);
  bool known(const std::vector<Leaf>& leaves);
  py::object run(const OpInfo& op, PyObject* args, PyObject* kwargs, std::vector<Leaf>& leaves,
                 const std::vector<size_t>& written = {});
  void flush();
  void drain();
  void rematerialize(int64_t tid);
  std::vector<int64_t> rerun(int64_t rid, const std::vector<int64_t>& stolen);
  py::object replay(const py::object& rec, const std::vector<int64_t>& stolen);
  [[noreturn]] void throw_from(const py::object& make, py::handle name, py::handle tensor);
  void settle(const std::vector<int64_t>& fresh, const OpInfo& op);
  int64_t constant(PyObject* arg, std::vector<int64_t>& fresh);
  py::object new_wrapper(py::handle ref, py::handle like);
  py::object new_node(py::handle tid, py::handle value, py::handle name, py::handle shape);
  py::object new_ref(py::handle node);
  py::object new_recipe(const OpInfo& op, const py::object& args, const py::object& kwargs,
                        const py::list& where, const py::list& inputs, const py::tuple& clone,
                        const py::list& specs, const py::object& captured,
                        const std::vector<Leaf>& leaves);
  void set_item(const py::object& list, int64_t index, py::handle value);
  [[noreturn]] void budget_error(const std::vector<int64_t>& fresh, const OpInfo& op, bool fits);
  static void note_raised(py::handle exc);
  static void note_raised(PyObject* type, const char* what);

  py::object rt_, ckpt_type_, node_type_, ref_type_, recipe_type_, oom_type_, roofline_;
  py::object make_wrapper_, set_conj_, set_neg_, object_new_, wrapper_kwnames_, capture_,
      drew_;
  py::object recipe_freed_, recipe_written_, recipe_replaced_, stand_in_type_, rebuilt_type_,
      copy_layout_, storage_freed_, parameter_type_, serials_;
  py::object nodes_, storages_, const_keys_, const_storages_, escaped_, escaped_keys_,
      exported_plain_, sizes_, lock_;
  py::object core_obj_;
  py::object frame_callback_, without_dynamo_;  // dtr/engines/subclass/session.py's, for torch_dispatch
  Core* core_;
  bool stress_, check_, model_cost_;
  bool metered_;  // measure="allocator": Runtime.measure_device at each boundary
  bool watch_graph_ = false;
  std::unordered_map<PyObject*, OpInfo> ops_;
  const py::object s_is_open_ = intern("is_open"), s_core_ = intern("core"),
                   s_pending_ = intern("pending_refs"), s_ref_ = intern("_dtr_ref"),
                   s_runtime_ = intern("runtime"), s_node_ = intern("node"),
                   s_value_ = intern("value"), s_tid_ = intern("tid"), s_shape_ = intern("shape"),
                   s_name_ = intern("name"), s_serial_ = intern("serial"),
                   s_recipes_ = intern("recipes"), s_outputs_ = intern("outputs"),
                   s_acquire_ = intern("acquire"), s_release_ = intern("release"),
                   s_handle_ = intern("handle"), s_predict_ = intern("predict"),
                   s_learn_ = intern("learn"), s_retry_ = intern("retry_after_oom"),
                   s_budget_error_ = intern("_budget_error"), s_fast_route_ = intern("fast_route"),
                   s_constant_ = intern("constant"), s_hook_leaf_ = intern("_hook_leaf"),
                   s_func_ = intern("func"), s_facts_ = intern("facts"), s_args_ = intern("args"),
                   s_kwargs_ = intern("kwargs"), s_where_ = intern("where"),
                   s_inputs_ = intern("inputs"), s_clone_ = intern("clone"),
                   s_specs_ = intern("specs"), s_rng_ = intern("rng"), s_grad_ = intern("grad"),
                   s_versions_ = intern("versions"), s_device_ = intern("device"),
                   s_value_fn_ = intern("_value"), s_stealing_ = intern("_stealing"),
                   s_after_steal_ = intern("_after_interrupted_steal"),
                   s_out_of_budget_ = intern("out_of_budget"),
                   s_recompute_seconds_ = intern("recompute_seconds"),
                   s_hooks_dict_ref_ = intern("hooks_dict_ref"),
                   s_post_hooks_ = intern("_post_accumulate_grad_hooks"), s_check_mirror_ = intern("check_mirror"),
                   s_measure_device_ = intern("measure_device");
  py::object leaf_handles_;  // Runtime.leaf_hooks.handles(): leaf._cdata -> its hook's handle
  void hook_leaf(PyObject* arg, const at::Tensor& t);
};

// Runtime.lock held for the call, as `with self.lock:` in Runtime.handle.
struct Held {
  PyObject* lock;
  PyObject* release;
  Held(PyObject* l, PyObject* acquire, PyObject* rel) : lock(l), release(rel) {
    PyObject* r = PyObject_CallMethodNoArgs(lock, acquire);
    if (r == nullptr) throw py::error_already_set();
    Py_DECREF(r);
  }
  ~Held() { call_keeping_error(lock, release, nullptr); }
};

}  // namespace fast
}  // namespace dtr
