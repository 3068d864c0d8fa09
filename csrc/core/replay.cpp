// See replay.h. Every step mirrors the method of the same name in dtr/sim/replay.py.
#include "core/replay.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <vector>

#include "core/rebuild.h"

namespace dtr {

namespace {

enum Op : int64_t {
  kConst = 0,
  kCopy = 1,
  kRelease = 2,
  kCall = 3,
  kMutate = 4,
  kCopyFrom = 5,
  kInputs = 6,
  kInvalidate = 7,
  kRead = 8,
  kExport = 9,
  kBackward = 10,
  kEnd = 11,
  kReserve = 12,
  kBudget = 13,
  kExportVersion = 14,
};

struct Stop {
  const char* status;
};

class Replayer {
 public:
  Replayer(Core& core, const double* costs, int64_t nslots, bool live, bool stress, double limit)
      : core_(core),
        costs_(costs),
        slots_(nslots, -1),
        live_(live),
        stress_(stress),
        limit_(limit) {
    core_.reserve(nslots);
  }

  void run(const int64_t* code, int64_t n) {
    int64_t pc = 0;
    while (pc < n) {
      const int64_t op = code[pc];
      switch (op) {
        case kConst:
          slots_[code[pc + 1]] = core_.new_constant(code[pc + 2]);
          pc += 3;
          break;
        case kCopy:
          slots_[code[pc + 1]] = slots_[code[pc + 2]];
          core_.retain(slots_[code[pc + 2]]);
          pc += 3;
          break;
        case kRelease: {
          const int64_t t = slots_[code[pc + 1]];
          // The paper's simulator kept constants resident for the whole step.
          if (live_ || !core_.is_constant(t)) core_.release(t);
          pc += 2;
          break;
        }
        case kCall:
          pc = call(code, pc);
          break;
        case kMutate:
          pc = mutate(code, pc);
          break;
        case kCopyFrom: {
          const int64_t old = slots_[code[pc + 1]];
          slots_[code[pc + 1]] = slots_[code[pc + 2]];
          core_.retain(slots_[code[pc + 2]]);
          core_.release(old);
          pc += 3;
          break;
        }
        case kInputs: {
          const int64_t k = code[pc + 1];
          std::vector<int64_t> tids;
          for (int64_t j = 0; j < k; ++j) tids.push_back(slots_[code[pc + 2 + j]]);
          for (int64_t t : tids) {
            core_.lock(t);
            locked_.push_back(t);
          }
          for (int64_t t : tids) materialize(t);
          pc += 2 + k;
          break;
        }
        case kReserve:
          // the live runtime made room for an op's outputs before running it
          if (core_.budget >= 0 && core_.resident_bytes + code[pc + 1] > core_.budget)
            core_.make_room(code[pc + 1]);
          pc += 2;
          break;
        case kInvalidate: {
          const int64_t k = code[pc + 1];
          std::vector<int64_t> seeds;
          for (int64_t j = 0; j < k; ++j) seeds.push_back(slots_[code[pc + 2 + j]]);
          invalidate(seeds);
          pc += 2 + k;
          break;
        }
        case kRead:
        case kExport: {
          const int64_t t = slots_[code[pc + 1]];
          read(t);
          if (op == kExport) core_.pin(t);
          core_.drain_discard();
          pc += 2;
          break;
        }
        case kExportVersion: {  // driver.py's EXPORT_VERSION
          const int64_t t = slots_[code[pc + 1]];
          read(t);
          const int64_t version = core_.record({t}, 0.0, {kVersion}, {t}, {0})[0];
          slots_[code[pc + 2]] = version;
          core_.pin(version);
          core_.drain_discard();
          pc += 3;
          break;
        }
        case kBudget:
          // session.set_budget() in the live run (-1: unlimited), from the next op on
          core_.budget = code[pc + 1];
          pc += 2;
          break;
        case kBackward:
          pc += 1;
          break;
        case kEnd:
          end();
          pc += 1;
          break;
        default:
          throw std::runtime_error("dtr: bad opcode " + std::to_string(op));
      }
      core_.drain_discard();
    }
  }

 private:
  // The program reads tid (READ, EXPORT): rebuilt if evicted, locked meanwhile.
  void read(int64_t tid) {
    core_.lock(tid);
    try {
      materialize(tid);
    } catch (...) {
      core_.unlock(tid);
      throw;
    }
    core_.unlock(tid);
  }

  void materialize(int64_t tid) {
    if (core_.is_materialized(tid)) return;
    rematerialize(
        core_, tid,
        [&](int64_t rid) {
          core_.remat_done(rid, {}, core_.steals(rid));
          if (core_.remat_cost > limit_) throw Stop{"thrash"};
        },
        [](int64_t, int64_t) { throw Stop{"oom"}; }, [&] { core_.drain_discard(); });
  }

  void invalidate(const std::vector<int64_t>& seeds) {
    dtr::invalidate(
        core_, seeds, [&](int64_t t) { materialize(t); }, [&] { core_.drain_discard(); });
  }

  int64_t call(const int64_t* code, int64_t pc) {
    // The per-op lists are members reused from op to op (call() does not re-enter):
    // malloc and free of per-op vectors led the replay's profile.
    std::vector<int64_t>& args = args_;
    std::vector<int64_t>& fresh = fresh_;
    std::vector<int64_t>& kinds = kinds_;
    std::vector<int64_t>& refs = refs_;
    std::vector<int64_t>& nbytes = nbytes_;
    args.clear(), fresh.clear(), kinds.clear(), refs.clear(), nbytes.clear();
    const double cost = costs_[code[pc + 1]];
    const int64_t nargs = code[pc + 2];
    for (int64_t j = 0; j < nargs; ++j) args.push_back(slots_[code[pc + 3 + j]]);
    pc += 3 + nargs;
    const int64_t nres = code[pc];
    const int64_t* body = code + pc + 1;
    pc += 1 + 4 * nres;
    const int64_t nfresh = code[pc];
    for (int64_t j = 0; j < nfresh; ++j) fresh.push_back(slots_[code[pc + 1 + j]]);
    pc += 1 + nfresh;
    int64_t declared = 0;  // the results before a pool version's followers, which the
                           // core makes itself (Core::follow)
    for (int64_t j = 0; j < nres; ++j) {
      if (body[4 * j + 1] == kFollow) continue;
      ++declared;
      kinds.push_back(body[4 * j + 1]);
      const int64_t r = body[4 * j + 2];
      // an argument's position, or nargs + j for this call's result j (core: -(j + 1))
      refs.push_back(r < 0 ? -1 : r < nargs ? args[r] : nargs - r - 1);
      nbytes.push_back(body[4 * j + 3]);
    }
    std::vector<int64_t> outs;
    if (!live_) {
      int64_t extra = 0;
      for (int64_t j = 0; j < nres; ++j)
        if (kinds[j] == kNew) extra += nbytes[j];
      outs = prototype_op(args, cost, kinds, refs, nbytes, [extra] { return extra; });
      for (int64_t j = 0; j < static_cast<int64_t>(outs.size()); ++j) slots_[body[4 * j]] = outs[j];
      return pc;
    }
    if (declared) outs = core_.record(args, cost, kinds, refs, nbytes);
    if (static_cast<int64_t>(outs.size()) != nres)
      throw std::runtime_error("dtr: a CALL names " + std::to_string(nres - declared) +
                               " followers of a pool version where the replay made " +
                               std::to_string(static_cast<int64_t>(outs.size()) - declared));
    core_.drain_discard();
    for (int64_t j = 0; j < static_cast<int64_t>(outs.size()); ++j) slots_[body[4 * j]] = outs[j];
    unlocking_.clear();
    unlocking_.swap(locked_);
    for (int64_t t : unlocking_) core_.unlock(t);
    unlocking_.clear();
    for (int64_t t : fresh) core_.release(t);
    std::vector<int64_t>& protect = protect_;
    protect.clear();
    for (size_t j = 0; j < kinds.size(); ++j)
      if (kinds[j] != kVersion) protect.push_back(outs[j]);
    for (int64_t t : protect) core_.lock(t);
    const bool ok = core_.make_room(0);
    for (int64_t t : protect) core_.unlock(t);
    if (!ok) throw Stop{"oom"};
    if (stress_) core_.evict_all();
    return pc;
  }

  int64_t mutate(const int64_t* code, int64_t pc) {
    const double cost = costs_[code[pc + 1]];
    const int64_t nargs = code[pc + 2];
    std::vector<int64_t> args;
    for (int64_t j = 0; j < nargs; ++j) args.push_back(slots_[code[pc + 3 + j]]);
    pc += 3 + nargs;
    const int64_t nmut = code[pc];
    const int64_t* pairs = code + pc + 1;
    pc += 1 + 2 * nmut;
    std::vector<int64_t> written;
    for (int64_t j = 0; j < nmut; ++j) written.push_back(args[pairs[2 * j]]);
    std::vector<int64_t> nbytes;
    // Each written argument gets a fresh copy of its storage.
    auto room = [&] {
      int64_t extra = 0;
      for (int64_t t : written) {
        nbytes.push_back(core_.pool_bytes(t));
        extra += nbytes.back();
      }
      return extra;
    };
    const std::vector<int64_t> outs = prototype_op(args, cost, std::vector<int64_t>(nmut, kNew),
                                                   std::vector<int64_t>(nmut, -1), nbytes, room);
    for (int64_t j = 0; j < nmut; ++j) slots_[pairs[2 * j + 1]] = outs[j];
    for (int64_t t : written) core_.release(t);  // the name now means the new tensor
    return pc;
  }

  // The paper's semantics for one op: lock and materialize its inputs, make room for its
  // fresh outputs first (room() bytes), then record it.
  template <typename Room>
  std::vector<int64_t> prototype_op(const std::vector<int64_t>& args, double cost,
                                    const std::vector<int64_t>& kinds,
                                    const std::vector<int64_t>& refs,
                                    const std::vector<int64_t>& nbytes, Room room) {
    std::vector<int64_t> outs;
    for (int64_t t : args) {
      core_.touch(t);  // the paper's simulator stamped an op's inputs as it began
      core_.lock(t);
    }
    try {
      for (int64_t t : args) materialize(t);
      if (!core_.make_room(room())) throw Stop{"oom"};
      core_.drain_discard();
      if (!kinds.empty()) outs = core_.record(args, cost, kinds, refs, nbytes);
    } catch (...) {
      for (int64_t t : args) core_.unlock(t);
      throw;
    }
    for (int64_t t : args) core_.unlock(t);
    core_.make_room(0);
    return outs;
  }

  void end() {
    if (live_) core_.budget = -1;  // the block ended: budget lifted, held tensors rebuilt
    for (int64_t t : core_.alive()) {
      read(t);
      if (!live_) core_.pin(t);  // the paper's simulator pinned what the step left alive
    }
    if (!live_ && !core_.make_room(0)) throw Stop{"oom"};
  }

  Core& core_;
  const double* costs_;
  std::vector<int64_t> slots_;
  std::vector<int64_t> locked_;
  std::vector<int64_t> args_, fresh_, kinds_, refs_, nbytes_, protect_, unlocking_;  // call()
  bool live_, stress_;
  double limit_;
};

}  // namespace

std::string replay(Core& core, const int64_t* code, int64_t ncode, const double* costs,
                   int64_t nslots, int mode, bool stress, double thrash, double baseline) {
  const double limit =
      thrash > 0 ? (thrash - 1.0) * baseline : std::numeric_limits<double>::infinity();
  Replayer r(core, costs, nslots, mode == kLive, stress, limit);
  try {
    r.run(code, ncode);
  } catch (const Stop& stop) {
    return stop.status;
  }
  return "ok";
}

}  // namespace dtr
