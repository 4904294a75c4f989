// A small pool of helper threads for the kernels' work items, made for machines shared with
// other jobs.
//
// at::parallel_for (OpenMP) ends every region with a barrier that waits for every thread of the
// team. When the OS has descheduled one of them (a busy core), the call waits a whole scheduler
// slice for it even if the other threads did all the work: measured here, a 0.7 ms forward took
// 8 ms at 2 threads with the other core busy. In this pool the caller works on the items itself,
// helpers join when they get a core, and the caller waits only for helpers that have actually
// taken part (they finish the item in hand). A helper that wakes too late finds the job closed
// and goes back to sleep.
//
// One job at a time: a second caller (another Python thread) runs its items inline. After fork()
// the child gets a fresh pool (threads do not survive a fork).
#pragma once

#include <cstdint>
#include <functional>

namespace seq2seq_fast {

// Runs `participant` on the calling thread and on up to `helpers` pool threads that start before
// the caller's own call returns; returns when every started call has returned. `participant` is
// expected to take work items from a shared counter until none is left. The first exception
// thrown by any call is rethrown here.
void run_with_helpers(int helpers, const std::function<void()>& participant);

}  // namespace seq2seq_fast
