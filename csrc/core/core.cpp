// See core.h. Every function mirrors the method of the same name in dtr/core/reference.py.
#include "core/core.h"

#include <algorithm>
#include <cstdio>
#include <chrono>
#include <cmath>
#include <limits>
#include <stdexcept>
#include <tuple>
#include <unordered_map>
#include <utility>

namespace dtr {

namespace {
constexpr double kInf = std::numeric_limits<double>::infinity();

[[noreturn]] void fail(const std::string& msg) { throw std::runtime_error("dtr: " + msg); }

void remove_first(std::vector<int64_t>& v, int64_t x) {
  auto it = std::find(v.begin(), v.end(), x);
  if (it != v.end()) v.erase(it);
}

bool contains(const std::vector<int64_t>& v, int64_t x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}
}  // namespace

std::string format_bytes(int64_t nbytes) {
  if (nbytes < 1024) return std::to_string(nbytes) + " B";
  double v = static_cast<double>(nbytes);
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (v >= 1024 && u < 4) {
    v /= 1024;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f %s", v, units[u]);
  return buf;
}

const std::vector<std::string>& heuristic_names() {
  static const std::vector<std::string> names = {"dtr",      "dtr_eq",    "dtr_local", "lru",
                                                 "size",     "msps",      "random",    "msps_sqrt",
                                                 "dtr_held", "dtr_held34"};
  return names;
}

Core::Core(const std::string& heuristic_, int64_t budget_, uint64_t seed, int64_t min_evict_bytes_)
    : heuristic(heuristic_), budget(budget_), min_evict_bytes(min_evict_bytes_), rng_(seed) {
  const auto& names = heuristic_names();
  auto it = std::find(names.begin(), names.end(), heuristic_);
  if (it == names.end()) fail("unknown heuristic '" + heuristic_ + "'");
  h_ = static_cast<int>(it - names.begin());
}

// ------------------------------------------------------------------ access
const TensorRec& Core::T(int64_t tid) const {
  if (tid < 0 || tid >= static_cast<int64_t>(tensors_.size()) || !tensors_[tid].used)
    throw std::out_of_range("dtr: no tensor " + std::to_string(tid));
  return tensors_[tid];
}
TensorRec& Core::T(int64_t tid) { return const_cast<TensorRec&>(std::as_const(*this).T(tid)); }
const PoolRec& Core::P(int64_t pid) const {
  if (pid < 0 || pid >= static_cast<int64_t>(pools_.size()) || !pools_[pid].used)
    throw std::out_of_range("dtr: no pool " + std::to_string(pid));
  return pools_[pid];
}
PoolRec& Core::P(int64_t pid) { return const_cast<PoolRec&>(std::as_const(*this).P(pid)); }
const RecipeRec& Core::R(int64_t rid) const {
  if (rid < 0 || rid >= static_cast<int64_t>(recipes_.size()) || !recipes_[rid].used)
    throw std::out_of_range("dtr: no recipe " + std::to_string(rid));
  return recipes_[rid];
}
RecipeRec& Core::R(int64_t rid) { return const_cast<RecipeRec&>(std::as_const(*this).R(rid)); }

// ------------------------------------------------------------------ allocation
int64_t Core::new_tensor(int64_t pool, int64_t recipe, int64_t ext, bool mat) {
  graph_changed();
  int64_t tid;
  if (!free_t_.empty()) {
    tid = free_t_.back();
    free_t_.pop_back();
  } else {
    tid = static_cast<int64_t>(tensors_.size());
    tensors_.emplace_back();
  }
  TensorRec& t = tensors_[tid];
  reset(t);
  t.pool = pool;
  t.recipe = recipe;
  t.ext = ext;
  t.mat = mat;
  t.used = true;
  t.born = step;
  PoolRec& p = P(pool);
  p.members.push_back(tid);
  if (ext > 0) p.alive += 1;
  if (recipe < 0 && !p.constant) p.pinned += 1;
  return tid;
}

int64_t Core::new_pool(int64_t nbytes, bool resident, bool constant) {
  graph_changed();
  int64_t pid;
  if (!free_p_.empty()) {
    pid = free_p_.back();
    free_p_.pop_back();
  } else {
    pid = static_cast<int64_t>(pools_.size());
    pools_.emplace_back();
    visit_.push_back(0);
    adj_.emplace_back();
  }
  PoolRec& p = pools_[pid];
  reset(p);
  p.nbytes = nbytes;
  p.resident = resident;
  p.constant = constant;
  p.last_access = now;
  p.used = true;
  if (constant) const_bytes_ += nbytes;
  if (resident) {
    add_resident(nbytes);
    if (!constant) cand_add(pid, p);
  }
  return pid;
}

void Core::cand_add(int64_t pid, PoolRec& p) {
  p.slot = static_cast<int64_t>(cands_.size());
  cands_.push_back(pid);
}

void Core::cand_remove(PoolRec& p) {
  if (p.slot < 0) return;
  const int64_t last = cands_.back();
  cands_.pop_back();
  if (p.slot < static_cast<int64_t>(cands_.size())) {
    cands_[p.slot] = last;
    pools_[last].slot = p.slot;
  }
  p.slot = -1;
}

void Core::add_resident(int64_t nbytes) {
  resident_bytes += nbytes;
  if (resident_bytes > max_bytes) max_bytes = resident_bytes;
  if (resident_bytes > step_max_) step_max_ = resident_bytes;
}

void Core::note_need(const std::vector<int64_t>& inputs, const std::vector<int64_t>& kinds,
                     const std::vector<int64_t>& nbytes, const std::string& name) {
  int64_t need = 0;  // the distinct pools of its managed inputs
  for (size_t k = 0; k < inputs.size(); ++k) {
    const int64_t pid = tensors_[inputs[k]].pool;
    if (pools_[pid].constant) continue;
    bool seen = false;
    for (size_t q = 0; q < k && !seen; ++q) seen = tensors_[inputs[q]].pool == pid;
    if (!seen) need += pools_[pid].nbytes;
  }
  for (size_t k = 0; k < kinds.size(); ++k)  // and its fresh outputs
    if (kinds[k] == kNew) need += nbytes[k];
  last_need = pending_need_ = const_bytes_ + need;
  if (last_need > step_floor_bytes) step_floor_bytes = last_need;
  if (last_need > op_floor_bytes) {
    op_floor_bytes = last_need;
    floor_need_bytes = need;
    floor_op = name;
    floor_step = step;
  }
}

void Core::pool_cost(PoolRec& p) {
  // Summed in member order (the Python twin's order: the same float result). Recipes are
  // marked by epoch rather than collected: a pool with many views was quadratic, and
  // this runs for every output of every op.
  if (recipe_mark_.size() < recipes_.size()) recipe_mark_.resize(recipes_.size(), 0);
  const uint64_t mark = ++recipe_epoch_;
  double cost = 0.0;
  for (int64_t m : p.members) {
    int64_t r = tensors_[m].recipe;
    if (r >= 0 && recipe_mark_[r] != mark) {
      recipe_mark_[r] = mark;
      cost += recipes_[r].cost;
    }
  }
  p.cost = cost;
}

// Records go back to their defaults keeping their vectors' capacity: ids are reused
// (free lists), and freeing and reallocating those vectors was most of an op's cost in
// a replay. Each resets through the default record, so a field added later is reset too.
namespace {
template <typename Rec, typename... Vecs>
void reset_keeping(Rec& rec, Vecs Rec::*... vecs) {
  Rec fresh;
  ((fresh.*vecs = std::move(rec.*vecs), (fresh.*vecs).clear()), ...);
  rec = std::move(fresh);
}
}  // namespace

void Core::reset(TensorRec& t) { reset_keeping(t, &TensorRec::consumers); }

void Core::reset(PoolRec& p) { reset_keeping(p, &PoolRec::members); }

void Core::reset(RecipeRec& r) {
  reset_keeping(r, &RecipeRec::inputs, &RecipeRec::outputs, &RecipeRec::nbytes,
                &RecipeRec::version_of);
}

BudgetExceeded::BudgetExceeded(const std::string& msg, int64_t budget, int64_t constants,
                               std::string what, int64_t requested, const Core& core)
    : std::runtime_error(msg),
      budget(budget),
      constants(constants),
      requested(requested),
      what_for(std::move(what)),
      floor(core.op_floor_bytes),
      floor_need(core.floor_need_bytes),
      free_peak(core.free_peak_bytes),
      floor_op(core.floor_op),
      floor_in_step(core.floor_step == core.step) {}

// ------------------------------------------------------------------ recording
int64_t Core::new_constant(int64_t nbytes) {
  int64_t pid = new_pool(nbytes, true, true);
  return new_tensor(pid, -1, 1, true);
}

std::vector<int64_t> Core::record(const std::vector<int64_t>& inputs, double cost,
                                  const std::vector<int64_t>& kinds,
                                  const std::vector<int64_t>& refs,
                                  const std::vector<int64_t>& nbytes,
                                  const std::string& name) {
  graph_changed();
  if (refs.size() != kinds.size() || nbytes.size() != kinds.size())
    fail("record: kinds, refs and nbytes differ in length");
  for (int64_t i : inputs) T(i);
  if (!name.empty()) note_need(inputs, kinds, nbytes, name);
  ops += 1;
  int64_t rid = alloc_recipe(inputs, cost);
  for (int64_t i : inputs) {
    tensors_[i].consumers.push_back(rid);
    if (!request_stamps) pools_[tensors_[i].pool].last_access = now;
  }
  now += recipes_[rid].cost;
  const size_t n = kinds.size();
  std::vector<int64_t> outs(n, -1);
  recipes_[rid].nbytes.assign(n, 0);
  recipes_[rid].version_of.assign(n, -1);
  std::vector<std::pair<int64_t, int64_t>> moved;  // (old, new)
  // Versions first: a view returned by the same op is a view of the new value.
  for (size_t k = 0; k < n; ++k) {
    if (kinds[k] != kVersion) continue;
    T(refs[k]);
    outs[k] = version(refs[k], rid);
    moved.emplace_back(refs[k], outs[k]);
    recipes_[rid].nbytes[k] = pools_[tensors_[outs[k]].pool].nbytes;
    recipes_[rid].version_of[k] = refs[k];
  }
  // The pool's other held members follow each version into the new storage (after the
  // declared outputs): they alias the written one, as in eager.
  std::vector<std::pair<int64_t, int64_t>> followers;  // (old member, its new tensor)
  for (size_t k = 0; k < n; ++k)
    if (kinds[k] == kVersion) follow(refs[k], outs[k], rid, followers);
  moved.insert(moved.end(), followers.begin(), followers.end());
  for (size_t k = 0; k < n; ++k) {
    if (kinds[k] == kNew) {
      int64_t pid = new_pool(nbytes[k], true, false);
      outs[k] = new_tensor(pid, rid, 1, true);
      recipes_[rid].nbytes[k] = nbytes[k];
    } else if (kinds[k] == kView) {
      int64_t src = refs[k];
      if (src < 0) {  // -(j + 1): a view of this call's output j (j < k)
        const int64_t j = -src - 1;
        if (j >= static_cast<int64_t>(k) || outs[j] < 0)
          fail("record: output " + std::to_string(k) + " is a view of output " + std::to_string(j) +
               ", which is not an earlier one");
        src = outs[j];
      }
      for (const auto& m : moved)
        if (m.first == src) src = m.second;
      outs[k] = new_tensor(T(src).pool, rid, 1, true);
    } else if (kinds[k] != kVersion) {
      fail("bad output kind " + std::to_string(kinds[k]));
    }
  }
  recipes_[rid].pool_version = !followers.empty();
  followed_.clear();
  for (const auto& [m, follower] : followers) {
    outs.push_back(follower);
    recipes_[rid].nbytes.push_back(0);  // the version counts the pool's bytes
    recipes_[rid].version_of.push_back(-1);  // m is lineage only and may be dropped
    followed_.push_back(m);
  }
  for (int64_t tid : outs) {
    RecipeRec& r = recipes_[rid];
    r.outputs.push_back(tid);
    r.kept += 1;
    PoolRec& p = pools_[tensors_[tid].pool];
    p.last_access = now;
    pool_cost(p);
  }
  if (recipes_[rid].kept == 0) drop_recipe(rid);
  return outs;
}

int64_t Core::alloc_recipe(const std::vector<int64_t>& inputs, double cost) {
  int64_t rid;
  if (!free_r_.empty()) {
    rid = free_r_.back();
    free_r_.pop_back();
  } else {
    rid = static_cast<int64_t>(recipes_.size());
    recipes_.emplace_back();
  }
  RecipeRec& r = recipes_[rid];
  reset(r);
  r.inputs = inputs;
  r.cost = cost;
  r.used = true;
  return rid;
}

int64_t Core::version(int64_t old, int64_t rid) {
  graph_changed();
  // Invariant 4: the storage now holds the new value; every old member moves to a
  // fresh, evicted pool so that it is recomputed into new storage when needed.
  int64_t pid = tensors_[old].pool;
  int64_t ext_ = tensors_[old].ext;
  int64_t old_pid = new_pool(pools_[pid].nbytes, false, false);
  PoolRec& p = pools_[pid];
  PoolRec& op = pools_[old_pid];
  op.members = std::move(p.members);
  op.last_access = p.last_access;
  op.locks = p.locks;
  op.pinned = p.pinned;
  p.members.clear();
  p.locks = 0;
  p.pinned = 0;
  p.alive = 0;
  tensors_[old].ext = 0;
  for (int64_t m : op.members) {
    TensorRec& tm = tensors_[m];
    tm.pool = old_pid;
    if (tm.ext > 0) op.alive += 1;
    if (tm.mat) {
      tm.mat = false;
      evicted_.push_back(m);
    }
  }
  pool_cost(op);
  mark_evicted(old_pid);
  return new_tensor(pid, rid, ext_, true);
}

// A pool version (Invariant 4): the members of old's pool the program still holds (now
// in the old, evicted pool) become members of the new version's pool, made by the same
// recipe, and take their handles over; their old values keep their lineage.
void Core::follow(int64_t old, int64_t version, int64_t rid,
                  std::vector<std::pair<int64_t, int64_t>>& out) {
  const int64_t old_pid = tensors_[old].pool;
  const int64_t pid = tensors_[version].pool;
  const std::vector<int64_t> members = pools_[old_pid].members;
  for (int64_t m : members) {
    const int64_t ext_ = tensors_[m].ext;
    if (m == old || ext_ == 0) continue;
    tensors_[m].ext = 0;
    pools_[old_pid].alive -= 1;
    out.emplace_back(m, new_tensor(pid, rid, ext_, true));
  }
}

// ------------------------------------------------------------------ handles
void Core::retain(int64_t tid) {
  TensorRec& t = T(tid);
  if (t.ext == 0) {
    pools_[t.pool].alive += 1;
    pools_[t.pool].doomed = false;
  }
  t.ext += 1;
}

void Core::release(int64_t tid) {
  TensorRec& t = T(tid);
  if (t.ext <= 0) fail("release of tensor " + std::to_string(tid) + " with no handles");
  t.ext -= 1;
  if (t.ext == 0) {
    int64_t pid = t.pool;
    pools_[pid].alive -= 1;
    if (pools_[pid].alive == 0) pools_[pid].doomed = true;
    maybe_drop(tid);
    maybe_eager_evict(pid);
  }
}

void Core::lock(int64_t tid) {
  TensorRec& t = T(tid);
  t.lock += 1;
  PoolRec& p = pools_[t.pool];
  p.locks += 1;
  if (!request_stamps) p.last_access = now;
}

void Core::touch(int64_t tid) { pools_[T(tid).pool].last_access = now; }

void Core::unlock(int64_t tid) {
  TensorRec& t = T(tid);
  if (t.lock <= 0) fail("unlock of tensor " + std::to_string(tid) + " that is not locked");
  t.lock -= 1;
  int64_t pid = t.pool;
  pools_[pid].locks -= 1;
  if (t.lock == 0) maybe_drop(tid);
  maybe_eager_evict(pid);
}

void Core::resized(int64_t tid, int64_t nbytes) {
  PoolRec& p = pools_[T(tid).pool];
  if (!p.resident) fail("resized tensor " + std::to_string(tid) + ", which is not resident");
  graph_changed();
  add_resident(nbytes - p.nbytes);
  if (p.constant) const_bytes_ += nbytes - p.nbytes;
  p.nbytes = nbytes;
}

void Core::pin(int64_t tid) {
  graph_changed();
  if (tid < 0 || tid >= static_cast<int64_t>(tensors_.size()) || !tensors_[tid].used) return;
  TensorRec& t = tensors_[tid];
  int64_t rid = t.recipe;
  if (rid < 0) return;
  if (t.ext > 0 && !t.mat)
    fail("pin of tensor " + std::to_string(tid) + ", which is held but not materialized");
  RecipeRec& r = recipes_[rid];
  *std::find(r.outputs.begin(), r.outputs.end(), tid) = -1;
  r.kept -= 1;
  t.recipe = -1;
  PoolRec& p = pools_[t.pool];
  if (!p.constant) p.pinned += 1;
  pool_cost(p);
  if (r.kept == 0) drop_recipe(rid);
  maybe_drop(tid);
}

// ------------------------------------------------------------------ dropping
bool Core::droppable(const TensorRec& t) const {
  return t.used && t.ext == 0 && t.lock == 0 && t.consumers.empty();
}

void Core::maybe_drop(int64_t tid) {
  if (droppable(tensors_[tid])) drop({tid});
}

void Core::drop(std::vector<int64_t> stack) {
  // Iterative (Invariant 7): lineage chains can be long.
  while (!stack.empty()) {
    int64_t tid = stack.back();
    stack.pop_back();
    if (!droppable(tensors_[tid])) continue;
    graph_changed();
    TensorRec& t = tensors_[tid];
    int64_t pid = t.pool;
    PoolRec& p = pools_[pid];
    remove_first(p.members, tid);
    if (t.recipe >= 0) {
      int64_t rid = t.recipe;
      RecipeRec& r = recipes_[rid];
      *std::find(r.outputs.begin(), r.outputs.end(), tid) = -1;
      r.kept -= 1;
      if (r.kept == 0) {
        for (int64_t i : release_recipe(rid)) stack.push_back(i);
      }
    } else if (!p.constant) {
      p.pinned -= 1;
    }
    reset(t);
    dropped_t_.push_back(tid);
    if (pools_[pid].members.empty()) {
      free_pool(pid);
    } else {
      pool_cost(pools_[pid]);
      maybe_eager_evict(pid);
    }
  }
}

void Core::drop_recipe(int64_t rid) { drop(release_recipe(rid)); }

std::vector<int64_t> Core::release_recipe(int64_t rid) {
  graph_changed();
  RecipeRec& r = recipes_[rid];
  for (int64_t i : r.inputs) remove_first(tensors_[i].consumers, rid);
  dropped_r_.push_back(rid);
  std::vector<int64_t> out;
  for (int64_t i : r.inputs)
    if (droppable(tensors_[i])) out.push_back(i);
  reset(r);
  return out;
}

void Core::free_pool(int64_t pid) {
  graph_changed();
  PoolRec& p = pools_[pid];
  if (p.constant) const_bytes_ -= p.nbytes;
  if (p.resident) {
    resident_bytes -= p.nbytes;
    cand_remove(p);
  } else if (p.uf >= 0) {
    uf_leave(p);
  }
  reset(p);
  dropped_p_.push_back(pid);
}

std::tuple<std::vector<int64_t>, std::vector<int64_t>, std::vector<int64_t>> Core::drain() {
  std::vector<int64_t> ev, dt, dr;
  ev.swap(evicted_);
  dt.swap(dropped_t_);
  dr.swap(dropped_r_);
  free_t_.insert(free_t_.end(), dt.begin(), dt.end());
  free_r_.insert(free_r_.end(), dr.begin(), dr.end());
  free_p_.insert(free_p_.end(), dropped_p_.begin(), dropped_p_.end());
  dropped_p_.clear();
  return {std::move(ev), std::move(dt), std::move(dr)};
}

void Core::reserve(int64_t n) {
  const size_t k = static_cast<size_t>(std::max<int64_t>(n, 0));
  tensors_.reserve(k);
  pools_.reserve(k);
  recipes_.reserve(k);
  visit_.reserve(k);
  adj_.reserve(k);
}

void Core::drain_discard() {
  evicted_.clear();
  free_t_.insert(free_t_.end(), dropped_t_.begin(), dropped_t_.end());
  free_r_.insert(free_r_.end(), dropped_r_.begin(), dropped_r_.end());
  free_p_.insert(free_p_.end(), dropped_p_.begin(), dropped_p_.end());
  dropped_t_.clear();
  dropped_r_.clear();
  dropped_p_.clear();
}

// ------------------------------------------------------------------ eviction
bool Core::evictable(const PoolRec& p) const {
  return p.used && p.resident && !p.constant && p.pinned == 0 && p.locks == 0 && p.nbytes > 0;
}

void Core::maybe_eager_evict(int64_t pid) {
  if (pid < 0 || pid >= static_cast<int64_t>(pools_.size())) return;
  // Only pools the program let go of: tensors rebuilt for lineage stay resident until a
  // heuristic picks them (they are often needed again at once).
  const PoolRec& p = pools_[pid];
  if (p.used && p.doomed && p.alive == 0 && evictable(p)) {
    evict(pid);
    eager_evictions += 1;
  }
}

void Core::evict(int64_t pid) {
  PoolRec& p = pools_[pid];
  p.resident = false;
  p.doomed = false;
  resident_bytes -= p.nbytes;
  cand_remove(p);
  for (int64_t m : p.members) {
    TensorRec& t = tensors_[m];
    if (t.mat) {
      t.mat = false;
      evicted_.push_back(m);
    }
  }
  mark_evicted(pid);
}

bool Core::make_room(int64_t extra) {
  if (budget >= 0) {
    while (resident_bytes + extra > budget) {
      int64_t v = choose();
      if (v < 0) return false;
      evict(v);
      evictions += 1;
      if (logging_) log_.push_back(v);
    }
  }
  if (resident_bytes > peak_bytes) peak_bytes = resident_bytes;
  return true;
}

int64_t Core::evict_all() {
  int64_t n = 0;
  for (int64_t pid = 0; pid < static_cast<int64_t>(pools_.size()); ++pid) {
    if (evictable(pools_[pid])) {
      evict(pid);
      evictions += 1;
      n += 1;
    }
  }
  return n;
}

int64_t Core::choose() {
  const auto start = std::chrono::steady_clock::now();
  const int64_t n = static_cast<int64_t>(cands_.size());
  int64_t best = -1;
  if (search_sample > 0 && search_sample < n) {
    // Sampled search: the best of k candidates drawn uniformly (with repetition), O(k)
    // per decision however many pools are resident; exact when no sample is evictable.
    sample_.resize(search_sample);
    for (int64_t i = 0; i < search_sample; ++i)
      sample_[i] = cands_[next_random() % static_cast<uint64_t>(n)];
    sampling_ = true;
    best = best_of(sample_);
    sampling_ = false;
  }
  if (best < 0) best = best_of(cands_);
  search_seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  return best;
}

// The lowest-scoring eligible pool of pids. Exact ties (every op of a chain costs the
// same; under the roofline cost model every memory-bound op costs in proportion to its
// bytes, so msps's cost / size ties across them) go to the pool that frees more, then
// to the one whose recomputation is cheaper (the score's numerator: of two equal rates,
// the smaller bill), then to the smallest pid, so the choice does not depend on the order
// of pids. The smallest pid alone put dtr 18.5% above Checkmate's optimum on the 8-op
// chain at 0.4; this order keeps every heuristic within 8% of it wherever the MILP
// solved, and changes no dtr, dtr_eq or dtr_held run of the sweep (docs/heuristics.md).
int64_t Core::best_of(const std::vector<int64_t>& pids) {
  if (h_ == kRandom) {
    std::vector<int64_t> ok;
    for (int64_t pid : pids)
      if (eligible(pools_[pid])) ok.push_back(pid);
    std::sort(ok.begin(), ok.end());
    ok.erase(std::unique(ok.begin(), ok.end()), ok.end());
    if (ok.empty()) return -1;
    return ok[next_random() % ok.size()];
  }
  int64_t best = -1;
  double best_score = kInf, best_cost = kInf, best_bytes = 0;
  for (int64_t pid : pids) {
    const PoolRec& p = pools_[pid];
    if (!eligible(p)) continue;
    double cost = 0;
    const double s = score(pid, p, best_score, cost);
    const double bytes = static_cast<double>(p.nbytes);
    bool wins = best < 0 || s < best_score;
    if (!wins && s == best_score) {
      wins = bytes > best_bytes ||
             (bytes == best_bytes && (cost < best_cost || (cost == best_cost && pid < best)));
    }
    if (wins) {
      best = pid;
      best_score = s;
      best_cost = cost;
      best_bytes = bytes;
    }
  }
  return best;
}

// The pool's score; a neighbourhood walk stops once the score is known to be > bound
// (it cannot win or tie then: costs are non-negative and float sums of them only grow),
// which keeps the choice exact while skipping most of the walking.
double Core::score(int64_t pid, const PoolRec& p, double bound, double& cost) {
  const double m = static_cast<double>(p.nbytes);
  const double stale = now - p.last_access;
  cost = 1.0;  // size and lru: no cost term
  if (h_ == kSize) return m > 0 ? 1.0 / m : kInf;
  if (h_ == kMSPS) {
    if (m <= 0) return kInf;
    cost = neighborhood(pid, true, false, p.cost, m, bound);
    return cost / m;
  }
  if (h_ == kMSPSSqrt) {
    if (m <= 0 || stale <= 0) return kInf;
    const double d = m * std::sqrt(stale);
    cost = neighborhood(pid, true, false, p.cost, d, bound);
    return cost / d;
  }
  if (h_ == kDTRHeld34) {
    // dtr_held with staleness^(3/4): an old activation waiting for backward is still the
    // likelier victim, but its recomputation cost and size weigh more against its age
    // than under h_DTR's linear staleness. sqrt(s) * sqrt(sqrt(s)) rounds the same in the
    // Python twin (pow need not). The exponent was chosen from the sweep: every value in
    // 0.6 .. 0.8 passes the acceptance rule for a heuristic of our own, 0.5 and 0.85 do
    // not (docs/heuristics.md).
    if (m <= 0 || stale <= 0) return kInf;
    const double root = std::sqrt(stale);
    const double d = m * (root * std::sqrt(root));
    cost = neighborhood(pid, true, true, p.cost, d, bound, true);
    return cost / d;
  }
  const double denom = m * stale;
  if (h_ == kLRU) return stale > 0 ? 1.0 / stale : kInf;
  if (denom <= 0) return kInf;
  if (h_ == kDTR || h_ == kDTRHeld) {
    cost = neighborhood(pid, true, true, p.cost, denom, bound, h_ == kDTRHeld);
  } else if (h_ == kDTREq) {
    cost = p.cost + eq_neighbors(pid);
  } else {
    cost = p.cost;
  }
  return cost / denom;
}

// ------------------------------------------------------------------ neighbourhoods
void Core::pool_parents(int64_t pid, std::vector<int64_t>& out) const {
  out.clear();
  for (int64_t m : pools_[pid].members) {
    int64_t r = tensors_[m].recipe;
    if (r >= 0)
      for (int64_t i : recipes_[r].inputs) out.push_back(tensors_[i].pool);
  }
}

void Core::pool_children(int64_t pid, std::vector<int64_t>& out) const {
  out.clear();
  for (int64_t m : pools_[pid].members)
    for (int64_t r : tensors_[m].consumers)
      for (int64_t o : recipes_[r].outputs)
        if (o >= 0) out.push_back(tensors_[o].pool);
}

const std::vector<int64_t>& Core::adjacent(int64_t pid, int direction) {
  Adjacency& a = adj_[pid];
  if (a.gen[direction] != graph_gen_) {
    if (direction == 0) {
      pool_parents(pid, a.pools[0]);
    } else {
      pool_children(pid, a.pools[1]);
    }
    a.gen[direction] = graph_gen_;
  }
  return a.pools[direction];
}

// A candidate's own edges: cached when every candidate is scored (an exact search
// scores the same ones again at the next decision of a burst), read afresh when a
// sampled search draws them (most are met once, and filling their entries cost more
// than it saved: 1e6 live tensors, 40% slower decisions).
const std::vector<int64_t>& Core::root_adjacent(int64_t pid, int direction) {
  if (!sampling_) return adjacent(pid, direction);
  if (direction == 0) {
    pool_parents(pid, walk_nbrs_);
  } else {
    pool_children(pid, walk_nbrs_);
  }
  return walk_nbrs_;
}

double Core::neighborhood(int64_t pid, bool up, bool down, double total, double denom, double bound,
                          bool held) {
  std::vector<int64_t>& stack = walk_stack_;  // scratch: no allocation per score
  for (int direction = 0; direction < 2; ++direction) {
    if ((direction == 0 && !up) || (direction == 1 && !down)) continue;
    const uint64_t mark = ++epoch_;
    visit_[pid] = mark;
    stack.assign(1, pid);
    while (!stack.empty()) {
      int64_t q = stack.back();
      stack.pop_back();
      for (int64_t nb : q == pid ? root_adjacent(q, direction) : adjacent(q, direction)) {
        if (visit_[nb] == mark) continue;
        visit_[nb] = mark;
        const PoolRec& pn = pools_[nb];
        if (pn.resident) continue;
        stack.push_back(nb);
        // dtr_held: below the pool's own children, an evicted descendant the program
        // no longer holds is walked through (it leads to held ones) but not counted. A
        // backward pass leaves whole released regions evicted below the early layers;
        // counted, they make those layers' activations look too dear ever to evict.
        if (held && direction == 1 && pn.alive == 0 && q != pid) continue;
        total += pn.cost;
        if (total / denom > bound) return total;
      }
    }
  }
  return total;
}

int64_t Core::uf_find(int64_t x) {
  int64_t root = x;
  while (uf_parent_[root] != root) root = uf_parent_[root];
  while (uf_parent_[x] != root) {
    int64_t next = uf_parent_[x];
    uf_parent_[x] = root;
    x = next;
  }
  return root;
}

void Core::mark_evicted(int64_t pid) {
  if (h_ != kDTREq) return;
  evicted_pools_ += 1;
  PoolRec& p = pools_[pid];
  int64_t node = static_cast<int64_t>(uf_parent_.size());
  uf_parent_.push_back(node);
  uf_cost_.push_back(p.cost);
  p.uf = node;
  for (int direction = 0; direction < 2; ++direction)
    for (int64_t nb : adjacent(pid, direction)) {
      const PoolRec& pn = pools_[nb];
      if (nb == pid || pn.resident || pn.uf < 0) continue;
      int64_t a = uf_find(pn.uf), b = uf_find(node);
      if (a != b) {
        uf_parent_[a] = b;
        uf_cost_[b] += uf_cost_[a];
      }
    }
}

void Core::uf_leave(PoolRec& p) {
  // Union-find cannot split: the pool's cost leaves its class, the node stays.
  int64_t root = uf_find(p.uf);
  uf_cost_[root] -= p.cost;
  p.uf = -1;
  evicted_pools_ -= 1;
  if (evicted_pools_ == 0) {
    uf_parent_.clear();
    uf_cost_.clear();
  }
}

double Core::eq_neighbors(int64_t pid) {
  std::vector<int64_t>& roots = walk_stack_;  // scratch: no allocation per score
  roots.clear();
  double total = 0.0;
  for (int direction = 0; direction < 2; ++direction)
    for (int64_t nb : root_adjacent(pid, direction)) {
      const PoolRec& pn = pools_[nb];
      if (nb == pid || pn.resident || pn.uf < 0) continue;
      int64_t r = uf_find(pn.uf);
      if (!contains(roots, r)) {
        roots.push_back(r);
        total += uf_cost_[r];
      }
    }
  return total;
}

uint64_t Core::next_random() {
  // splitmix64, identical in the Python twin.
  rng_ += 0x9E3779B97F4A7C15ULL;
  uint64_t z = rng_;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

// ------------------------------------------------------------------ rematerialization
// Rematerialization walks a stack of frames, one per tensor being rebuilt (Invariant 7:
// iterative, never recursive). A frame locks an input only once it is known to be
// materialized: a child it rebuilt is locked for it as the child finishes, and inputs that
// were already resident are locked only when the frame's recipe is about to run. Until then
// they may be evicted (and are rebuilt if they were), so a long chain does not pin every
// side input along it. Each frame gains a lock per finished child, so the walk terminates.
void Core::remat_begin(int64_t tid) {
  T(tid);
  if (!frames_.empty()) fail("a rematerialization is already in progress");
  frames_.push_back(Frame{tid, {}});
}

int64_t Core::remat_step() {
  while (!frames_.empty()) {
    const int64_t tid = frames_.back().tid;
    const TensorRec& t = tensors_[tid];
    if (t.mat) {
      pop_frame();
      continue;
    }
    if (t.recipe < 0) fail("tensor " + std::to_string(tid) + " is evicted and has no recipe");
    const int64_t rid = t.recipe;
    if (request_stamps && !frames_.back().seen) {  // the rerun is requested: stamp its inputs
      frames_.back().seen = true;
      for (int64_t i : recipes_[rid].inputs) pools_[tensors_[i].pool].last_access = now;
    }
    // The first evicted input, but one whose recipe reads inputs before one that reads
    // none: a rebuilt input stays locked for its parent while its siblings are rebuilt,
    // and rebuilding a factory's output (torch.sparse.mm's zeros, dtr/engines/subclass/rebuildable_plain.py) first
    // held it through the whole chain below its sibling, one per layer of a graph
    // network: infeasible at any budget below its peak.
    int64_t missing = -1;
    for (int64_t i : recipes_[rid].inputs) {
      if (tensors_[i].mat) continue;
      if (missing < 0) missing = i;
      const int64_t r = tensors_[i].recipe;
      if (r >= 0 && !recipes_[r].inputs.empty()) {
        missing = i;
        break;
      }
    }
    if (missing >= 0) {
      frames_.push_back(Frame{missing, {}});
      continue;
    }
    if (thrashing()) {
      // a program that catches the error starts a new allowance
      const std::string msg = thrash_message();
      step_remats_ = remats;
      throw BudgetExceeded(msg);
    }
    Frame& f = frames_.back();
    std::vector<int64_t> held = f.locks;
    const std::vector<int64_t> inputs = recipes_[rid].inputs;
    for (int64_t i : inputs) {
      auto it = std::find(held.begin(), held.end(), i);
      if (it != held.end()) {
        held.erase(it);
      } else {
        lock(i);
        f.locks.push_back(i);
      }
    }
    return rid;
  }
  return -1;
}

void Core::pop_frame() {
  Frame f = std::move(frames_.back());
  frames_.pop_back();
  if (!frames_.empty()) {  // lock the finished child for its parent before letting go
    lock(f.tid);
    frames_.back().locks.push_back(f.tid);
  }
  for (int64_t i : f.locks) unlock(i);
}

void Core::remat_abort() {
  std::vector<Frame> frames;
  frames.swap(frames_);
  for (const Frame& f : frames)
    for (int64_t i : f.locks) unlock(i);
}

std::vector<int64_t> Core::steals(int64_t rid) const {
  const RecipeRec& r = R(rid);
  std::vector<int64_t> out;
  for (size_t k = 0; k < r.version_of.size(); ++k) {
    int64_t old = r.version_of[k];
    if (old < 0 || r.outputs[k] < 0) continue;
    const TensorRec& t = tensors_[old];
    const PoolRec& p = pools_[t.pool];
    if (!(t.mat && t.ext == 0 && t.lock == 1 && p.pinned == 0 && !p.constant)) continue;
    // A pool version's old members (their handles went to the followers) are lineage
    // only: the storage is theirs to give up unless a rebuild has one locked.
    bool alone = true;
    for (int64_t m : p.members)
      if (m != old && (r.pool_version ? tensors_[m].lock > 0 || tensors_[m].ext > 0
                                      : tensors_[m].mat))
        alone = false;
    if (alone) out.push_back(static_cast<int64_t>(k));
  }
  return out;
}

int64_t Core::remat_bytes(int64_t rid) const {
  const RecipeRec& r = R(rid);
  const std::vector<int64_t> stolen = steals(rid);
  int64_t total = 0;
  for (size_t k = 0; k < r.nbytes.size(); ++k)
    if (!contains(stolen, static_cast<int64_t>(k))) total += r.nbytes[k];
  return total;
}

void Core::remat_done(int64_t rid, const std::vector<int64_t>& nbytes,
                      const std::vector<int64_t>& stolen) {
  R(rid);
  remats += 1;
  remat_cost += recipes_[rid].cost;
  now += recipes_[rid].cost;
  for (int64_t k : stolen) {
    int64_t old = recipes_[rid].version_of.at(k);
    TensorRec& t = tensors_[old];
    PoolRec& p = pools_[t.pool];
    for (int64_t m : p.members)  // old, then what a pool version's steal gave up
      if (m == old || tensors_[m].mat) {
        tensors_[m].mat = false;
        evicted_.push_back(m);
      }
    p.resident = false;
    resident_bytes -= p.nbytes;
    cand_remove(p);
    mark_evicted(t.pool);
  }
  const std::vector<int64_t> outputs = recipes_[rid].outputs;
  for (size_t k = 0; k < outputs.size(); ++k) {
    int64_t o = outputs[k];
    if (o < 0) continue;
    TensorRec& t = tensors_[o];
    if (t.mat) continue;
    PoolRec& p = pools_[t.pool];
    if (!p.resident) {
      if (k < nbytes.size() && nbytes[k] > 0) p.nbytes = nbytes[k];
      p.resident = true;
      if (p.uf >= 0) uf_leave(p);
      add_resident(p.nbytes);
      if (!p.constant) cand_add(t.pool, p);
    }
    t.mat = true;
    if (!request_stamps) p.last_access = now;
  }
  if (!request_stamps)
    for (int64_t i : recipes_[rid].inputs) pools_[tensors_[i].pool].last_access = now;
}

// ------------------------------------------------------------------ queries
bool Core::is_private(int64_t tid) const { return can_version(tid) && P(T(tid).pool).alive == 1; }

bool Core::can_version(int64_t tid) const {
  const TensorRec& t = T(tid);
  const PoolRec& p = pools_[t.pool];
  return !p.constant && p.pinned == 0 && t.recipe >= 0 && t.ext > 0;
}


std::vector<int64_t> Core::descendants(const std::vector<int64_t>& seeds) const {
  std::vector<char> seen(tensors_.size(), 0);
  for (int64_t s : seeds) {
    T(s);
    seen[s] = 1;
  }
  std::vector<int64_t> out;
  std::vector<int64_t> stack(seeds.begin(), seeds.end());
  while (!stack.empty()) {
    int64_t t = stack.back();
    stack.pop_back();
    for (int64_t r : tensors_[t].consumers)
      for (int64_t o : recipes_[r].outputs)
        if (o >= 0 && !seen[o]) {
          seen[o] = 1;
          out.push_back(o);
          stack.push_back(o);
        }
  }
  return out;
}

// A value carried from step to step (a running mean of the loss) reads the previous
// step's, so its lineage would grow by a step's ops every step, with the evictions and
// recomputations that walk it. A held tensor whose recomputable ancestors include one
// recorded in an earlier step is cut here; lineage that stays within one step (the
// graph of a model still awaiting its backward) is left as it is.
std::vector<int64_t> Core::end_step() {
  // Per tensor: 0 not seen, 1 being walked, 2 its lineage stays in this step, 3 it does
  // not. A post-order walk (Invariant 7), each recomputable tensor visited once.
  std::vector<char> state(tensors_.size(), 0);
  std::vector<std::pair<int64_t, size_t>> stack;
  auto old_lineage = [&](int64_t root) {
    if (state[root] < 2) {
      state[root] = 1;
      stack.assign(1, {root, 0});
    }
    while (!stack.empty()) {
      const int64_t x = stack.back().first;
      const std::vector<int64_t>& inputs = recipes_[tensors_[x].recipe].inputs;
      size_t& k = stack.back().second;
      char result = 2;
      for (; k < inputs.size(); ++k) {
        const int64_t i = inputs[k];
        const TensorRec& in = tensors_[i];
        if (in.recipe < 0 || pools_[in.pool].constant) continue;  // a root of lineage
        if (in.born < step || state[i] == 3) {
          result = 3;
          break;
        }
        if (state[i] == 0) {
          result = 0;  // walk the input first, then look at it again
          break;
        }
      }
      if (result == 0) {
        const int64_t i = inputs[k];
        state[i] = 1;
        stack.emplace_back(i, 0);
        continue;
      }
      state[x] = result;
      stack.pop_back();
    }
    return state[root] == 3;
  };
  std::vector<int64_t> out;
  for (int64_t tid = 0; tid < static_cast<int64_t>(tensors_.size()); ++tid) {
    const TensorRec& t = tensors_[tid];
    if (!t.used || t.ext == 0 || t.recipe < 0 || pools_[t.pool].constant) continue;
    if (old_lineage(tid)) out.push_back(tid);
  }
  step += 1;
  prev_ops_ = ops - step_ops_;
  prev_peak_ = peak_bytes;
  step_ops_ = ops;
  step_remats_ = remats;
  if (evictions == step_evictions_ && step_max_ > free_peak_bytes) free_peak_bytes = step_max_;
  step_evictions_ = evictions;
  step_max_ = resident_bytes;
  step_floor_bytes = 0;
  return out;
}

bool Core::thrashing() const {
  if (!(thrash > 1.0)) return false;
  const int64_t base = std::max({ops - step_ops_, prev_ops_, kThrashFloor});
  return static_cast<double>(remats - step_remats_) >= (thrash - 1.0) * static_cast<double>(base);
}

std::string Core::thrash_message() const {
  char factor[32];
  std::snprintf(factor, sizeof factor, "%g", thrash);
  std::string previous = prev_ops_ < 0 ? "no step completed yet"
                                       : "the previous step had " + std::to_string(prev_ops_) +
                                             " ops and peaked at " + format_bytes(prev_peak_);
  return "dtr: cannot stay within the memory budget of " +
         (budget >= 0 ? format_bytes(budget) : std::string("unlimited")) +
         ": recomputation is running away, " + std::to_string(remats - step_remats_) +
         " recomputations in this step against its " + std::to_string(ops - step_ops_) +
         " ops (" + previous + "), past the thrash limit (thrash=" + factor +
         ": at most thrash - 1 recomputations per op, counted against at least " +
         std::to_string(kThrashFloor) + " ops); " + format_bytes(resident_bytes) +
         " resident, " + format_bytes(pinned_bytes()) +
         " pinned. The budget is too small for this program: raise it (to at least the "
         "peak of a step that completed without this stop), or pass thrash=0 (DTR_THRASH=0) "
         "to recompute without limit.";
}

std::vector<int64_t> Core::alive() const {
  std::vector<int64_t> out;
  for (int64_t tid = 0; tid < static_cast<int64_t>(tensors_.size()); ++tid) {
    const TensorRec& t = tensors_[tid];
    if (t.used && t.ext > 0 && !pools_[t.pool].constant) out.push_back(tid);
  }
  return out;
}

int64_t Core::pinned_bytes() const {
  int64_t total = 0;
  for (const PoolRec& p : pools_)
    if (p.used && p.resident && (p.constant || p.pinned > 0)) total += p.nbytes;
  return total;
}

int64_t Core::constant_bytes() const { return const_bytes_; }

int64_t Core::locked_bytes() const {
  int64_t total = 0;
  for (const PoolRec& p : pools_)
    if (p.used && p.resident && !p.constant && p.pinned == 0 && p.locks > 0) total += p.nbytes;
  return total;
}

std::vector<std::pair<int64_t, int64_t>> Core::largest_pinned(int64_t k) const {
  std::vector<std::pair<int64_t, int64_t>> rows;  // (nbytes, tid)
  for (const PoolRec& p : pools_)
    if (p.used && p.resident && !p.members.empty() && (p.constant || p.pinned > 0 || p.locks > 0))
      rows.emplace_back(p.nbytes, p.members[0]);
  std::sort(rows.begin(), rows.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  std::vector<std::pair<int64_t, int64_t>> out;
  for (int64_t i = 0; i < k && i < static_cast<int64_t>(rows.size()); ++i)
    out.emplace_back(rows[i].second, rows[i].first);
  return out;
}

std::tuple<int64_t, int64_t, int64_t> Core::counts() const {
  int64_t nt = 0, np = 0, nr = 0;
  for (const auto& t : tensors_) nt += t.used;
  for (const auto& p : pools_) np += p.used;
  for (const auto& r : recipes_) nr += r.used;
  return {nt, np, nr};
}

void Core::check() const {
  int64_t resident = 0, constants = 0;
  for (int64_t pid = 0; pid < static_cast<int64_t>(pools_.size()); ++pid) {
    const PoolRec& p = pools_[pid];
    if (!p.used) continue;
    if (p.resident) resident += p.nbytes;
    if (p.constant) constants += p.nbytes;
    int64_t alive_ = 0, locks = 0, pinned = 0;
    for (int64_t m : p.members) {
      const TensorRec& t = tensors_[m];
      alive_ += t.ext > 0;
      locks += t.lock;
      if (!p.constant) pinned += t.recipe < 0;
      if (t.pool != pid) fail("tensor " + std::to_string(m) + " not in its pool");
      if (t.mat && !p.resident)
        fail("tensor " + std::to_string(m) + " materialized in evicted pool");
    }
    if (alive_ != p.alive || locks != p.locks || pinned != p.pinned)
      fail("pool " + std::to_string(pid) + " counters out of date");
  }
  if (resident != resident_bytes) fail("resident byte count out of date");
  if (constants != const_bytes_) fail("constant byte count out of date");
  std::vector<int64_t> want, have(cands_);
  for (int64_t pid = 0; pid < static_cast<int64_t>(pools_.size()); ++pid) {
    const PoolRec& p = pools_[pid];
    if (p.used && p.resident && !p.constant) want.push_back(pid);
  }
  for (size_t k = 0; k < cands_.size(); ++k)
    if (pools_[cands_[k]].slot != static_cast<int64_t>(k)) want.push_back(-1);
  std::sort(have.begin(), have.end());
  if (have != want) fail("victim candidate list out of step with resident pools");
  for (int64_t rid = 0; rid < static_cast<int64_t>(recipes_.size()); ++rid) {
    const RecipeRec& r = recipes_[rid];
    if (!r.used) continue;
    int64_t kept = 0;
    for (int64_t o : r.outputs) kept += o >= 0;
    if (kept != r.kept || r.kept == 0) fail("recipe " + std::to_string(rid) + " kept count");
    for (int64_t i : r.inputs)
      if (!tensors_[i].used || !contains(tensors_[i].consumers, rid))
        fail("recipe " + std::to_string(rid) + " input lost");
  }
}

}  // namespace dtr
