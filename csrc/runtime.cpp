// The shared runtime of the CPU ops (runtime.h): instruction-set choice, scratch, outputs, the
// attention's work plan and the contention back-off.
#include "runtime.h"

#include <chrono>
#include <cstdlib>
#include <cstring>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace seq2seq_fast {

// ---- instruction set -------------------------------------------------------------------------

namespace {

[[maybe_unused]] bool cpu_has_avx512() {
#if SEQ2SEQ_FAST_X86_SIMD
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq");
  return ok;
#else
  return false;
#endif
}

[[maybe_unused]] bool cpu_has_avx2() {
#if SEQ2SEQ_FAST_X86_SIMD
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
#else
  return false;
#endif
}

bool isa_forced(const char* env, const char* name) { return env && std::strcmp(env, name) == 0; }

}  // namespace

template <>
const KernelTable<float>& runtime_kernels<float>() {
  const char* env = std::getenv("SEQ2SEQ_FAST_ISA");
  if (isa_forced(env, "portable")) return portable_float_kernels();
#if SEQ2SEQ_FAST_X86_SIMD
  if (isa_forced(env, "avx2") && cpu_has_avx2()) return avx2_float_kernels();
  if (!isa_forced(env, "avx2") && cpu_has_avx512()) return avx512_float_kernels();
  if (cpu_has_avx2()) return avx2_float_kernels();
#endif
  return portable_float_kernels();
}

template <>
const KernelTable<double>& runtime_kernels<double>() {
  return portable_double_kernels();
}

// ---- scratch and outputs ---------------------------------------------------------------------

namespace {
struct AlignedBuffer {
  void* data = nullptr;
  size_t bytes = 0;
  ~AlignedBuffer() { std::free(data); }
};
}  // namespace

void* thread_scratch_bytes(Slot slot, size_t bytes) {
  thread_local AlignedBuffer buffers[int(Slot::kCount)];
  AlignedBuffer& buffer = buffers[int(slot)];
  if (buffer.bytes < bytes) {
    std::free(buffer.data);
    const size_t rounded = (bytes + 63) / 64 * 64;
    buffer.data = std::aligned_alloc(64, rounded);
    TORCH_CHECK(buffer.data != nullptr, "seq2seq_fast: out of memory for ", rounded,
                " bytes of scratch");
    buffer.bytes = rounded;
  }
  return buffer.data;
}

// Fresh memory from the OS costs a page fault per 4 KiB on first write (a decoding step's dkeys
// and dvalues are hundreds of MiB, and the faults took 3/4 of that backward); on Linux, the
// 2 MiB-aligned interior of a large allocation is marked for transparent huge pages (advice only:
// without THP, or where the memory was already mapped, nothing changes).
at::Tensor empty_output(at::IntArrayRef sizes, const at::TensorOptions& opts) {
  at::Tensor out = at::empty(sizes, opts);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const size_t bytes = out.nbytes();
  if (bytes >= 4 * kHuge) {
    const uintptr_t begin = reinterpret_cast<uintptr_t>(out.data_ptr());
    const uintptr_t first = (begin + kHuge - 1) & ~(kHuge - 1);
    const uintptr_t last = (begin + bytes) & ~(kHuge - 1);
    if (last > first) madvise(reinterpret_cast<void*>(first), last - first, MADV_HUGEPAGE);
  }
#endif
  return out;
}

// ---- work plan -------------------------------------------------------------------------------

namespace {
// Rows of a batch row split over threads get at least this many queries each, so that the keys'
// packing (and exponentials) are shared by several queries.
constexpr int64_t kMinQueriesPerBlock = 4;
}  // namespace

Plan make_plan(int64_t B, int64_t Tq, int64_t Tk, int64_t H) {
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  int64_t blocks = 1;
  if (B < 4 * threads) {  // too few batch rows to balance: split the queries of a row too
    blocks = std::min(ceil_div(Tq, kMinQueriesPerBlock), ceil_div(4 * threads, B));
    blocks = std::max<int64_t>(blocks, 1);
  }
  const int64_t block = ceil_div(Tq, blocks);
  blocks = ceil_div(Tq, block);
  return {blocks, block, B * blocks, std::max<int64_t>(1, block * Tk * H)};
}

// ---- contention back-off ---------------------------------------------------------------------
//
// A parallel region ends with a barrier that waits for every thread of the team; when the OS has
// descheduled one of them (another job holds the core) that wait lasts a scheduler slice,
// whatever the other threads did meanwhile: measured here, a 0.7 ms forward took 8 ms at 2
// threads with the other core busy (1.2 ms on one thread). So each region checks how long the
// calling thread waited after its own last item; when that wait exceeds half of its own working
// time (plus 100 us), the next calls run on the calling thread alone for kBackoff, and then try
// the team again. On an idle machine the wait is at most one item and nothing changes.

namespace {
constexpr int64_t kBackoffNs = 20 * 1000 * 1000;  // 20 ms
constexpr int64_t kSlackNs = 100 * 1000;          // 100 us
std::atomic<int64_t> g_alone_until_ns{0};
}  // namespace

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

bool backoff_run_alone(int64_t now) {
  return now < g_alone_until_ns.load(std::memory_order_relaxed);
}

void backoff_record(int64_t start, int64_t caller_done, int64_t finish) {
  if (caller_done <= 0) return;  // the calling thread ran no task (no measurement)
  const int64_t waited = finish - caller_done, worked = caller_done - start;
  if (waited > worked / 2 + kSlackNs) {
    g_alone_until_ns.store(finish + kBackoffNs, std::memory_order_relaxed);
  }
}

}  // namespace seq2seq_fast
