// Small CPython and pybind11 helpers shared by the fast path's files (fastpath.cpp,
// fastpath_remat.cpp): attribute access and calls without pybind11's overhead, and the
// walk over a call's tensor arguments that dtr/engines/subclass/tensor_args.py makes in Python.
#pragma once

#include <torch/csrc/autograd/python_variable.h>
#include <torch/extension.h>

#include <initializer_list>
#include <stdexcept>
#include <utility>
#include <vector>

namespace dtr {
namespace fast {

namespace py = pybind11;

inline py::object intern(const char* s) {
  return py::reinterpret_steal<py::object>(PyUnicode_InternFromString(s));
}

inline py::object get(py::handle o, const py::object& name) {
  PyObject* r = PyObject_GetAttr(o.ptr(), name.ptr());
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

inline void set(py::handle o, const py::object& name, py::handle v) {
  if (PyObject_SetAttr(o.ptr(), name.ptr(), v.ptr()) < 0) throw py::error_already_set();
}

inline py::object call(py::handle f, std::initializer_list<py::handle> args) {
  PyObject* stack[12];
  if (args.size() > 12) throw std::invalid_argument("dtr: call() takes at most 12 arguments");
  size_t n = 0;
  for (py::handle a : args) stack[n++] = a.ptr();
  PyObject* r = PyObject_Vectorcall(f.ptr(), stack, n, nullptr);
  if (r == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(r);
}

// Raise exc (a Python exception object built by the runtime) through pybind11.
[[noreturn]] inline void raise_exc(const py::object& exc) {
  PyErr_SetObject(reinterpret_cast<PyObject*>(Py_TYPE(exc.ptr())), exc.ptr());
  throw py::error_already_set();
}

// obj.name(*arg) from a destructor: an error already in flight is kept, and one from
// this call dropped (cleanup must not replace the error being unwound).
inline void call_keeping_error(PyObject* obj, PyObject* name, PyObject* arg) {
  PyObject *type, *value, *tb;
  PyErr_Fetch(&type, &value, &tb);
  PyObject* r = arg == nullptr ? PyObject_CallMethodNoArgs(obj, name)
                               : PyObject_CallMethodOneArg(obj, name, arg);
  if (r == nullptr) {
    PyErr_Clear();
  } else {
    Py_DECREF(r);
  }
  PyErr_Restore(type, value, tb);
}

// dict.pop(key, None) on a dict, without looking up and calling the method.
inline py::object dict_pop(PyObject* dict, PyObject* key) {
  PyObject* item = PyDict_GetItemWithError(dict, key);  // borrowed
  if (item == nullptr) {
    if (PyErr_Occurred()) throw py::error_already_set();
    return py::none();
  }
  py::object value = py::reinterpret_borrow<py::object>(item);
  if (PyDict_DelItem(dict, key) < 0) throw py::error_already_set();
  return value;
}

inline bool is_seq(PyObject* a) { return PyList_CheckExact(a) || PyTuple_CheckExact(a); }

// TensorArgs.__init__'s walk (dtr/engines/subclass/tensor_args.py): tensors directly in args/kwargs, or one level
// down in a list or tuple, in that order.
template <class F>
inline void walk(PyObject* args, PyObject* kwargs, F&& visit) {
  auto item = [&](PyObject* key, Py_ssize_t index, PyObject* a) {
    if (THPVariable_Check(a)) {
      visit(a, key, index, -1);
    } else if (is_seq(a)) {
      Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
      PyObject** items = PySequence_Fast_ITEMS(a);
      for (Py_ssize_t j = 0; j < n; ++j)
        if (THPVariable_Check(items[j])) visit(items[j], key, index, j);
    }
  };
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  for (Py_ssize_t i = 0; i < n; ++i) item(nullptr, i, PyTuple_GET_ITEM(args, i));
  if (kwargs != nullptr) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(kwargs, &pos, &key, &value)) item(key, -1, value);
  }
}

// An argument with its tensors replaced, in walk order, by vals[k], vals[k+1], ...
inline PyObject* substitute_item(PyObject* a, const std::vector<PyObject*>& vals, size_t& k) {
  if (THPVariable_Check(a)) {
    PyObject* v = vals[k++];
    Py_INCREF(v);
    return v;
  }
  if (is_seq(a)) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(a);
    PyObject** items = PySequence_Fast_ITEMS(a);
    bool any = false;
    for (Py_ssize_t j = 0; j < n && !any; ++j) any = THPVariable_Check(items[j]);
    if (any) {
      bool list = PyList_CheckExact(a);
      PyObject* out = list ? PyList_New(n) : PyTuple_New(n);
      if (out == nullptr) throw py::error_already_set();
      for (Py_ssize_t j = 0; j < n; ++j) {
        PyObject* v = THPVariable_Check(items[j]) ? vals[k++] : items[j];
        Py_INCREF(v);
        if (list) {
          PyList_SET_ITEM(out, j, v);
        } else {
          PyTuple_SET_ITEM(out, j, v);
        }
      }
      return out;
    }
  }
  Py_INCREF(a);
  return a;
}

// dtr/engines/subclass/tensor_args.py's substitute: (args, kwargs) with leaf k replaced by vals[k].
inline std::pair<py::object, py::object> substitute(PyObject* args, PyObject* kwargs,
                                                    const std::vector<PyObject*>& vals) {
  size_t k = 0;
  Py_ssize_t n = PyTuple_GET_SIZE(args);
  py::object new_args = py::reinterpret_steal<py::object>(PyTuple_New(n));
  for (Py_ssize_t i = 0; i < n; ++i)
    PyTuple_SET_ITEM(new_args.ptr(), i, substitute_item(PyTuple_GET_ITEM(args, i), vals, k));
  py::object new_kwargs = py::reinterpret_steal<py::object>(PyDict_New());
  if (kwargs != nullptr) {
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    while (PyDict_Next(kwargs, &pos, &key, &value)) {
      py::object v = py::reinterpret_steal<py::object>(substitute_item(value, vals, k));
      if (PyDict_SetItem(new_kwargs.ptr(), key, v.ptr()) < 0) throw py::error_already_set();
    }
  }
  return {std::move(new_args), std::move(new_kwargs)};
}

// The key Runtime.storages uses for a plain tensor: its storage's _cdata.
inline py::object storage_key(PyObject* tensor) {
  const at::Tensor& t = THPVariable_Unpack(tensor);
  return py::reinterpret_steal<py::object>(PyLong_FromVoidPtr(t.storage().unsafeGetStorageImpl()));
}

}  // namespace fast
}  // namespace dtr
