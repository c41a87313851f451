// A watcher of the rank-path ring (zkernel/divergence.py) that needs neither the
// interpreter lock nor the CUDA driver.
//
// The ring is host memory of int64 rows [slots][world][4]: per statement and
// rank (number, group index, kind, micro-step), -1 where nothing was written.
// The GPU (or gloo) writes it asynchronously; a native thread reads it every
// poll and reports a statement that every rank has written (equal numbers)
// naming different (group, kind), seen in two polls in a row (a poll may read
// a row that is still being written). Python's watchdog thread takes the
// finding from `wait` (which releases the lock) and reports it; if it has not
// acknowledged within `grace_s` (a thread holds the interpreter lock while
// blocked on a collective that will never finish), this thread writes the
// message to stderr itself and ends the process with status 1.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace zk {

struct RingFinding {
    int64_t number = -1;
    int64_t micro_step = 0;
    std::vector<std::vector<int64_t>> rows;  // per rank: (number, group index, kind, micro-step)
};

struct RingText {
    std::vector<std::string> clauses;  // group index * kinds + kind -> "gather for forward 'name'"
    int64_t kinds = 4;
    std::string head;  // before the micro-step number
    std::string middle;  // between the micro-step and the per-rank clauses
    std::string tail;  // after them
};

class RingWatch {
  public:
    RingWatch(const int64_t* rows, int64_t slots, int64_t world, double poll_s, double grace_s, RingText text);
    ~RingWatch();
    RingWatch(const RingWatch&) = delete;
    RingWatch& operator=(const RingWatch&) = delete;

    // Block until a confirmed finding (returned), `stop`, or `timeout_s` (< 0: no timeout).
    std::optional<RingFinding> wait(double timeout_s);
    // Python reported the finding: no fallback.
    void acknowledge();
    // One scan now, without confirmation (the last look at close).
    std::optional<RingFinding> scan() const;
    void stop();
    std::string message(const RingFinding& f) const;

  private:
    void run();
    std::vector<RingFinding> disagreements() const;

    const int64_t* rows_;
    int64_t slots_, world_;
    double poll_s_, grace_s_;
    RingText text_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool stopping_ = false;
    bool acknowledged_ = false;
    std::optional<RingFinding> found_;
    std::thread thread_;
};

}  // namespace zk
