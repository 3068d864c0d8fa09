// dtr core: the bookkeeping of Dynamic Tensor Rematerialization, with no PyObjects.
//
// This is a line-for-line port of dtr/core/reference.py (the reference). Both must make the
// same decisions on the same event sequence; tests/unit/test_core.py drives both and compares.
// Keep the order of every loop and every floating-point sum identical to the twin.
//
// Records are addressed by small integers that are reused only after the driver has
// drained them (see drain()). Numbered invariants: docs/design.md.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace dtr {

// What record() makes of each output: fresh storage; a view (refs[k] is the tensor it
// aliases, or -(j + 1) for this call's earlier output j); the new version of refs[k].
enum OutputKind : int64_t { kNew = 0, kView = 1, kVersion = 2, kFollow = 3 };
// kFollow is a trace's kind, never given to record(): a pool version's follower, which
// record() makes itself (Core::follow), named by the trace after the declared outputs.

enum Heuristic : int {
  kDTR = 0,
  kDTREq = 1,
  kDTRLocal = 2,
  kLRU = 3,
  kSize = 4,
  kMSPS = 5,
  kRandom = 6,
  kMSPSSqrt = 7,
  kDTRHeld = 8,
  kDTRHeld34 = 9,
};

const std::vector<std::string>& heuristic_names();

class Core;

// The budget is given up on: no victim frees what an op needs, or recomputation runs
// away (Core::thrash). dtr.BudgetError in Python (native/engine.cpp's exception translator).
struct BudgetExceeded : std::runtime_error {
  using std::runtime_error::runtime_error;
  // What dtr.errors.budget_advice words the message's advice from (budget < 0: no
  // advice), the op-level floor taken from core (dtr.errors.Floor's fields).
  BudgetExceeded(const std::string& msg, int64_t budget, int64_t constants, std::string what,
                 int64_t requested, const Core& core);
  int64_t budget = -1, constants = 0, requested = 0;
  std::string what_for;
  int64_t floor = 0, floor_need = 0, free_peak = -1;
  std::string floor_op;
  bool floor_in_step = false;
};

// dtr.units.format_bytes: 1536 -> "1.50 KiB".
std::string format_bytes(int64_t nbytes);

// The thrash stop's smallest allowance, in ops: a short step (a few ops reading a long
// lineage carried in) may recompute that lineage without being called a runaway.
constexpr int64_t kThrashFloor = 1000;

struct TensorRec {
  int64_t pool = -1;
  int64_t recipe = -1;
  int64_t ext = 0;
  int64_t lock = 0;
  int64_t born = 0;  // the step it was recorded in (Core::end_step)
  bool mat = false;
  bool used = false;
  std::vector<int64_t> consumers;
};

struct PoolRec {
  int64_t nbytes = 0;
  bool resident = false;
  bool constant = false;
  bool used = false;
  int64_t pinned = 0;  // kept members without a recipe: the pool cannot be evicted
  int64_t alive = 0;   // members with ext > 0
  int64_t locks = 0;   // sum of member locks
  double last_access = 0.0;
  double cost = 0.0;  // sum of the distinct recipes of its members
  int64_t uf = -1;    // union-find node while evicted (dtr_eq)
  // The program dropped its last handle while the pool could not be evicted (locked, or
  // holding an unrecomputable member): evict as soon as it can be (Invariant 5).
  bool doomed = false;
  int64_t slot = -1;  // index in Core::cands_ while resident and not constant
  std::vector<int64_t> members;
};

struct Frame {
  int64_t tid;
  std::vector<int64_t> locks;
  bool seen = false;  // its recipe's inputs were stamped (request_stamps)
};

struct RecipeRec {
  std::vector<int64_t> inputs;
  std::vector<int64_t> outputs;
  std::vector<int64_t> nbytes;
  std::vector<int64_t> version_of;  // per output: the tensor it updated in place, or -1
  double cost = 0.0;
  int64_t kept = 0;
  bool used = false;
  bool pool_version = false;  // it has followers (Core::follow)
};

class Core {
 public:
  Core(const std::string& heuristic, int64_t budget, uint64_t seed, int64_t min_evict_bytes);

  // recording
  int64_t new_constant(int64_t nbytes);  // starts with one handle (the op in flight)
  // name: the op of a call the program made, which counts towards the op-level floor
  // (note_need); empty for a record the engine makes itself (a version for a write).
  std::vector<int64_t> record(const std::vector<int64_t>& inputs, double cost,
                              const std::vector<int64_t>& kinds, const std::vector<int64_t>& refs,
                              const std::vector<int64_t>& nbytes,
                              const std::string& name = std::string());
  // handles
  void retain(int64_t tid);
  void release(int64_t tid);
  void touch(int64_t tid);  // stamp tid's pool as accessed now (request_stamps)
  void lock(int64_t tid);
  void unlock(int64_t tid);
  void pin(int64_t tid);
  // tid's storage holds nbytes now: an out= op resized it in place (its pool is resident)
  void resized(int64_t tid, int64_t nbytes);
  std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>> drain();
  // drain() for a caller with no handles to update (the replay loop): the same recycling
  // of ids, without building the three lists.
  void drain_discard();
  // Room for n tensors, pools and recipes before a replay of a trace that names n
  // values: growing the tables one op at a time reallocated and copied them.
  void reserve(int64_t n);
  // eviction
  bool make_room(int64_t extra);
  void reset_peak() { peak_bytes = max_bytes = resident_bytes; }
  void log_evictions(bool on) {
    logging_ = on;
    log_.clear();
  }
  std::vector<int64_t> eviction_log() const { return log_; }
  int64_t evict_all();
  // rematerialization (see the note above remat_begin in core.cpp)
  void remat_begin(int64_t tid);
  int64_t remat_step();
  void remat_abort();
  std::vector<int64_t> steals(int64_t rid) const;
  int64_t remat_bytes(int64_t rid) const;
  void remat_done(int64_t rid, const std::vector<int64_t>& nbytes,
                  const std::vector<int64_t>& stolen);
  // queries
  bool is_materialized(int64_t tid) const { return T(tid).mat; }
  // tid may get a new version: its pool is recomputable and the program holds tid.
  // Private (the only member held): the old value's storage is taken over. Otherwise a
  // pool version: the other held members follow it into the new storage (record()
  // returns them after the declared outputs; followed() names what each replaced).
  bool is_private(int64_t tid) const;
  bool can_version(int64_t tid) const;
  const std::vector<int64_t>& followed() const { return followed_; }  // by the last record()
  bool is_constant(int64_t tid) const { return P(T(tid).pool).constant; }
  bool has_consumers(int64_t tid) const { return !T(tid).consumers.empty(); }
  int64_t recipe_of(int64_t tid) const { return T(tid).recipe; }
  int64_t ext(int64_t tid) const { return T(tid).ext; }
  std::vector<int64_t> members(int64_t tid) const { return P(T(tid).pool).members; }
  int64_t pool_of(int64_t tid) const { return T(tid).pool; }
  int64_t pool_bytes(int64_t tid) const { return P(T(tid).pool).nbytes; }
  std::vector<int64_t> descendants(const std::vector<int64_t>& seeds) const;
  // Closes a step: the held tensors whose lineage reaches into an earlier step, which
  // the driver cuts (materialized and pinned), and the next step begins.
  std::vector<int64_t> end_step();
  std::vector<int64_t> alive() const;
  int64_t pinned_bytes() const;
  int64_t constant_bytes() const;
  int64_t locked_bytes() const;
  std::vector<std::pair<int64_t, int64_t>> largest_pinned(int64_t k) const;
  std::tuple<int64_t, int64_t, int64_t> counts() const;
  void check() const;

  // The op-level floor, live (dtr.sim.floor's): no budget below the constants plus what
  // one op has resident at once (its distinct inputs and its fresh outputs) can run it.
  // Kernels' own buffers are left out: dtr's count never holds them, and a budget at the
  // peak of that count must run (a CSR matrix product's buffers would put the floor of a
  // graph network above its peak). last_need: the last
  // recorded call's; op_floor_bytes: the largest so far, set by floor_op in step
  // floor_step, floor_need_bytes of it the op's own; step_floor_bytes: this step's.
  int64_t last_need = 0;
  int64_t op_floor_bytes = 0;
  int64_t floor_need_bytes = 0;
  int64_t floor_step = -1;
  int64_t step_floor_bytes = 0;
  std::string floor_op;
  // The largest resident count (at any point) of a step that evicted nothing: the peak a
  // step reaches without eviction (-1: no such step closed yet).
  int64_t free_peak_bytes = -1;
  // The call recorded since the last op_fits() fits the budget (its need is then
  // forgotten: a later budget is not held against an op already settled).
  bool op_fits() {
    const int64_t need = pending_need_;
    pending_need_ = 0;
    return budget < 0 || need <= budget;
  }

  std::string heuristic;
  int64_t budget;
  int64_t min_evict_bytes;
  double now = 0.0;
  int64_t resident_bytes = 0;
  int64_t peak_bytes = 0;
  int64_t max_bytes = 0;
  int64_t ops = 0;
  int64_t remats = 0;
  double remat_cost = 0.0;
  int64_t evictions = 0;
  int64_t eager_evictions = 0;
  int64_t step = 0;  // steps closed by end_step()
  // The thrash stop (docs/design.md, "Thrash stop"): with thrash > 1, a step reruns at
  // most (thrash - 1) x max(its ops so far, the previous step's ops, kThrashFloor)
  // recipes, and remat_step raises BudgetExceeded rather than start one more. The
  // simulator's cap (replay.cpp: recomputation within (thrash - 1) x the baseline) in
  // op counts, which are deterministic where costs are measured. 0: no stop.
  double thrash = 0.0;
  bool thrashing() const;
  std::string thrash_message() const;
  // The paper's simulator's staleness clock (the simulator sets it for the prototype's
  // traces): a pool is stamped when an op or a rerun that reads it is requested (touch(),
  // and remat_step() for a rerun's inputs) and when an op creates it; never by a lock, by
  // record() for the inputs, or by a rerun finishing. False: dtr's own stamps (every lock,
  // record's inputs, a rerun's outputs and inputs), which keep what was just rebuilt.
  bool request_stamps = false;
  int64_t search_sample = 0;    // > 0: score this many sampled candidates when there are more
  double search_seconds = 0.0;  // time spent choosing victims

 private:
  const TensorRec& T(int64_t tid) const;
  TensorRec& T(int64_t tid);
  const PoolRec& P(int64_t pid) const;
  PoolRec& P(int64_t pid);
  RecipeRec& R(int64_t rid);
  const RecipeRec& R(int64_t rid) const;

  int64_t new_tensor(int64_t pool, int64_t recipe, int64_t ext, bool mat);
  int64_t new_pool(int64_t nbytes, bool resident, bool constant);
  int64_t alloc_recipe(const std::vector<int64_t>& inputs, double cost);
  void add_resident(int64_t nbytes);
  void note_need(const std::vector<int64_t>& inputs, const std::vector<int64_t>& kinds,
                 const std::vector<int64_t>& nbytes, const std::string& name);
  void pool_cost(PoolRec& p);
  static void reset(TensorRec& t);
  static void reset(PoolRec& p);
  static void reset(RecipeRec& r);
  int64_t version(int64_t old, int64_t rid);
  void follow(int64_t old, int64_t version, int64_t rid,
              std::vector<std::pair<int64_t, int64_t>>& out);
  bool droppable(const TensorRec& t) const;
  void maybe_drop(int64_t tid);
  void drop(std::vector<int64_t> stack);
  void drop_recipe(int64_t rid);
  std::vector<int64_t> release_recipe(int64_t rid);
  void free_pool(int64_t pid);
  bool evictable(const PoolRec& p) const;
  void maybe_eager_evict(int64_t pid);
  void evict(int64_t pid);
  int64_t choose();
  int64_t best_of(const std::vector<int64_t>& pids);
  bool eligible(const PoolRec& p) const { return evictable(p) && p.nbytes >= min_evict_bytes; }
  void cand_add(int64_t pid, PoolRec& p);
  void cand_remove(PoolRec& p);
  double score(int64_t pid, const PoolRec& p, double bound, double& cost);
  void pool_parents(int64_t pid, std::vector<int64_t>& out) const;
  void pool_children(int64_t pid, std::vector<int64_t>& out) const;
  double neighborhood(int64_t pid, bool up, bool down, double total, double denom, double bound,
                      bool held = false);
  const std::vector<int64_t>& adjacent(int64_t pid, int direction);
  const std::vector<int64_t>& root_adjacent(int64_t pid, int direction);
  void graph_changed() { ++graph_gen_; }
  int64_t uf_find(int64_t x);
  void mark_evicted(int64_t pid);
  void uf_leave(PoolRec& p);
  double eq_neighbors(int64_t pid);
  uint64_t next_random();
  void pop_frame();

  int h_;
  uint64_t rng_;
  // ops and remats when the step began; the previous step's ops and peak (-1: none yet)
  int64_t step_ops_ = 0, step_remats_ = 0, prev_ops_ = -1, prev_peak_ = -1;
  int64_t step_evictions_ = 0, step_max_ = 0;  // evictions when the step began; its max count
  int64_t pending_need_ = 0;                    // op_fits()'s
  int64_t const_bytes_ = 0;                     // constant_bytes(), kept as pools come and go
  std::vector<TensorRec> tensors_;
  std::vector<PoolRec> pools_;
  std::vector<RecipeRec> recipes_;
  std::vector<int64_t> free_t_, free_p_, free_r_;
  std::vector<int64_t> dropped_t_, dropped_r_, dropped_p_;
  std::vector<int64_t> evicted_;
  // Resident, non-constant pools (the possible victims), swap-removed in the same order
  // as PyCore._cands, so victim search never walks evicted or freed pools.
  std::vector<int64_t> cands_;
  std::vector<int64_t> sample_;                  // scratch for sampled search
  std::vector<int64_t> walk_stack_, walk_nbrs_;  // scratch for the neighbourhood walks
  std::vector<int64_t> uf_parent_;
  std::vector<double> uf_cost_;
  int64_t evicted_pools_ = 0;
  std::vector<Frame> frames_;
  std::vector<int64_t> followed_;  // see followed()
  bool logging_ = false;
  std::vector<int64_t> log_;
  std::vector<uint64_t> visit_;  // per-pool epoch marks for neighbourhood walks
  uint64_t epoch_ = 0;
  std::vector<uint64_t> recipe_mark_;  // per-recipe epoch marks for pool_cost
  uint64_t recipe_epoch_ = 0;
  // Each pool's parents and children (pool_parents, pool_children), cached for the
  // neighbourhood walks: one victim decision walks the same evicted region from many
  // candidates, and a burst of evictions (make_room) changes no edges. graph_gen_ counts
  // changes to the graph (members, recipes, consumers, outputs); an entry is valid while
  // its stamp equals it. Residency is not part of an entry, so evictions and
  // recomputations keep the cache.
  struct Adjacency {
    uint64_t gen[2] = {0, 0};  // [parents, children]
    std::vector<int64_t> pools[2];
  };
  std::vector<Adjacency> adj_;
  uint64_t graph_gen_ = 1;
  bool sampling_ = false;  // choose() is scoring a sample (see root_adjacent)
};

}  // namespace dtr
