// Python bindings of the core: dtr._C.Core, with the same interface as dtr.core.reference.PyCore.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "core/core.h"
#include "cpu_cache.h"
#include "device_memory.h"
#include "subclass/fastpath.h"
#include "native/engine.h"
#include "core/replay.h"
#include "core/roofline.h"

namespace py = pybind11;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "dtr C++ bookkeeping core (see dtr/core/reference.py for the reference twin)";
  m.attr("NEW") = static_cast<int64_t>(dtr::kNew);
  m.attr("VIEW") = static_cast<int64_t>(dtr::kView);
  m.attr("VERSION") = static_cast<int64_t>(dtr::kVersion);
  m.attr("HEURISTICS") = py::cast(dtr::heuristic_names());
  m.attr("TORCH_VERSION") = py::str(DTR_TORCH_VERSION);
  py::class_<dtr::Core>(m, "Core")
      .def(py::init<const std::string&, int64_t, uint64_t, int64_t>(), py::arg("heuristic") = "dtr",
           py::arg("budget") = -1, py::arg("seed") = 0, py::arg("min_evict_bytes") = 0)
      .def("new_constant", &dtr::Core::new_constant)
      .def("record", &dtr::Core::record, py::arg("inputs"), py::arg("cost"), py::arg("kinds"),
           py::arg("refs"), py::arg("nbytes"), py::arg("name") = std::string())
      .def("op_fits", &dtr::Core::op_fits)
      .def("retain", &dtr::Core::retain)
      .def("release", &dtr::Core::release)
      .def("lock", &dtr::Core::lock)
      .def("touch", &dtr::Core::touch)
      .def("unlock", &dtr::Core::unlock)
      .def("pin", &dtr::Core::pin)
      .def("resized", &dtr::Core::resized)
      .def("drain", &dtr::Core::drain)
      .def("make_room", &dtr::Core::make_room, py::arg("extra") = 0)
      .def("evict_all", &dtr::Core::evict_all)
      .def("reset_peak", &dtr::Core::reset_peak)
      .def("log_evictions", &dtr::Core::log_evictions, py::arg("on") = true)
      .def("eviction_log", &dtr::Core::eviction_log)
      .def("remat_begin", &dtr::Core::remat_begin)
      .def("remat_step", &dtr::Core::remat_step)
      .def("remat_abort", &dtr::Core::remat_abort)
      .def("steals", &dtr::Core::steals)
      .def("remat_bytes", &dtr::Core::remat_bytes)
      .def("remat_done", &dtr::Core::remat_done, py::arg("rid"), py::arg("nbytes"),
           py::arg("stolen") = std::vector<int64_t>())
      .def("is_materialized", &dtr::Core::is_materialized)
      .def("is_private", &dtr::Core::is_private)
      .def("can_version", &dtr::Core::can_version)
      .def("followed", &dtr::Core::followed)
      .def("is_constant", &dtr::Core::is_constant)
      .def("has_consumers", &dtr::Core::has_consumers)
      .def("recipe_of", &dtr::Core::recipe_of)
      .def("ext", &dtr::Core::ext)
      .def("members", &dtr::Core::members)
      .def("pool_of", &dtr::Core::pool_of)
      .def("pool_bytes", &dtr::Core::pool_bytes)
      .def("descendants", &dtr::Core::descendants)
      .def("end_step", &dtr::Core::end_step)
      .def("alive", &dtr::Core::alive)
      .def("pinned_bytes", &dtr::Core::pinned_bytes)
      .def("constant_bytes", &dtr::Core::constant_bytes)
      .def("locked_bytes", &dtr::Core::locked_bytes)
      .def("largest_pinned", &dtr::Core::largest_pinned)
      .def("counts", &dtr::Core::counts)
      .def("check", &dtr::Core::check)
      .def(
          "replay",
          [](dtr::Core& core, py::array_t<int64_t, py::array::c_style | py::array::forcecast> code,
             py::array_t<double, py::array::c_style | py::array::forcecast> costs, int64_t nslots,
             int mode, bool stress, double thrash, double baseline, bool log) {
            if (log) core.log_evictions(true);
            py::gil_scoped_release nogil;
            return dtr::replay(core, code.data(), code.size(), costs.data(), nslots, mode, stress,
                               thrash, baseline);
          },
          "Replay a compiled trace (dtr.sim) on this core; returns ok, oom or thrash.")
      .def_readonly("heuristic", &dtr::Core::heuristic)
      .def_readonly("last_need", &dtr::Core::last_need)
      .def_readonly("op_floor_bytes", &dtr::Core::op_floor_bytes)
      .def_readonly("floor_need_bytes", &dtr::Core::floor_need_bytes)
      .def_readonly("floor_step", &dtr::Core::floor_step)
      .def_readonly("step_floor_bytes", &dtr::Core::step_floor_bytes)
      .def_readonly("floor_op", &dtr::Core::floor_op)
      .def_readonly("free_peak_bytes", &dtr::Core::free_peak_bytes)
      .def_readwrite("budget", &dtr::Core::budget)
      .def_readonly("min_evict_bytes", &dtr::Core::min_evict_bytes)
      .def_readonly("now", &dtr::Core::now)
      .def_readonly("resident_bytes", &dtr::Core::resident_bytes)
      .def_readonly("peak_bytes", &dtr::Core::peak_bytes)
      .def_readonly("max_bytes", &dtr::Core::max_bytes)
      .def_readonly("ops", &dtr::Core::ops)
      .def_readonly("step", &dtr::Core::step)
      .def_readonly("remats", &dtr::Core::remats)
      .def_readonly("remat_cost", &dtr::Core::remat_cost)
      .def_readonly("evictions", &dtr::Core::evictions)
      .def_readonly("eager_evictions", &dtr::Core::eager_evictions)
      .def_readwrite("search_sample", &dtr::Core::search_sample)
      .def_readwrite("thrash", &dtr::Core::thrash)
      .def_readwrite("request_stamps", &dtr::Core::request_stamps)
      .def_readonly("search_seconds", &dtr::Core::search_seconds);
  dtr::bind_fastpath(m);
  dtr::native::bind(m);
  dtr::cpu_cache::bind(m);
  dtr::roofline::bind(m);
  dtr::device_memory::bind(m);
}
