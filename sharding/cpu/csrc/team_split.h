// How a call shares a linear's output blocks over the OpenMP team. Each thread streams its own share from the front,
// each claim half of what is left of it (at least `chunk` items). A thread that is done makes the same claims on the
// shares the others have not finished.
//
// Why not an even split: the threads of a VM are not equally fast, and which one is slower changes. In one run on the
// 2-vCPU Zen 5 host of BENCHMARKS.md section 38, thread 0 took 8 % longer than thread 1 over the same linears, and
// thread 1 waited at every barrier. Half an hour later, pinned alone to each vCPU, the two read equally fast. Taking
// over the end of the slower thread's share made a dense int4 step 2 % faster there (int8 1.4 %). It changed nothing
// measurable for the MoE, float32 or prefill.
//
// Why not chunks from one shared counter: they broke every thread's stream into pieces and cost 15 % of a quiet step
// (section 12). Fixed claims of 128 KB from each thread's own share cost 1 % (section 38). Halving claims keep a share
// to a few long streams, and still leave its end in small pieces.
//
// Which thread computes an output block changes none of its bits, so the results stay the same bit for bit.
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace tpserve {

// one thread's share of one linear: the next item to claim, and where the share ends (a cache line each: a thread's
// claims do not bounce the others' counters)
struct alignas(64) ShareSlot {
  std::atomic<int64_t> next{0};
  int64_t end = 0;
};

// One linear's n items over a team of T threads, on T slots the caller keeps
class Shares {
 public:
  static constexpr int64_t CHUNK_BYTES = 128 << 10;  // of weights, the least a claim takes (microseconds of streaming)

  // the least items a claim takes, for `bytes_per_item` bytes of weights each
  static int64_t chunk_for(int64_t bytes_per_item) {
    return std::max<int64_t>(1, CHUNK_BYTES / std::max<int64_t>(1, bytes_per_item));
  }

  // before the team starts on it: thread t's share [n t / T, n (t + 1) / T), claimed at least `chunk` items at a time
  void reset(ShareSlot* slots, int64_t n, int T, int64_t chunk) {
    slots_ = slots;
    T_ = T;
    chunk_ = std::max<int64_t>(1, chunk);
    for (int t = 0; t < T; ++t) {
      slots[t].next.store(n * t / T, std::memory_order_relaxed);
      slots[t].end = n * (t + 1) / T;
    }
  }

  // f(b0, b1) over every chunk thread t claims: its own share's first, then the next threads' (a smaller team than
  // reset() was told of leaves shares without an owner: the others take them whole)
  template <class F>
  void run(int t, const F& f) const {
    for (int i = 0; i < T_; ++i) {
      ShareSlot& s = slots_[(t + i) % T_];
      for (int64_t b0 = s.next.load(std::memory_order_relaxed); b0 < s.end;) {
        const int64_t b1 = std::min(s.end, b0 + std::max(chunk_, (s.end - b0) / 2));  // half what is left
        if (s.next.compare_exchange_weak(b0, b1, std::memory_order_relaxed)) {
          f(b0, b1);
          b0 = s.next.load(std::memory_order_relaxed);
        }
      }
    }
  }

 private:
  ShareSlot* slots_ = nullptr;
  int T_ = 0;
  int64_t chunk_ = 1;
};

// f(b0, b1) over [0, n) on torch's intra-op threads, shared as Shares does (at::parallel_for's role for a linear's
// output blocks): at least `grain` items a thread, `chunk` a claim; inside another parallel region, or with one
// thread, f(0, n).
template <class F>
void shared_for(int64_t n, int64_t grain, int64_t chunk, int threads, const F& f) {
  grain = std::max<int64_t>(1, grain);
  const int T = static_cast<int>(std::min<int64_t>(threads, (n + grain - 1) / grain));
  if (T <= 1 || omp_in_parallel()) {
    if (n > 0) f(int64_t{0}, n);
    return;
  }
  std::vector<ShareSlot> slots(T);
  Shares shares;
  shares.reset(slots.data(), n, T, chunk);
#pragma omp parallel num_threads(T)
  shares.run(omp_get_thread_num(), f);
}

}  // namespace tpserve
