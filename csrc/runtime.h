// The runtime the CPU ops share (csrc/additive_attention.cpp, gru.cpp, lstm.cpp):
//
//   - which kernel table runs (instruction set chosen at run time; SEQ2SEQ_FAST_ISA overrides);
//   - per-thread scratch in named slots, kept across calls;
//   - outputs that are about to be written in full (empty_output);
//   - the work plan of the attention (items = batch row x block of queries) and the loop that
//     runs the items over the threads, with the contention back-off (for_each_item);
//   - the row loop of the gate passes (for_rows).
#pragma once

#include <ATen/Parallel.h>
#include <torch/types.h>

#include <algorithm>
#include <atomic>
#include <cstdint>

#include "kernels/kernels.h"

namespace seq2seq_fast {

// ---- instruction set -------------------------------------------------------------------------

// The table the extension runs for T on this CPU. float: AVX-512, else AVX2+FMA, else portable;
// SEQ2SEQ_FAST_ISA=portable|avx2|avx512 forces one (read on every call, so tests can switch; a
// path the CPU lacks falls back to the best one it has). double: portable.
template <typename T>
const KernelTable<T>& runtime_kernels();
template <>
const KernelTable<float>& runtime_kernels<float>();
template <>
const KernelTable<double>& runtime_kernels<double>();

// ---- sizes -----------------------------------------------------------------------------------

inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
inline int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

// ---- scratch ---------------------------------------------------------------------------------

// Per-thread scratch buffers that persist across calls (no page faults from fresh allocations on
// every call), one per slot, 64-byte aligned (padded rows start on a cache line).
enum class Slot : int {
  kQueries = 0,   // an item's packed query rows [block, Hp]
  kKeys,          // its batch row's packed keys [Tk, Hp]
  kSoftmaxRow,    // one row of scores on its way to exp() [round_up(Tk, 16)]
  kScoreGrads,    // the backward's de = dL/dscores of an item [block, Tk]
  kValueGrads,    // the backward's dp = dL/dweights of an item [block, Tk]
  kQueryGrads,    // the backward's unscaled query gradients [block, Hp]
  kKeyGrads,      // the backward's unscaled key gradients [Tk, Hp]
  kFormedKeys,    // a location-aware step's keys of one batch row [Tk, H]
  kWeightRows,    // bfloat16 ops: an item's weights rows in float32 [block, Tk]
  kOutRows,       // bfloat16 ops: an item's output rows in float32 before rounding
  kValueRows,     // bfloat16 ops: a batch row's values widened to float32 [Tk, Dv]
  kGradRows,      // bfloat16 ops: an item's context gradient rows widened [block, Dv]
  kLocationRows,  // bfloat16 location-aware step: a batch row's conv rows widened [Tk, C]
  kLocationGrads, // bfloat16 location-aware step: a batch row's conv gradient rows [Tk, C]
  kSigmoidRows,   // sigmoid normalisation's backward: 1 - sigmoid(e) of an item [block, Tk]
  kCount
};

// The calling thread's buffer of `slot`, grown to at least `bytes`.
void* thread_scratch_bytes(Slot slot, size_t bytes);

template <typename T>
T* thread_scratch(Slot slot, int64_t n) {
  return static_cast<T*>(thread_scratch_bytes(slot, size_t(std::max<int64_t>(n, 1)) * sizeof(T)));
}

// An uninitialised output that the kernel is about to write in full; its large interior is
// advised to transparent huge pages (fewer page faults on first write; see runtime.cpp).
at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& opts);

// ---- the attention's work plan ---------------------------------------------------------------

struct Plan {
  int64_t blocks_per_row;  // query blocks per batch row
  int64_t block;           // queries per block
  int64_t items;           // B * blocks_per_row
  int64_t work_per_item;   // tanh evaluations in one item, at most
};

// B, Tq >= 1: few batch rows (B < 4 threads) split each row's queries into blocks of at least
// four queries, so that every thread gets work and shares each key's packing over several queries.
Plan make_plan(int64_t B, int64_t Tq, int64_t Tk, int64_t H);

// ---- running the items -----------------------------------------------------------------------

// Below this many tanh evaluations per task a thread is not worth waking.
constexpr int64_t kMinWorkPerTask = 1 << 16;

// Contention back-off (runtime.cpp explains it): whether the next region runs on the calling
// thread alone, and the report of a finished region.
int64_t now_ns();
bool backoff_run_alone(int64_t now);
void backoff_record(int64_t start, int64_t caller_done, int64_t finish);

// Runs fn(item, scratch) for every item of the plan, scratch = make_scratch() once per thread.
// Threads take items from a shared counter, so a thread that the OS deschedules does not hold
// the others back until the final barrier. Every item writes only its own outputs and partial
// buffers: results do not depend on which thread ran an item. Tiny work runs inline.
template <typename MakeScratch, typename Fn>
void for_each_item(const Plan& plan, MakeScratch make_scratch, Fn fn) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const int64_t by_work = std::max<int64_t>(1, plan.items * plan.work_per_item / kMinWorkPerTask);
  const int64_t tasks = std::min({threads, by_work, plan.items});
  const int64_t start = now_ns();
  if (tasks <= 1 || at::in_parallel_region() || backoff_run_alone(start)) {
    auto scratch = make_scratch();
    for (int64_t item = 0; item < plan.items; ++item) fn(item, scratch);
    return;
  }
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> caller_done{0};
  at::parallel_for(0, tasks, 1, [&](int64_t begin, int64_t end) {
    auto scratch = make_scratch();
    for (int64_t task = begin; task < end; ++task) {
      for (int64_t item = next.fetch_add(1); item < plan.items; item = next.fetch_add(1)) {
        fn(item, scratch);
      }
    }
    if (at::get_thread_num() == 0) caller_done.store(now_ns(), std::memory_order_relaxed);
  });
  backoff_record(start, caller_done.load(std::memory_order_relaxed), now_ns());
}

// Rows [begin, end) of one step's gate pass (row_work elements each); small steps run on the
// calling thread (a parallel region costs more than the pass). Measured at B=64, T=30, H=256 on
// 2 threads: GRU forward 5.2 -> 4.2 ms, backward 8.2 -> 7.3 ms with the rows split; no
// difference at B=16.
template <typename F>
void for_rows(int64_t rows, int64_t row_work, const F& f) {
  if (rows * row_work < 16384) {
    f(0, rows);
  } else {
    at::parallel_for(0, rows, std::max<int64_t>(1, 16384 / row_work), f);
  }
}

}  // namespace seq2seq_fast
