// The kernels' threads (decode step, LM head, GEMV/GEMM): lbq::parallel_for splits a range of
// rows into one contiguous chunk per thread, at most torch's intra-op thread count
// (torch.set_num_threads, which `--threads` sets), as llama.cpp's threadpool splits rows.
//
// Built with OpenMP (kernel.py passes -fopenmp on Linux) it is at::parallel_for on torch's own
// OpenMP threads: the extension's libgomp.so.1 resolves to the copy the torch wheel loaded, so
// the kernels and PyTorch's operators share one persistent pool and never compete for cores
// (a second pool's threads and OpenMP's spinning ones on the same cores halved the speed of a
// prefill that interleaves both).  Without -fopenmp at::parallel_for's `#pragma omp parallel`
// is ignored and it runs every range serially on the caller, so there the Pool below (N - 1
// persistent workers, spinning, then yielding, then asleep) stands in.
//
// Splitting rows across threads never changes what an output is: each output is computed by
// one thread with the same code, so results are bit-identical at every thread count.
#pragma once

#include <ATen/Parallel.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#endif

namespace lbq {

inline void cpu_relax() {
#if defined(__x86_64__) || defined(_M_X64)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

class Pool {
 public:
  // How long an idle worker polls for the next job before sleeping: a decode step's parallel
  // sections are microseconds apart and its tokens a few hundred microseconds apart (the
  // Python between two steps); spinning longer would take the core from PyTorch's threads.
  static constexpr double kSpinS = 20e-6, kYieldS = 2e-3;
  static constexpr int kMaxThreads = 256;

  static Pool& get() {
    static Pool* p = [] {
      pthread_atfork(nullptr, nullptr, [] { instance() = new Pool(); });  // a child has no workers
      return instance() = new Pool();  // never destroyed: workers may outlive static destructors
    }();
    (void)p;
    return *instance();
  }

  // f(t, n) for t = 0..n-1 on n threads (the caller runs t = 0), returning when all are done;
  // the first exception thrown by any f is rethrown here.  Where the pool is taken (a call
  // from another thread, or from inside a job) the n parts run inline, in order.
  template <class F>
  void run(int n, const F& f) {
    if (n <= 1) {
      f(0, 1);
      return;
    }
    if (in_pool()) {
      for (int t = 0; t < n; ++t) f(t, n);
      return;
    }
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock()) {
      for (int t = 0; t < n; ++t) f(t, n);
      return;
    }
    ensure_workers(n - 1);
    job_ = [](const void* ctx, int t, int n) { (*static_cast<const F*>(ctx))(t, n); };
    ctx_ = &f;
    n_ = n;
    error_ = nullptr;
    // Every worker acknowledges every job (those beyond n without running it), so none can
    // still be reading this job's fields when the next one is set up.
    pending_.store(static_cast<int>(workers_), std::memory_order_relaxed);
    gen_.fetch_add(1);  // seq_cst: ordered before the sleepers_ load (see loop)
    if (sleepers_.load() > 0) {
      std::lock_guard<std::mutex> lk(m_);
      cv_.notify_all();
    }
    in_pool() = true;
    try {
      f(0, n);
    } catch (...) {
      std::lock_guard<std::mutex> lk(err_m_);
      if (!error_) error_ = std::current_exception();
    }
    in_pool() = false;
    while (pending_.load(std::memory_order_acquire) > 0) cpu_relax();
    if (error_) std::rethrow_exception(error_);
  }

 private:
  using Job = void (*)(const void*, int, int);

  static Pool*& instance() {
    static Pool* p = nullptr;
    return p;
  }

  void ensure_workers(int k) {
    while (static_cast<int>(workers_) < std::min(k, kMaxThreads - 1)) {
      const int id = static_cast<int>(++workers_);
      const uint64_t start = gen_.load();  // before the next job's bump: the worker sees it
      std::thread([this, id, start] { loop(id, start); }).detach();
    }
  }

  // true on the pool's workers, and on a caller while it runs its part of a job
  static bool& in_pool() {
    thread_local bool flag = false;
    return flag;
  }

  void loop(int id, uint64_t seen) {
    in_pool() = true;
    for (;;) {
      // wait for a new job: spin, then yield, then sleep
      const auto t0 = std::chrono::steady_clock::now();
      uint64_t g;
      for (int i = 0;; ++i) {
        g = gen_.load(std::memory_order_acquire);
        if (g != seen) break;
        if ((i & 63) != 63) {
          cpu_relax();
          continue;
        }
        const double idle = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
        if (idle < kSpinS) continue;
        if (idle < kYieldS) {
          std::this_thread::yield();
          continue;
        }
        std::unique_lock<std::mutex> lk(m_);
        sleepers_.fetch_add(1);  // seq_cst, then gen_ is read again under m_: no lost wake-up
        cv_.wait(lk, [&] { return gen_.load() != seen; });
        sleepers_.fetch_sub(1);
        g = gen_.load(std::memory_order_acquire);
        break;
      }
      seen = g;
      const int n = n_;
      if (id < n) {
        try {
          job_(ctx_, id, n);
        } catch (...) {
          std::lock_guard<std::mutex> lk(err_m_);
          if (!error_) error_ = std::current_exception();
        }
      }
      pending_.fetch_sub(1, std::memory_order_acq_rel);
    }
  }

  std::mutex busy_;               // held by the running job's caller
  std::atomic<uint64_t> gen_{0};  // bumped once per job
  std::atomic<int> pending_{0};   // workers of the running job not yet done
  std::atomic<int> sleepers_{0};  // workers waiting on cv_
  std::mutex m_, err_m_;
  std::condition_variable cv_;
  unsigned workers_ = 0;
  Job job_ = nullptr;
  const void* ctx_ = nullptr;
  int n_ = 1;
  std::exception_ptr error_;
};

// Per calling thread: run every range on the caller alone. For a model so small that waking
// the other threads costs more than they save (a speculative draft model beside its target);
// set from Python around such calls (set_serial). The outputs are the same bits either way.
inline bool& serial() {
  static thread_local bool on = false;
  return on;
}

// The kernels' thread count: torch's intra-op threads (torch.set_num_threads / --threads).
inline int num_threads() {
  return std::max(1, at::get_num_threads());
}

// f(b0, b1) over [begin, end) in at most num_threads() contiguous chunks of at least `grain`
// items (at::parallel_for's split), on the persistent pool.
template <class F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (serial()) {
    if (begin < end) f(begin, end);
    return;
  }
#if defined(_OPENMP)
  at::parallel_for(begin, end, grain, f);
#else
  if (begin >= end) return;
  const int64_t range = end - begin;
  int64_t n = std::min<int64_t>(num_threads(), Pool::kMaxThreads);
  if (grain > 0) n = std::min(n, (range + grain - 1) / grain);
  if (n <= 1) {
    f(begin, end);
    return;
  }
  const int64_t chunk = (range + n - 1) / n;
  n = (range + chunk - 1) / chunk;
  Pool::get().run(static_cast<int>(n), [&](int t, int) {
    const int64_t b0 = begin + t * chunk;
    if (b0 < end) f(b0, std::min(end, b0 + chunk));
  });
#endif
}

}  // namespace lbq
