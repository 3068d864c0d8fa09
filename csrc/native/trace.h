// The native engine's operator trace: the lines dtr/engines/subclass/trace.py's TraceWriter writes for the
// subclass engine (the format is described there), for the same core calls, so that
// dtr.sim replays a native run as it replays a subclass one. Tensors are named by a
// serial number given when the core first names them (core ids are reused).
#pragma once

#include <cstdint>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "core/core.h"

namespace dtr {
namespace native {

class Trace {
 public:
  // Opens path (plain text; dtr.engines.native.session compresses a .gz afterwards) and writes START.
  Trace(const std::string& path, const std::string& heuristic, int64_t budget,
        const std::string& cost_model, bool stress, int64_t search_sample, uint64_t seed,
        int64_t min_evict_bytes)
      : f_(std::fopen(path.c_str(), "w")) {
    if (f_ == nullptr) throw std::runtime_error("dtr: cannot write the trace to " + path);
    line("{\"INSTRUCTION\":\"ANNOTATE\",\"ANNOTATION\":\"START\",\"DTR\":\"1\",\"HEURISTIC\":" +
         quote(heuristic) + ",\"BUDGET\":" + quote(std::to_string(budget)) +
         ",\"COST_MODEL\":" + quote(cost_model) + ",\"STRESS\":\"" + (stress ? "1" : "0") +
         "\",\"SEARCH_SAMPLE\":" + quote(std::to_string(search_sample)) +
         ",\"SEED\":" + quote(std::to_string(seed)) +
         ",\"MIN_EVICT_BYTES\":" + quote(std::to_string(min_evict_bytes)) + "}");
  }
  ~Trace() { close(); }
  Trace(const Trace&) = delete;
  Trace& operator=(const Trace&) = delete;

  // A core id that names a new tensor from now on.
  void name(int64_t tid) {
    if (static_cast<int64_t>(serial_.size()) <= tid) serial_.resize(tid + 1, -1);
    serial_[tid] = next_++;
  }
  std::string label(int64_t tid) const {
    if (tid < 0 || tid >= static_cast<int64_t>(serial_.size()) || serial_[tid] < 0)
      throw std::logic_error("dtr: the native trace met a tensor it never named");
    return quote("x" + std::to_string(serial_[tid]));
  }

  void phase(bool in_backward) {  // marks the first op of each backward pass
    if (in_backward && !in_backward_)
      line("{\"INSTRUCTION\":\"ANNOTATE\",\"ANNOTATION\":\"BACKWARD\"}");
    in_backward_ = in_backward;
  }
  void constant(int64_t tid, int64_t nbytes) {
    name(tid);
    line("{\"INSTRUCTION\":\"CONSTANT\",\"NAME\":" + label(tid) + "}");
    memory(tid, nbytes);
  }
  void inputs(const std::vector<int64_t>& tids, int64_t reserve) {
    std::string s = "{\"INSTRUCTION\":\"INPUTS\",\"ARGS\":" + labels(tids);
    if (reserve > 0) s += ",\"RESERVE\":" + quote(std::to_string(reserve));
    line(s + "}");
  }
  void invalidate(const std::vector<int64_t>& tids) {
    line("{\"INSTRUCTION\":\"INVALIDATE\",\"ARGS\":" + labels(tids) + "}");
  }
  // One recorded op (kinds: dtr::kNew / kView / kVersion, then kFollow for a pool
  // version's followers; alias: -1 fresh, else the index in args of what it views or
  // updates, or args.size() + j for result j: the version a follower follows).
  void call(const std::string& op, const std::vector<int64_t>& args,
            const std::vector<int64_t>& results, double cost, const std::vector<int64_t>& kinds,
            const std::vector<int64_t>& aliases, const std::vector<int64_t>& nbytes,
            const std::vector<int64_t>& fresh) {
    for (int64_t t : results) name(t);
    char cost_repr[40];
    std::snprintf(cost_repr, sizeof cost_repr, "%.17g", cost);
    line("{\"INSTRUCTION\":\"CALL\",\"NAME\":" + quote(op) + ",\"ARGS\":" + labels(args) +
         ",\"RESULT\":" + labels(results) +
         ",\"TIME\":" + quote(std::to_string(static_cast<int64_t>(cost * 1e9))) +
         ",\"COST\":" + quote(cost_repr) + ",\"FRESH\":" + labels(fresh) + "}");
    for (size_t j = 0; j < results.size(); ++j) {
      memory(results[j], nbytes[j]);
      line("{\"INSTRUCTION\":\"ALIAS\",\"NAME\":" + label(results[j]) +
           ",\"ALIAS\":" + quote(std::to_string(aliases[j])) +
           (kinds[j] == kVersion   ? ",\"VERSION\":\"1\"}"
            : kinds[j] == kFollow ? ",\"FOLLOWS\":\"1\"}"
                                  : "}"));
    }
  }
  void budget(int64_t nbytes) {  // session.set_budget(): the budget from the next op on
    line("{\"INSTRUCTION\":\"ANNOTATE\",\"ANNOTATION\":\"BUDGET\",\"BUDGET\":" +
         quote(std::to_string(nbytes)) + "}");
  }
  void release(int64_t tid) { line("{\"INSTRUCTION\":\"RELEASE\",\"NAME\":" + label(tid) + "}"); }
  void exported(int64_t tid) { line("{\"INSTRUCTION\":\"EXPORT\",\"NAME\":" + label(tid) + "}"); }
  // tid handed out as its new version `version` (Runtime.export)
  void exported(int64_t tid, int64_t version) {
    name(version);
    line("{\"INSTRUCTION\":\"EXPORT\",\"NAME\":" + label(tid) + ",\"VERSION\":" +
         label(version) + "}");
  }
  void read(int64_t tid) { line("{\"INSTRUCTION\":\"READ\",\"NAME\":" + label(tid) + "}"); }
  void close() {
    if (f_ == nullptr) return;
    line("{\"INSTRUCTION\":\"ANNOTATE\",\"ANNOTATION\":\"END\"}");
    std::fclose(f_);
    f_ = nullptr;
  }

 private:
  static std::string quote(const std::string& s) {
    std::string out = "\"";
    for (char c : s) {
      if (c == '"' || c == '\\') out += '\\';
      out += c;
    }
    return out + "\"";
  }
  std::string labels(const std::vector<int64_t>& tids) const {
    std::string s = "[";
    for (size_t i = 0; i < tids.size(); ++i) s += (i ? "," : "") + label(tids[i]);
    return s + "]";
  }
  void memory(int64_t tid, int64_t nbytes) {
    line("{\"INSTRUCTION\":\"MEMORY\",\"NAME\":" + label(tid) +
         ",\"MEMORY\":" + quote(std::to_string(nbytes)) + "}");
  }
  void line(const std::string& s) {
    if (f_ == nullptr) return;
    std::fputs(s.c_str(), f_);
    std::fputc('\n', f_);
  }

  std::FILE* f_;
  std::vector<int64_t> serial_;  // per core id: the serial of the tensor it names now
  int64_t next_ = 0;
  bool in_backward_ = false;
};

}  // namespace native
}  // namespace dtr
