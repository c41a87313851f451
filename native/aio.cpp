// Asynchronous file I/O engine; the algorithm is described in aio.h.
#include "aio.h"

#include "crc32c.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstdint>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace zk {
namespace {

struct Request {
    AioResult result;
    int fd_direct = -1;
    int fd_buffered = -1;
    std::atomic<int64_t> remaining{0};
    std::atomic<bool> failed{false};
    std::mutex error_mutex;
    // With a checksum: each chunk's CRC32C and length, in file order (chunk i
    // writes only slot i; the last chunk's completion orders them for finish()).
    std::vector<uint32_t> chunk_crc;
    std::vector<int64_t> chunk_len;

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
    int64_t index;  // position among the request's chunks, in file order
};

// The CRC32C of a whole request from its chunks' CRCs, joined in file order.
uint32_t combine_chunks(const std::vector<uint32_t>& crcs, const std::vector<int64_t>& lens) {
    uint32_t crc = 0;
    int64_t op_len = -1;
    uint32_t op = 0;
    for (size_t i = 0; i < crcs.size(); ++i) {
        if (lens[i] != op_len) {  // chunks mostly share one length: one operator for them
            op_len = lens[i];
            op = crc32c_shift_operator(op_len);
        }
        crc = crc32c_shift(crc, op) ^ crcs[i];
    }
    return crc;
}

void check_expected(AioResult& result) {
    result.checksum_mismatch =
        result.checksummed && result.expected_crc >= 0 && static_cast<int64_t>(result.crc32c) != result.expected_crc;
}

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
        if (!r->chunk_crc.empty() && !r->failed.load()) {
            r->result.crc32c = combine_chunks(r->chunk_crc, r->chunk_len);
            r->result.checksummed = true;
            check_expected(r->result);
        }
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
                const bool checksum = !r.chunk_crc.empty();
                const size_t slot = static_cast<size_t>(chunk.index);
                if (checksum && r.result.op == AioOp::WRITE)
                    r.chunk_crc[slot] = crc32c_update(0, chunk.buffer, chunk.nbytes);
                int64_t at = -1;
                int err = transfer(r.result.op, chunk.fd, chunk.buffer, chunk.nbytes, chunk.offset, &at);
                if (err != 0) r.fail(err == -1 ? 0 : err, err == -1, at);
                else if (checksum && r.result.op == AioOp::READ)
                    r.chunk_crc[slot] = crc32c_update(0, chunk.buffer, chunk.nbytes);
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

int64_t AioEngine::submit(AioOp op, void* buffer, int64_t nbytes, const std::string& path, int64_t offset,
                          bool checksum, int64_t expected_crc) {
    if (nbytes < 0 || offset < 0) throw std::invalid_argument("aio: negative length or offset");
    if (expected_crc >= 0 && op != AioOp::READ)
        throw std::invalid_argument("aio: an expected CRC32C is for reads; a write computes its CRC");
    if (expected_crc > static_cast<int64_t>(UINT32_MAX))
        throw std::invalid_argument("aio: expected CRC32C must be in 0..2^32-1");
    checksum = checksum || expected_crc >= 0;
    auto r = std::make_shared<Request>();
    r->result.op = op;
    r->result.path = path;
    r->result.offset = offset;
    r->result.nbytes = nbytes;
    r->result.expected_crc = expected_crc;

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
        auto add = [&](int fd, int64_t pos, int64_t len) {
            chunks.push_back({r, fd, base + pos, len, offset + pos, static_cast<int64_t>(chunks.size())});
        };
        for (int64_t pos = 0; pos < nbytes; pos += config_.block_size) {
            const int64_t len = std::min(config_.block_size, nbytes - pos);
            if (pos + len <= direct_bytes) {
                add(r->fd_direct, pos, len);
            } else if (pos < direct_bytes) {  // block straddles the aligned end: split it
                add(r->fd_direct, pos, direct_bytes - pos);
                add(r->fd_buffered, direct_bytes, pos + len - direct_bytes);
            } else {
                add(r->fd_buffered, pos, len);
            }
        }
        if (checksum) {
            r->chunk_crc.assign(chunks.size(), 0);
            r->chunk_len.reserve(chunks.size());
            for (const Chunk& c : chunks) r->chunk_len.push_back(c.nbytes);
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
        if (checksum && open_error == 0) {  // zero bytes: the CRC of nothing
            r->result.checksummed = true;
            r->result.crc32c = 0;
            check_expected(r->result);
        }
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
