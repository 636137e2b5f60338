// A small persistent thread pool (torch-free): runs fn(begin, end) over chunks of [0, n).
//
// The caller's thread and the workers claim chunks from a shared counter until none is left, so a
// thread that gets its core late (another library's OpenMP workers keep spinning for a while after
// their parallel region; other processes) does less of the work instead of holding up the call.
// Chunk boundaries depend only on n, the grain and the pool size, never on which thread runs a
// chunk, so results that depend on them (sum_squares' blocks) are the same whatever the timing.
// A worker takes part only if it wakes while the caller is still claiming chunks: once the caller
// finds none left it closes the call and waits only for the workers that joined, never for one the
// OS has not scheduled yet (on a busy machine that wait was a scheduler slice per call, issue 30).
// The call returns when every chunk is done and rethrows the first exception any chunk threw. One
// parallel_for runs at a time (concurrent callers queue). Its size is set explicitly, never from
// OMP_NUM_THREADS.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace grace_adam {

class ThreadPool {
 public:
  using SliceFn = std::function<void(int64_t begin, int64_t end)>;

  explicit ThreadPool(int threads) { start_workers(checked_size(threads) - 1); }
  ~ThreadPool() { stop_workers(); }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return size_.load(); }

  // For tests: while held, a worker that wakes for a job waits before taking part in it, as one
  // the OS has not scheduled yet would.
  void hold_workers(bool held) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      held_ = held;
    }
    work_ready_.notify_all();
  }

  void resize(int threads) {
    const int size_new = checked_size(threads);
    std::lock_guard<std::mutex> one_run(run_mutex_);
    if (size_new == size()) return;
    stop_workers();
    start_workers(size_new - 1);
  }

  // Chunks start at multiples of `grain`; about kChunksPerThread per participating thread. A
  // range of at most one grain runs on the caller alone, with no hand-off.
  void parallel_for(int64_t n, int64_t grain, const SliceFn& fn) {
    if (n <= 0) return;
    std::lock_guard<std::mutex> one_run(run_mutex_);
    const int64_t grains = (n + grain - 1) / grain;
    const int threads = static_cast<int>(std::min<int64_t>(size(), grains));
    if (threads == 1) return fn(0, n);
    const int64_t chunks_wanted = static_cast<int64_t>(threads) * kChunksPerThread;
    const int64_t chunk = (grains + chunks_wanted - 1) / chunks_wanted * grain;
    next_chunk_.store(0);  // the previous job is closed and its joined workers are back: nobody claims now
    publish(Job{&fn, n, chunk, (n + chunk - 1) / chunk, threads});
    run_chunks();
    close_and_rethrow();
  }

 private:
  static constexpr int64_t kChunksPerThread = 8;

  struct Job {
    const SliceFn* fn = nullptr;
    int64_t n = 0, chunk = 0, chunks = 0;
    int threads = 0;  // the caller and workers 1 .. threads-1 take part
  };

  static int checked_size(int threads) {
    if (threads < 1) {
      throw std::invalid_argument("GraceAdam thread pool size is " + std::to_string(threads) +
                                  "; expected at least 1.");
    }
    return threads;
  }

  void start_workers(int count) {
    stopping_ = false;
    const uint64_t seen = generation_;  // no job is in flight here: a new worker must not run an old one
    for (int i = 0; i < count; ++i) workers_.emplace_back([this, i, seen] { worker_main(i + 1, seen); });
    size_.store(count + 1);
  }

  void stop_workers() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (std::thread& t : workers_) t.join();
    workers_.clear();
  }

  void publish(const Job& job) {
    std::lock_guard<std::mutex> lock(mutex_);
    job_ = job;
    open_ = true;
    error_ = nullptr;
    ++generation_;
    work_ready_.notify_all();
  }

  // Claims and runs chunks until none is left (after an exception, the rest still run: the call
  // reports the first exception once every chunk has finished).
  void run_chunks() {
    for (int64_t c = next_chunk_.fetch_add(1); c < job_.chunks; c = next_chunk_.fetch_add(1)) {
      const int64_t begin = c * job_.chunk;
      try {
        (*job_.fn)(begin, std::min(job_.n, begin + job_.chunk));
      } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) error_ = std::current_exception();
      }
    }
  }

  // Every chunk is claimed: no worker joins from now on; wait for those running chunks.
  void close_and_rethrow() {
    std::unique_lock<std::mutex> lock(mutex_);
    open_ = false;
    all_done_.wait(lock, [this] { return joined_ == 0; });
    if (error_) std::rethrow_exception(error_);
  }

  void worker_main(int index, uint64_t seen) {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_ready_.wait(lock, [&] { return stopping_ || generation_ != seen; });
      work_ready_.wait(lock, [&] { return stopping_ || !held_; });
      if (stopping_) return;
      seen = generation_;
      if (!open_ || index >= job_.threads) continue;
      ++joined_;
      lock.unlock();
      run_chunks();  // job_ and next_chunk_ are not rewritten until every joined worker is back
      lock.lock();
      if (--joined_ == 0) all_done_.notify_one();
    }
  }

  std::mutex run_mutex_;  // held for a whole parallel_for or resize
  std::mutex mutex_;      // guards everything below
  std::condition_variable work_ready_, all_done_;
  std::vector<std::thread> workers_;
  std::atomic<int> size_{1};  // readable while a resize runs
  std::atomic<int64_t> next_chunk_{0};  // the next chunk of job_ to claim
  Job job_;
  uint64_t generation_ = 0;
  bool open_ = false;  // the current job still takes workers
  int joined_ = 0;     // workers running chunks of the current job
  bool stopping_ = false;
  bool held_ = false;
  std::exception_ptr error_;
};

}  // namespace grace_adam
