// Work split into items that threads take one at a time: `run_items` for one op, and
// `StagePlan` for a whole decode step in one parallel region.
//
// Why a plan: on a machine with few cores, the serving threads (gRPC, the frontend, the
// client) preempt one compute thread or another several times per token. Inside one
// parallel region that costs little, since the other threads take the preempted one's
// items. But a decode step forks and joins some forty regions, and at the end of each the
// others wait for the preempted thread's last item, for as long as it stays off the CPU.
// Measured on 2 cores (AMD EPYC) beside a process that burns 0.6 ms every 5 ms: one 3.5 ms
// linear grew by 0.02-0.13 ms, a 4-5 ms decode step of forty regions by about 0.6 ms.
//
// A StagePlan is the step as a list of stages (an op each: a linear's panels, attention's
// kv heads, a norm's rows), all of whose buffers exist before it runs. Every thread of the
// region walks the stages in order: it takes items of the current stage while there are
// any, then waits for the stage's last items, and an item another thread took that is
// still not done after a few item-lengths it computes itself and goes on. No thread waits
// for another between stages, only for the stage's outputs. So every item must be
// idempotent: it writes only its own outputs, the same bits whoever computes it, into
// buffers that no later stage writes, since the thread it was taken from may still
// finish it later. The region ends when every thread has left the last stage.

#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

namespace corestream_cpu {

using Item = std::function<void(int64_t)>;

// fn(i) for every i in [0, n), items taken one at a time by the threads of a parallel
// region: a thread that drew short items keeps taking, and a preempted thread's share
// goes to the others.
template <typename F>
void run_items(int64_t n, const F& fn) {
  if (n <= 0) {
    return;
  }
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), n), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < n;) {
      fn(i);
    }
  });
}

// What StagePlans did in this process, for tests and benchmarks.
struct StagePlanCounters {
  std::atomic<int64_t> plans{0};  // run
  std::atomic<int64_t> plans_built{0};  // built: a plan runs again while the batch size holds
  std::atomic<int64_t> stages{0};
  std::atomic<int64_t> items_retaken{0};  // computed again after another thread was late
  // Nanoseconds the threads spent at stage ends waiting for others' items, summed over
  // threads: what a step loses to imbalance and hand-offs (benchmarks/decode_step.py).
  std::atomic<int64_t> wait_ns{0};
  // Test hook: threads other than the region's first take the first item of every stage
  // and start each item this late, as if preempted, so that the first thread retakes them.
  std::atomic<int64_t> late_us{0};
  // Off: decode_model forks a region per op instead (benchmarks compare both).
  std::atomic<bool> enabled{true};
};

inline StagePlanCounters& stage_plan_counters() {
  static StagePlanCounters counters;
  return counters;
}

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#else
  std::this_thread::yield();
#endif
}

class StagePlan {
 public:
  void add(int64_t n, Item fn) { stages_.push_back(std::make_unique<Stage>(n, std::move(fn))); }

  // By every thread of the parallel region: `thread` its number there, of `team`.
  // Rethrow the first exception of an item with `rethrow()` once the region is over.
  void run(int thread, int team) {
    using Clock = std::chrono::steady_clock;
    Clock::duration item_time = std::chrono::microseconds(10);
    const int64_t late_us = team > 1 ? stage_plan_counters().late_us.load() : 0;
    Clock::duration waited{0};
    for (const auto& stage_ptr : stages_) {
      Stage& stage = *stage_ptr;
      if (late_us > 0 && thread == 0) {
        // Test hook: another thread takes each stage's first item, and starts it late.
        const auto deadline = Clock::now() + std::chrono::seconds(1);
        while (stage.next.load(std::memory_order_relaxed) == 0 && Clock::now() < deadline) {
          cpu_relax();
        }
      }
      for (int64_t i; (i = stage.next.fetch_add(1, std::memory_order_relaxed)) < stage.n;) {
        if (late_us > 0 && thread != 0) {
          std::this_thread::sleep_for(std::chrono::microseconds(late_us));
        }
        const auto start = Clock::now();
        compute(stage, i);
        item_time = Clock::now() - start;
      }
      // Long enough for an item that is merely slower (a longer panel, a cold cache),
      // short against a preemption (another thread's time slice: 0.1 ms and more).
      const auto patience = std::clamp<Clock::duration>(
          4 * item_time, std::chrono::microseconds(10), std::chrono::microseconds(100));
      const auto waiting_since = Clock::now();
      // The wait is counted up to the last time the loop read the clock (one spin short):
      // a read more per stage would cost the step more than it tells.
      auto now = waiting_since;
      for (int64_t first_undone = 0;;) {
        while (first_undone < stage.n && stage.is_done(first_undone, run_)) {
          ++first_undone;
        }
        if (first_undone == stage.n) {
          waited += now - waiting_since;
          break;
        }
        now = Clock::now();
        if (now - waiting_since < patience) {
          cpu_relax();
          continue;
        }
        for (int64_t i = first_undone; i < stage.n; ++i) {
          if (!stage.is_done(i, run_)) {
            compute(stage, i);
            stage_plan_counters().items_retaken.fetch_add(1, std::memory_order_relaxed);
          }
        }
      }
    }
    stage_plan_counters().wait_ns.fetch_add(
        std::chrono::duration_cast<std::chrono::nanoseconds>(waited).count(),
        std::memory_order_relaxed);
  }

  void rethrow() {
    std::lock_guard<std::mutex> guard(error_lock_);
    if (error_) {
      std::rethrow_exception(error_);
    }
  }

  int64_t num_stages() const { return static_cast<int64_t>(stages_.size()); }

  // Keeps the first `stages` stages, ready to run again, and drops the rest: a plan is
  // built once for a batch shape and run step after step, its last stages (those that
  // write the step's outputs) added anew each time. Not while a region runs it. The done
  // flags are not cleared but hold the number of the run that set them: clearing them
  // would touch a cache line per item, each one cold after the step's weights streamed.
  void rearm(int64_t stages) {
    stages_.resize(std::min<int64_t>(stages, num_stages()));
    for (const auto& stage : stages_) {
      stage->next.store(0, std::memory_order_relaxed);
    }
    ++run_;
    failed_.store(false, std::memory_order_relaxed);
    std::lock_guard<std::mutex> guard(error_lock_);
    error_ = nullptr;
  }

 private:
  // Each on a cache line of its own: the threads write them in turns, item by item.
  struct alignas(64) Flag {
    std::atomic<int64_t> done{0};  // the run that finished it
  };

  struct Stage {
    Stage(int64_t count, Item item) : n(count), fn(std::move(item)), flags(new Flag[count]) {}
    bool is_done(int64_t i, int64_t run) const {
      return flags[i].done.load(std::memory_order_acquire) == run;
    }

    alignas(64) std::atomic<int64_t> next{0};
    alignas(64) const int64_t n;
    const Item fn;
    std::unique_ptr<Flag[]> flags;
  };

  void compute(Stage& stage, int64_t i) {
    if (!failed_.load(std::memory_order_relaxed)) {
      try {
        stage.fn(i);
      } catch (...) {
        std::lock_guard<std::mutex> guard(error_lock_);
        if (!error_) {
          error_ = std::current_exception();
        }
        failed_.store(true, std::memory_order_relaxed);
      }
    }
    // Set by whichever thread finishes the item, once or twice: the same bits either way.
    stage.flags[i].done.store(run_, std::memory_order_release);
  }

  std::vector<std::unique_ptr<Stage>> stages_;
  int64_t run_ = 1;  // this run's number: its items' done flags hold it once done
  std::atomic<bool> failed_{false};
  std::mutex error_lock_;
  std::exception_ptr error_;
};

}  // namespace corestream_cpu
