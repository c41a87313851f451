// Thin pybind11 binding over the native kernels; see cpu_adam.h, crc32c.h,
// aio.h, bandwidth.h, ring_watch.h and split_master.h. Buffers cross as integer addresses (tensor.data_ptr()) plus
// lengths, so nothing here links against libtorch. Every call that touches
// memory or files releases the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <cstdlib>
#include <new>

#include "aio.h"
#include "bandwidth.h"
#include "cpu_adam.h"
#include "crc32c.h"
#include "ring_watch.h"
#include "split_master.h"
#include "thread_pool.h"

namespace py = pybind11;
using release_gil = py::call_guard<py::gil_scoped_release>;

template <typename T>
T* ptr(std::uintptr_t address) {
    return reinterpret_cast<T*>(address);
}

// Heap memory aligned for O_DIRECT, exported through the buffer protocol so
// torch.frombuffer / numpy can view it without a copy (the view keeps this
// object alive). `on_free`, if set, is called just before the memory is freed
// (zkernel.aio uses it to cudaHostUnregister a page-locked buffer).
class AlignedBuffer {
  public:
    AlignedBuffer(std::int64_t nbytes, std::int64_t alignment) : nbytes_(nbytes) {
        if (nbytes < 0) throw std::invalid_argument("AlignedBuffer: negative size");
        if (alignment <= 0 || (alignment & (alignment - 1)) != 0 || alignment % sizeof(void*) != 0)
            throw std::invalid_argument("AlignedBuffer: alignment must be a power of two >= pointer size");
        const std::size_t rounded = static_cast<std::size_t>((nbytes + alignment - 1) / alignment * alignment);
        if (posix_memalign(&data_, static_cast<std::size_t>(alignment), rounded == 0 ? alignment : rounded) != 0)
            throw std::bad_alloc();
    }
    ~AlignedBuffer() {
        if (on_free && !on_free.is_none()) {
            try {
                on_free();
            } catch (py::error_already_set& e) {
                e.discard_as_unraisable("zkernel._native.AlignedBuffer.on_free");
            }
        }
        std::free(data_);
    }
    AlignedBuffer(const AlignedBuffer&) = delete;
    AlignedBuffer& operator=(const AlignedBuffer&) = delete;

    void* data() const { return data_; }
    std::int64_t nbytes() const { return nbytes_; }
    py::object on_free;

  private:
    void* data_ = nullptr;
    std::int64_t nbytes_;
};

PYBIND11_MODULE(_native, m) {
    m.doc() = "zkernel native core: CPU Adam, the split master's codec, async file I/O, bandwidth probes";
    m.def("abi_version", []() { return 5; });  // zkernel/platform/native.py ABI_VERSION

    // -- thread pool -------------------------------------------------------
    m.def("pool_threads", &zk::pool_threads);
    m.def("set_pool_threads", &zk::set_pool_threads, py::arg("threads"), release_gil());

    // -- CPU Adam ----------------------------------------------------------
    py::enum_<zk::GradDtype>(m, "GradDtype")
        .value("F32", zk::GradDtype::F32)
        .value("BF16", zk::GradDtype::BF16);
    py::enum_<zk::OutDtype>(m, "OutDtype")
        .value("NONE", zk::OutDtype::NONE)
        .value("BF16", zk::OutDtype::BF16)
        .value("F16", zk::OutDtype::F16);

    m.def(
        "adam_step",
        [](std::uintptr_t param, std::uintptr_t grad, zk::GradDtype grad_dtype, std::uintptr_t exp_avg,
           std::uintptr_t exp_avg_sq, std::uintptr_t out, zk::OutDtype out_dtype, std::int64_t n,
           double lr, double beta1, double beta2, double eps, double weight_decay, double grad_scale,
           std::int64_t step, bool adamw, int threads) {
            zk::AdamHyper h;
            h.lr = lr;
            h.beta1 = beta1;
            h.beta2 = beta2;
            h.eps = eps;
            h.weight_decay = weight_decay;
            h.grad_scale = grad_scale;
            h.step = step;
            h.adamw = adamw;
            zk::adam_step(ptr<float>(param), ptr<void>(grad), grad_dtype, ptr<float>(exp_avg),
                          ptr<float>(exp_avg_sq), ptr<void>(out), out_dtype, n, h, threads);
        },
        py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"),
        py::arg("exp_avg_sq"), py::arg("out"), py::arg("out_dtype"), py::arg("n"), py::kw_only(),
        py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
        py::arg("grad_scale"), py::arg("step"), py::arg("adamw"), py::arg("threads") = 0, release_gil());
    m.def(
        "adam_rollback",
        [](std::uintptr_t param, std::uintptr_t grad, zk::GradDtype grad_dtype, std::uintptr_t exp_avg,
           std::uintptr_t exp_avg_sq, std::int64_t n, double lr, double beta1, double beta2, double eps,
           double weight_decay, double grad_scale, std::int64_t step, bool adamw, int threads) {
            zk::AdamHyper h;
            h.lr = lr;
            h.beta1 = beta1;
            h.beta2 = beta2;
            h.eps = eps;
            h.weight_decay = weight_decay;
            h.grad_scale = grad_scale;
            h.step = step;
            h.adamw = adamw;
            zk::adam_rollback(ptr<float>(param), ptr<void>(grad), grad_dtype, ptr<float>(exp_avg),
                              ptr<float>(exp_avg_sq), n, h, threads);
        },
        py::arg("param"), py::arg("grad"), py::arg("grad_dtype"), py::arg("exp_avg"), py::arg("exp_avg_sq"),
        py::arg("n"), py::kw_only(), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("weight_decay"), py::arg("grad_scale"), py::arg("step"), py::arg("adamw"), py::arg("threads") = 0,
        release_gil());
    m.def(
        "convert_f32",
        [](std::uintptr_t src, std::uintptr_t dst, zk::OutDtype dst_dtype, std::int64_t n, int threads) {
            zk::convert_f32(ptr<const float>(src), ptr<void>(dst), dst_dtype, n, threads);
        },
        py::arg("src"), py::arg("dst"), py::arg("dst_dtype"), py::arg("n"), py::arg("threads") = 0,
        release_gil());
    m.def("simd_path", &zk::simd_path);
    m.def("best_simd_path", &zk::best_simd_path);
    m.def("set_simd_path", &zk::set_simd_path, py::arg("name"));

    // -- split master (split_master.h) ---------------------------------------
    m.def(
        "split_master",
        [](std::uintptr_t master, std::uintptr_t low, std::uintptr_t ties, std::int64_t n, int threads) {
            zk::split_master(ptr<const float>(master), ptr<std::uint16_t>(low), ptr<std::uint8_t>(ties), n, threads);
        },
        py::arg("master"), py::arg("low"), py::arg("ties"), py::arg("n"), py::arg("threads") = 0, release_gil());
    m.def(
        "join_master",
        [](std::uintptr_t high, std::uintptr_t low, std::uintptr_t ties, std::uintptr_t out, std::int64_t n,
           int threads) {
            zk::join_master(ptr<const std::uint16_t>(high), ptr<const std::uint16_t>(low),
                            ptr<const std::uint8_t>(ties), ptr<float>(out), n, threads);
        },
        py::arg("high"), py::arg("low"), py::arg("ties"), py::arg("out"), py::arg("n"), py::arg("threads") = 0,
        release_gil());

    // -- CRC32C ------------------------------------------------------------
    m.def(
        "crc32c",
        [](std::uintptr_t data, std::int64_t n, std::uint32_t crc, int threads) {
            return zk::crc32c_parallel(crc, ptr<const void>(data), n, threads);
        },
        py::arg("data"), py::arg("n"), py::arg("crc") = 0, py::arg("threads") = 0, release_gil());
    m.def("crc32c_combine", &zk::crc32c_combine, py::arg("crc_a"), py::arg("crc_b"), py::arg("len_b"));
    m.def("crc32c_path", &zk::crc32c_path);
    m.def("best_crc32c_path", &zk::best_crc32c_path);
    m.def("set_crc32c_path", &zk::set_crc32c_path, py::arg("name"));

    // -- bandwidth probes --------------------------------------------------
    m.def(
        "probe_copy",
        [](std::uintptr_t src, std::uintptr_t dst, std::int64_t n, int threads) {
            zk::probe_copy(ptr<const float>(src), ptr<float>(dst), n, threads);
        },
        py::arg("src"), py::arg("dst"), py::arg("n"), py::arg("threads") = 0, release_gil());
    m.def(
        "probe_adam_pattern",
        [](std::uintptr_t p, std::uintptr_t g, std::uintptr_t mm, std::uintptr_t v, std::int64_t n,
           int threads) {
            zk::probe_adam_pattern(ptr<float>(p), ptr<const float>(g), ptr<float>(mm), ptr<float>(v), n,
                                   threads);
        },
        py::arg("p"), py::arg("g"), py::arg("m"), py::arg("v"), py::arg("n"), py::arg("threads") = 0,
        release_gil());

    // -- async file I/O ----------------------------------------------------
    py::enum_<zk::AioOp>(m, "AioOp").value("READ", zk::AioOp::READ).value("WRITE", zk::AioOp::WRITE);

    py::class_<zk::AioResult>(m, "AioResult")
        .def_readonly("id", &zk::AioResult::id)
        .def_readonly("op", &zk::AioResult::op)
        .def_readonly("path", &zk::AioResult::path)
        .def_readonly("offset", &zk::AioResult::offset)
        .def_readonly("nbytes", &zk::AioResult::nbytes)
        .def_readonly("error", &zk::AioResult::error)
        .def_readonly("eof", &zk::AioResult::eof)
        .def_readonly("error_offset", &zk::AioResult::error_offset)
        .def_readonly("direct", &zk::AioResult::direct)
        .def_readonly("checksummed", &zk::AioResult::checksummed)
        .def_readonly("crc32c", &zk::AioResult::crc32c)
        .def_readonly("expected_crc", &zk::AioResult::expected_crc)
        .def_readonly("checksum_mismatch", &zk::AioResult::checksum_mismatch);

    py::class_<zk::AioEngine>(m, "AioEngine")
        .def(py::init([](std::int64_t block_size, int threads, int queue_depth, bool direct,
                         std::int64_t alignment) {
                 zk::AioConfig c;
                 c.block_size = block_size;
                 c.threads = threads;
                 c.queue_depth = queue_depth;
                 c.direct = direct;
                 c.alignment = alignment;
                 return new zk::AioEngine(c);
             }),
             py::kw_only(), py::arg("block_size"), py::arg("threads"), py::arg("queue_depth"),
             py::arg("direct"), py::arg("alignment"))
        .def(
            "submit",
            [](zk::AioEngine& e, zk::AioOp op, std::uintptr_t buffer, std::int64_t nbytes,
               const std::string& path, std::int64_t offset, bool checksum, std::int64_t expected_crc) {
                return e.submit(op, ptr<void>(buffer), nbytes, path, offset, checksum, expected_crc);
            },
            py::arg("op"), py::arg("buffer"), py::arg("nbytes"), py::arg("path"), py::arg("offset"),
            py::kw_only(), py::arg("checksum") = false, py::arg("expected_crc") = -1, release_gil())
        .def("wait", &zk::AioEngine::wait, py::arg("id"), release_gil())
        .def("wait_any", &zk::AioEngine::wait_any, release_gil())
        .def("wait_all", &zk::AioEngine::wait_all, release_gil())
        .def("done", &zk::AioEngine::done, py::arg("id"))
        .def("pending", &zk::AioEngine::pending)
        .def_property_readonly("block_size", [](const zk::AioEngine& e) { return e.config().block_size; })
        .def_property_readonly("threads", [](const zk::AioEngine& e) { return e.config().threads; })
        .def_property_readonly("queue_depth", [](const zk::AioEngine& e) { return e.config().queue_depth; })
        .def_property_readonly("direct", [](const zk::AioEngine& e) { return e.config().direct; })
        .def_property_readonly("alignment", [](const zk::AioEngine& e) { return e.config().alignment; });

    py::class_<AlignedBuffer>(m, "AlignedBuffer", py::buffer_protocol())
        .def(py::init<std::int64_t, std::int64_t>(), py::arg("nbytes"), py::arg("alignment"))
        .def_property_readonly("address", [](const AlignedBuffer& b) { return reinterpret_cast<std::uintptr_t>(b.data()); })
        .def_property_readonly("nbytes", &AlignedBuffer::nbytes)
        .def_readwrite("on_free", &AlignedBuffer::on_free)
        .def_buffer([](AlignedBuffer& b) {
            return py::buffer_info(b.data(), 1, py::format_descriptor<std::uint8_t>::format(), 1,
                                   {static_cast<py::ssize_t>(b.nbytes())}, {static_cast<py::ssize_t>(1)});
        });

    // -- rank-path ring watcher (zkernel/divergence.py) ---------------------
    py::class_<zk::RingWatch>(m, "RingWatch")
        .def(py::init([](std::uintptr_t rows, py::object /*owner*/, std::int64_t slots, std::int64_t world, double poll_s, double grace_s,
                         std::vector<std::string> clauses, std::int64_t kinds, std::string head, std::string middle,
                         std::string tail) {
                 zk::RingText text{std::move(clauses), kinds, std::move(head), std::move(middle), std::move(tail)};
                 return new zk::RingWatch(ptr<const std::int64_t>(rows), slots, world, poll_s, grace_s, std::move(text));
             }),
             // `owner` (the tensor whose memory `rows` is) lives as long as the watcher reads it.
             py::arg("rows"), py::arg("owner"), py::arg("slots"), py::arg("world"), py::kw_only(), py::arg("poll_s"),
             py::arg("grace_s"), py::arg("clauses"), py::arg("kinds"), py::arg("head"), py::arg("middle"),
             py::arg("tail"), py::keep_alive<1, 3>())
        .def(
            "wait",
            [](zk::RingWatch& w, double timeout_s) -> py::object {
                std::optional<zk::RingFinding> f;
                {
                    py::gil_scoped_release no_gil;
                    f = w.wait(timeout_s);
                }
                if (!f) return py::none();
                return py::make_tuple(f->number, f->micro_step, f->rows);
            },
            py::arg("timeout_s") = -1.0)
        .def(
            "scan",
            [](const zk::RingWatch& w) -> py::object {
                auto f = w.scan();
                if (!f) return py::none();
                return py::make_tuple(f->number, f->micro_step, f->rows);
            })
        .def("acknowledge", &zk::RingWatch::acknowledge, release_gil())
        .def("stop", &zk::RingWatch::stop, release_gil());

    m.def("preallocate_file", &zk::preallocate_file, py::arg("path"), py::arg("nbytes"), release_gil());
}
