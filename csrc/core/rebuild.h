// The rebuild protocol in C++ (dtr/core/rebuild.py, Rebuilder.rematerialize and Rebuilder.invalidate):
// the core calls a driver makes to rebuild a tensor and to cut what reads a tensor about
// to be written, in the order the Python twin makes them (the core's choices depend on
// that order). Used by the simulator's replay loop (replay.cpp), the subclass engine's
// fast path (fastpath_remat.cpp) and the native engine (native/engine.cpp).
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include <ATen/record_function.h>

#include "core/core.h"

namespace dtr {

// The range each recipe's rerun gets in torch.profiler (dtr/core/rebuild.py's REMAT_RANGE), so
// that time spent recomputing shows apart from the ops the program asked for.
constexpr const char* kRematRange = "dtr::remat";

// Rerun the recipes that rebuild tid, in the order the core schedules them (Invariant 7:
// iterative). The caller holds tid locked. rerun(rid) reruns recipe rid and calls
// core.remat_done; out_of_budget(rid, need) throws when no victim frees `need` bytes;
// drain() mirrors the core.
template <class Rerun, class OutOfBudget, class Drain>
void rematerialize(Core& core, int64_t tid, Rerun rerun, OutOfBudget out_of_budget, Drain drain) {
  core.remat_begin(tid);
  bool finished = false;
  try {
    while (true) {
      const int64_t rid = core.remat_step();
      if (rid < 0) break;
      const int64_t need = core.remat_bytes(rid);
      if (!core.make_room(need)) out_of_budget(rid, need);
      drain();
      RECORD_USER_SCOPE(kRematRange);
      rerun(rid);
    }
    finished = true;
  } catch (...) {
    if (!finished) core.remat_abort();
    drain();
    throw;
  }
  drain();
}

// seeds are about to be written in place without keeping their lineage: every tensor
// the program holds whose lineage reads them is materialized now (materialize(t), t
// locked) and pinned, and lineage nobody needs any more is dropped (Invariants 3, 4).
template <class Materialize, class Drain>
void invalidate(Core& core, const std::vector<int64_t>& seeds, Materialize materialize,
                Drain drain) {
  std::vector<int64_t> todo = seeds;
  const std::vector<int64_t> desc = core.descendants(seeds);
  todo.insert(todo.end(), desc.begin(), desc.end());
  std::vector<int64_t> held;
  try {
    // Until every held tensor is resident: rebuilding one may evict another that was
    // resident when it was checked (it was not locked then). Each extra pass locks at
    // least one more tensor, so this ends.
    bool again = true;
    while (again) {
      again = false;
      for (int64_t t : todo) {
        if (core.ext(t) > 0 && !core.is_materialized(t) && !core.is_constant(t)) {
          for (int64_t h : held)
            if (h == t)
              throw std::logic_error("dtr: locked tensor " + std::to_string(t) + " was evicted");
          core.lock(t);
          held.push_back(t);
          materialize(t);
          again = true;
        }
      }
    }
    for (int64_t t : todo) core.pin(t);
  } catch (...) {
    for (int64_t t : held) core.unlock(t);
    drain();
    throw;
  }
  for (int64_t t : held) core.unlock(t);
  drain();
}

}  // namespace dtr
