#include "ring_watch.h"

#include <unistd.h>

#include <chrono>
#include <set>

namespace zk {

namespace {
constexpr int64_t kCols = 4;

int64_t load(const int64_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
}  // namespace

RingWatch::RingWatch(const int64_t* rows, int64_t slots, int64_t world, double poll_s, double grace_s, RingText text)
    : rows_(rows), slots_(slots), world_(world), poll_s_(poll_s), grace_s_(grace_s), text_(std::move(text)) {
    thread_ = std::thread([this] { run(); });
}

RingWatch::~RingWatch() { stop(); }

void RingWatch::stop() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        stopping_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

void RingWatch::acknowledge() {
    {
        std::lock_guard<std::mutex> lock(mu_);
        acknowledged_ = true;
    }
    cv_.notify_all();
}

std::vector<RingFinding> RingWatch::disagreements() const {
    std::vector<RingFinding> out;
    std::vector<int64_t> row(static_cast<size_t>(world_ * kCols));
    for (int64_t slot = 0; slot < slots_; ++slot) {
        const int64_t* base = rows_ + slot * world_ * kCols;
        for (int64_t i = 0; i < world_ * kCols; ++i) row[i] = load(base + i);
        bool complete = row[0] >= 0, differs = false;
        for (int64_t r = 1; r < world_ && complete; ++r) {
            complete = row[r * kCols] == row[0];
            differs = differs || row[r * kCols + 1] != row[1] || row[r * kCols + 2] != row[2];
        }
        if (!complete || !differs) continue;
        RingFinding f;
        f.number = row[0];
        f.micro_step = row[3];
        for (int64_t r = 0; r < world_; ++r) f.rows.emplace_back(row.begin() + r * kCols, row.begin() + (r + 1) * kCols);
        out.push_back(std::move(f));
    }
    return out;
}

std::optional<RingFinding> RingWatch::scan() const {
    std::optional<RingFinding> first;
    for (auto& f : disagreements())
        if (!first || f.number < first->number) first = std::move(f);
    return first;
}

void RingWatch::run() {
    const auto poll = std::chrono::duration<double>(poll_s_);
    std::set<int64_t> suspects;
    std::unique_lock<std::mutex> lock(mu_);
    while (!stopping_) {
        if (cv_.wait_for(lock, poll, [this] { return stopping_; })) return;
        lock.unlock();
        std::set<int64_t> seen;
        std::optional<RingFinding> confirmed;
        for (auto& f : disagreements()) {
            seen.insert(f.number);
            if (suspects.count(f.number) && (!confirmed || f.number < confirmed->number)) confirmed = std::move(f);
        }
        suspects = std::move(seen);
        lock.lock();
        if (!confirmed) continue;
        found_ = std::move(confirmed);
        cv_.notify_all();
        const auto grace = std::chrono::duration<double>(grace_s_);
        if (cv_.wait_for(lock, grace, [this] { return acknowledged_ || stopping_; })) return;
        const std::string text = "zkernel.ranks.diverged: " + message(*found_) +
                                 " (written by the native watchdog: no Python thread could report it, as a thread"
                                 " holds the interpreter lock while it waits on a collective that cannot finish)\n";
        const char* p = text.data();
        size_t left = text.size();
        while (left > 0) {
            const ssize_t n = ::write(2, p, left);
            if (n <= 0) break;
            p += n;
            left -= static_cast<size_t>(n);
        }
        ::_exit(1);
    }
}

std::optional<RingFinding> RingWatch::wait(double timeout_s) {
    std::unique_lock<std::mutex> lock(mu_);
    auto ready = [this] { return found_.has_value() || stopping_; };
    if (timeout_s < 0)
        cv_.wait(lock, ready);
    else
        cv_.wait_for(lock, std::chrono::duration<double>(timeout_s), ready);
    return found_;
}

std::string RingWatch::message(const RingFinding& f) const {
    std::string out = text_.head + std::to_string(f.micro_step) + text_.middle;
    for (size_t r = 0; r < f.rows.size(); ++r) {
        const int64_t index = f.rows[r][1], kind = f.rows[r][2];
        const int64_t at = index * text_.kinds + kind;
        std::string clause = (index >= 0 && kind >= 0 && kind < text_.kinds &&
                              at < static_cast<int64_t>(text_.clauses.size()))
                                 ? text_.clauses[static_cast<size_t>(at)]
                                 : "move group " + std::to_string(index);
        out += (r ? ", rank " : "rank ") + std::to_string(r) + " was about to " + clause;
    }
    return out + text_.tail;
}

}  // namespace zk
