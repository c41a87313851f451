// Asynchronous file I/O engine (the DeepNVMe role): many reads and writes of
// (buffer, path, offset, length) in flight, submitted without blocking.
//
// A request is split into block_size chunks that a pool of I/O threads serves
// with pread/pwrite, each thread keeping one chunk in flight (so the device sees
// up to `threads` concurrent I/Os). The part of a request whose buffer address
// and file offset are aligned to `alignment` goes through an O_DIRECT file
// descriptor (no page-cache copy); a length that is not a multiple of
// `alignment` leaves a tail that goes through an ordinary descriptor of the same
// file, and a misaligned buffer or offset sends the whole request there. On a
// file system without O_DIRECT (tmpfs) the engine falls back to buffered I/O.
// A request completes when its last chunk does; the first failing chunk's errno
// and file offset are kept, later chunks of that request are skipped, and
// nothing else is affected (a failed request does not poison the engine).
// Files are opened per request (created with mode 0600 for writes, never
// truncated) and closed when it completes. At most `queue_depth` requests are
// outstanding; submit() blocks while that many are.
//
// Checksums (optional, per request): the I/O thread that moves a chunk also
// computes its CRC32C (crc32c.h), right before pwrite or right after pread, so
// checksumming runs in parallel on the I/O threads while the data is at hand
// and costs no extra pass over the buffer afterwards. When the request
// completes, the chunk CRCs are combined in file order into the CRC32C of the
// whole request; a read given an expected CRC is marked as a mismatch when
// they differ (the caller decides what that means).
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace zk {

struct AioConfig {
    int64_t block_size = 1 << 20;  // bytes per chunk; a multiple of alignment
    int threads = 8;               // I/O threads = concurrent I/Os to the device
    int queue_depth = 128;         // outstanding requests before submit() blocks
    bool direct = true;            // use O_DIRECT for the aligned part
    int64_t alignment = 4096;      // O_DIRECT alignment of buffers, offsets, lengths
};

enum class AioOp : int { READ = 0, WRITE = 1 };

struct AioResult {
    int64_t id = -1;
    AioOp op = AioOp::READ;
    std::string path;
    int64_t offset = 0;      // where the request starts in the file
    int64_t nbytes = 0;      // requested length
    int error = 0;           // errno of the first failure, 0 when none
    bool eof = false;        // a read reached the end of the file early
    int64_t error_offset = -1;  // file offset of the failing chunk
    bool direct = false;     // whether any of it went through O_DIRECT
    bool checksummed = false;      // a CRC32C was asked for and computed (no I/O error)
    uint32_t crc32c = 0;           // CRC32C of the request's bytes, when checksummed
    int64_t expected_crc = -1;     // what a read was expected to hold, -1 when not given
    bool checksum_mismatch = false;  // checksummed, expected_crc given, and they differ
};

class AioEngine {
  public:
    explicit AioEngine(const AioConfig& config);
    ~AioEngine();  // waits for outstanding requests
    AioEngine(const AioEngine&) = delete;
    AioEngine& operator=(const AioEngine&) = delete;

    // Queue a request and return its id. Never fails for I/O reasons: a path
    // that cannot be opened completes at once with its errno. `checksum`: compute
    // the CRC32C of the bytes moved; `expected_crc` (0..2^32-1, reads only, implies
    // checksum): compare it with the CRC of the bytes read.
    int64_t submit(AioOp op, void* buffer, int64_t nbytes, const std::string& path, int64_t offset,
                   bool checksum = false, int64_t expected_crc = -1);

    // Block until request `id` completes, and collect it.
    AioResult wait(int64_t id);
    // Block until any uncollected request completes, and collect it.
    AioResult wait_any();
    // Block until every outstanding request completes; collect all, in id order.
    std::vector<AioResult> wait_all();
    // Whether request `id` has completed (it stays uncollected).
    bool done(int64_t id);
    // Outstanding (submitted, not yet collected) requests.
    int64_t pending();

    const AioConfig& config() const { return config_; }

  private:
    struct Impl;
    AioConfig config_;
    Impl* impl_;
};

// Create `path` (mode 0600) if needed and reserve `nbytes` of disk for it
// (fallocate; ftruncate where unsupported). Returns 0 or an errno.
int preallocate_file(const std::string& path, int64_t nbytes);

}  // namespace zk
