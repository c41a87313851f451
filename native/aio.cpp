// Asynchronous file I/O engine; the algorithm is described in aio.h.
#include "aio.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>

namespace zk {
namespace {

struct Request {
    AioResult result;
    int fd_direct = -1;
    int fd_buffered = -1;
    std::atomic<int64_t> remaining{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;

    void fail(int err, bool eof, int64_t at) {
        std::lock_guard<std::mutex> lock(error_mutex);
        if (!failed.load()) {
            result.error = err;
            result.eof = eof;
            result.error_offset = at;
            failed.store(true);
        }
    }
};

struct Chunk {
    std::shared_ptr<Request> request;
    int fd;
    char* buffer;
    int64_t nbytes;
    int64_t offset;
};

int open_file(const std::string& path, AioOp op, bool direct) {
    int flags = (op == AioOp::READ ? O_RDONLY : (O_WRONLY | O_CREAT)) | O_CLOEXEC;
    if (direct) flags |= O_DIRECT;
    int fd;
    do {
        fd = ::open(path.c_str(), flags, S_IRUSR | S_IWUSR);
    } while (fd < 0 && errno == EINTR);
    return fd < 0 ? -errno : fd;
}

// Transfer one chunk completely; returns 0, an errno, or -1 for end of file.
int transfer(AioOp op, int fd, char* buffer, int64_t nbytes, int64_t offset, int64_t* at) {
    int64_t done = 0;
    while (done < nbytes) {
        ssize_t n = op == AioOp::READ
                        ? ::pread(fd, buffer + done, static_cast<size_t>(nbytes - done), offset + done)
                        : ::pwrite(fd, buffer + done, static_cast<size_t>(nbytes - done), offset + done);
        if (n < 0) {
            if (errno == EINTR) continue;
            *at = offset + done;
            return errno;
        }
        if (n == 0) {
            *at = offset + done;
            return op == AioOp::READ ? -1 : EIO;
        }
        done += n;
    }
    return 0;
}

}  // namespace

struct AioEngine::Impl {
    std::mutex mutex;
    std::condition_variable work_ready;   // workers wait for chunks
    std::condition_variable completed;    // waiters and blocked submitters
    std::deque<Chunk> queue;
    std::map<int64_t, std::shared_ptr<Request>> outstanding;  // submitted, not finished
    std::map<int64_t, AioResult> finished;                    // finished, not collected
    std::vector<std::thread> workers;
    int64_t next_id = 0;
    bool quit = false;

    void finish(const std::shared_ptr<Request>& r) {
        if (r->fd_direct >= 0) ::close(r->fd_direct);
        if (r->fd_buffered >= 0) ::close(r->fd_buffered);
        {
            std::lock_guard<std::mutex> lock(mutex);
            outstanding.erase(r->result.id);
            finished.emplace(r->result.id, r->result);
        }
        completed.notify_all();
    }

    void run_worker() {
        for (;;) {
            Chunk chunk;
            {
                std::unique_lock<std::mutex> lock(mutex);
                work_ready.wait(lock, [&] { return quit || !queue.empty(); });
                if (queue.empty()) return;
                chunk = std::move(queue.front());
                queue.pop_front();
            }
            Request& r = *chunk.request;
            if (!r.failed.load(std::memory_order_relaxed)) {
                int64_t at = -1;
                int err = transfer(r.result.op, chunk.fd, chunk.buffer, chunk.nbytes, chunk.offset, &at);
                if (err != 0) r.fail(err == -1 ? 0 : err, err == -1, at);
            }
            if (r.remaining.fetch_sub(1) == 1) finish(chunk.request);
        }
    }
};

AioEngine::AioEngine(const AioConfig& config) : config_(config), impl_(new Impl) {
    if (config_.alignment <= 0 || (config_.alignment & (config_.alignment - 1)) != 0)
        throw std::invalid_argument("aio alignment must be a power of two");
    if (config_.block_size <= 0 || config_.block_size % config_.alignment != 0)
        throw std::invalid_argument("aio block_size must be a positive multiple of the alignment (" +
                                    std::to_string(config_.alignment) + ")");
    if (config_.threads < 1) throw std::invalid_argument("aio threads must be >= 1");
    if (config_.queue_depth < 1) throw std::invalid_argument("aio queue_depth must be >= 1");
    for (int i = 0; i < config_.threads; ++i) impl_->workers.emplace_back([this] { impl_->run_worker(); });
}

AioEngine::~AioEngine() {
    {
        std::unique_lock<std::mutex> lock(impl_->mutex);
        impl_->completed.wait(lock, [&] { return impl_->outstanding.empty(); });
        impl_->quit = true;
    }
    impl_->work_ready.notify_all();
    for (auto& w : impl_->workers) w.join();
    delete impl_;
}

int64_t AioEngine::submit(AioOp op, void* buffer, int64_t nbytes, const std::string& path, int64_t offset) {
    if (nbytes < 0 || offset < 0) throw std::invalid_argument("aio: negative length or offset");
    auto r = std::make_shared<Request>();
    r->result.op = op;
    r->result.path = path;
    r->result.offset = offset;
    r->result.nbytes = nbytes;

    const int64_t align = config_.alignment;
    char* base = static_cast<char*>(buffer);
    const bool aligned = reinterpret_cast<uintptr_t>(base) % static_cast<uintptr_t>(align) == 0 &&
                         offset % align == 0;
    int64_t direct_bytes = config_.direct && aligned ? nbytes - nbytes % align : 0;

    int open_error = 0;
    if (direct_bytes > 0) {
        int fd = open_file(path, op, true);
        if (fd == -EINVAL) {
            direct_bytes = 0;  // no O_DIRECT on this file system
        } else if (fd < 0) {
            open_error = -fd;
        } else {
            r->fd_direct = fd;
        }
    }
    if (open_error == 0 && direct_bytes < nbytes) {
        int fd = open_file(path, op, false);
        if (fd < 0) open_error = -fd;
        else r->fd_buffered = fd;
    }
    r->result.direct = r->fd_direct >= 0;

    std::vector<Chunk> chunks;
    if (open_error == 0) {
        for (int64_t pos = 0; pos < nbytes; pos += config_.block_size) {
            const int64_t len = std::min(config_.block_size, nbytes - pos);
            if (pos + len <= direct_bytes) {
                chunks.push_back({r, r->fd_direct, base + pos, len, offset + pos});
            } else if (pos < direct_bytes) {  // block straddles the aligned end: split it
                chunks.push_back({r, r->fd_direct, base + pos, direct_bytes - pos, offset + pos});
                chunks.push_back({r, r->fd_buffered, base + direct_bytes, pos + len - direct_bytes,
                                  offset + direct_bytes});
            } else {
                chunks.push_back({r, r->fd_buffered, base + pos, len, offset + pos});
            }
        }
    } else {
        r->fail(open_error, false, offset);
    }

    std::unique_lock<std::mutex> lock(impl_->mutex);
    impl_->completed.wait(lock, [&] {
        return static_cast<int64_t>(impl_->outstanding.size()) < config_.queue_depth;
    });
    const int64_t id = impl_->next_id++;
    r->result.id = id;
    if (chunks.empty()) {  // failed to open, or zero bytes: complete at once
        if (r->fd_direct >= 0) ::close(r->fd_direct);
        if (r->fd_buffered >= 0) ::close(r->fd_buffered);
        impl_->finished.emplace(id, r->result);
        lock.unlock();
        impl_->completed.notify_all();
        return id;
    }
    r->remaining.store(static_cast<int64_t>(chunks.size()));
    impl_->outstanding.emplace(id, r);
    for (auto& c : chunks) impl_->queue.push_back(std::move(c));
    lock.unlock();
    impl_->work_ready.notify_all();
    return id;
}

AioResult AioEngine::wait(int64_t id) {
    std::unique_lock<std::mutex> lock(impl_->mutex);
    if (impl_->finished.count(id) == 0 && impl_->outstanding.count(id) == 0)
        throw std::out_of_range("aio: no pending request with id " + std::to_string(id));
    impl_->completed.wait(lock, [&] { return impl_->finished.count(id) != 0; });
    auto it = impl_->finished.find(id);
    AioResult result = std::move(it->second);
    impl_->finished.erase(it);
    return result;
}

AioResult AioEngine::wait_any() {
    std::unique_lock<std::mutex> lock(impl_->mutex);
    if (impl_->finished.empty() && impl_->outstanding.empty())
        throw std::out_of_range("aio: no pending request");
    impl_->completed.wait(lock, [&] { return !impl_->finished.empty(); });
    auto it = impl_->finished.begin();
    AioResult result = std::move(it->second);
    impl_->finished.erase(it);
    return result;
}

std::vector<AioResult> AioEngine::wait_all() {
    std::unique_lock<std::mutex> lock(impl_->mutex);
    impl_->completed.wait(lock, [&] { return impl_->outstanding.empty(); });
    std::vector<AioResult> results;
    results.reserve(impl_->finished.size());
    for (auto& kv : impl_->finished) results.push_back(std::move(kv.second));
    impl_->finished.clear();
    return results;
}

bool AioEngine::done(int64_t id) {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    if (impl_->finished.count(id) != 0) return true;
    if (impl_->outstanding.count(id) != 0) return false;
    throw std::out_of_range("aio: no pending request with id " + std::to_string(id));
}

int64_t AioEngine::pending() {
    std::lock_guard<std::mutex> lock(impl_->mutex);
    return static_cast<int64_t>(impl_->outstanding.size() + impl_->finished.size());
}

int preallocate_file(const std::string& path, int64_t nbytes) {
    int fd;
    do {
        fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_CLOEXEC, S_IRUSR | S_IWUSR);
    } while (fd < 0 && errno == EINTR);
    if (fd < 0) return errno;
    int err = 0;
    if (nbytes > 0) {
        int rc = ::fallocate(fd, 0, 0, nbytes);
        if (rc != 0) {
            err = errno;
            if (err == EOPNOTSUPP || err == ENOSYS) err = ::ftruncate(fd, nbytes) == 0 ? 0 : errno;
        }
    }
    if (::close(fd) != 0 && err == 0) err = errno;
    return err;
}

}  // namespace zk
