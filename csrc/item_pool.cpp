// See item_pool.h.
#include "item_pool.h"

#include <pthread.h>

#include <atomic>
#include <condition_variable>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

namespace seq2seq_fast {
namespace {

// Rounds of sched_yield() the caller gives a helper that is finishing its last item before it
// sleeps on a condition variable (a yield returns at once when no other thread wants the core).
constexpr int kWatchRounds = 200;

class Pool {
 public:
  void run(int helpers, const std::function<void()>& participant) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || helpers <= 0) {  // another caller has the pool: run inline
      participant();
      return;
    }
    grow(helpers);
    {
      std::lock_guard<std::mutex> lk(mu_);
      job_ = &participant;
      open_ = helpers;
      error_ = nullptr;
      generation_.fetch_add(1, std::memory_order_release);
      if (sleepers_ > 0) wake_.notify_all();
    }
    std::exception_ptr mine;
    try {
      participant();
    } catch (...) {
      mine = std::current_exception();
    }
    std::exception_ptr theirs;
    {
      std::unique_lock<std::mutex> lk(mu_);
      open_ = 0;  // helpers that have not started by now stay out
      job_ = nullptr;
    }
    // A helper still inside is usually running its last item: watch it briefly (a sleep and
    // wake-up would add tens of microseconds to every call), then sleep (it may have lost its
    // core, and spinning would keep that core from it).
    for (int i = 0; i < kWatchRounds && active_.load(std::memory_order_acquire) != 0; ++i) {
      std::this_thread::yield();
    }
    {
      std::unique_lock<std::mutex> lk(mu_);
      done_.wait(lk, [&] { return active_.load(std::memory_order_relaxed) == 0; });
      theirs = error_;
      error_ = nullptr;
    }
    if (mine) std::rethrow_exception(mine);
    if (theirs) std::rethrow_exception(theirs);
  }

 private:
  void grow(int helpers) {
    std::lock_guard<std::mutex> lk(mu_);
    while (int(threads_) < helpers) {
      std::thread(&Pool::work, this, generation_.load()).detach();
      ++threads_;
    }
  }

  void work(uint64_t seen) {
    for (;;) {
      // No spinning: on a shared machine a spinning helper takes the core from the threads that
      // have work; a wake-up costs a few microseconds of the helper's start, not the caller's.
      std::unique_lock<std::mutex> lk(mu_);
      if (generation_.load(std::memory_order_acquire) == seen) {
        ++sleepers_;
        wake_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        --sleepers_;
      }
      seen = generation_.load(std::memory_order_acquire);
      if (job_ == nullptr || open_ <= 0) continue;  // closed, or enough helpers already
      --open_;
      active_.fetch_add(1, std::memory_order_relaxed);
      const std::function<void()>* job = job_;
      lk.unlock();
      std::exception_ptr err;
      try {
        (*job)();
      } catch (...) {
        err = std::current_exception();
      }
      lk.lock();
      if (err && !error_) error_ = err;
      if (active_.fetch_sub(1, std::memory_order_acq_rel) == 1) done_.notify_all();
    }
  }

  std::mutex busy_;  // held by the caller of the current job
  std::mutex mu_;    // guards everything below
  std::condition_variable wake_, done_;
  std::atomic<uint64_t> generation_{0};
  const std::function<void()>* job_ = nullptr;
  int open_ = 0;       // helpers that may still join the current job
  std::atomic<int> active_{0};  // helpers inside the current job (changed under mu_)
  int sleepers_ = 0;   // helpers waiting on wake_
  unsigned threads_ = 0;
  std::exception_ptr error_;
};

// Never destroyed: its threads are detached and may sleep in it at process exit.
std::atomic<Pool*> g_pool{nullptr};

void forget_pool_in_child() { g_pool.store(nullptr); }  // the old one's threads did not survive

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  static std::once_flag at_fork;
  std::call_once(at_fork, [] { pthread_atfork(nullptr, nullptr, forget_pool_in_child); });
  Pool* fresh = new Pool();
  if (!g_pool.compare_exchange_strong(p, fresh, std::memory_order_acq_rel)) {
    delete fresh;  // another thread installed one first; `p` now holds it
    return *p;
  }
  return *fresh;
}

}  // namespace

void run_with_helpers(int helpers, const std::function<void()>& participant) {
  pool().run(helpers, participant);
}

}  // namespace seq2seq_fast
