"""The one door to the native extension `zkernel._native`, with tensor-level checks.

The extension (built from ``native/`` by ``pip install -e .``) takes raw
addresses and lengths so it never links against libtorch; this module turns
tensors into those arguments after checking device, dtype, contiguity and
sizes, so a wrong call raises here instead of corrupting memory there.

Importing this module never fails: the extension is loaded on first use, and a
missing build raises `NativeExtensionError` naming the build step. That keeps
plugin discovery working on an unbuilt checkout (only selecting ``cpu_adam`` or
the NVMe tier fails, with that message).
"""

from __future__ import annotations

import importlib
import os
import types
from typing import Any

import numpy as np
import torch

__all__ = [
    "NativeExtensionError",
    "adam_rollback",
    "adam_step",
    "best_crc32c_path",
    "best_simd_path",
    "buffer_address",
    "convert_f32",
    "crc32c",
    "crc32c_combine",
    "crc32c_path",
    "has_split_master",
    "join_master",
    "load",
    "probe_adam_pattern",
    "probe_copy",
    "set_crc32c_path",
    "set_simd_path",
    "set_threads",
    "simd_path",
    "split_master",
    "threads",
]

BUILD_HINT = (
    "build it from the zkernel checkout with `pip install -e .` "
    "(or `pip install --no-deps --no-build-isolation -e .` where torch and pybind11 are installed); "
    "it needs a C++17 compiler"
)


# The extension's abi_version() this module was written against; bumped when
# native/bindings.cpp gains or changes functions, so a stale build is named as such.
ABI_VERSION = 5


class NativeExtensionError(ImportError):
    """The compiled extension `zkernel._native` is missing, does not load, or is out of date."""


_module: types.ModuleType | None = None


def load() -> types.ModuleType:
    """Return the extension module, importing it on first use."""
    global _module
    if _module is None:
        try:
            _native = importlib.import_module("zkernel._native")
        except ImportError as err:
            raise NativeExtensionError(
                f"zkernel's native extension zkernel._native is not available ({err}); {BUILD_HINT}"
            ) from err
        built = _native.abi_version()
        if built != ABI_VERSION:
            raise NativeExtensionError(
                f"zkernel's native extension zkernel._native is out of date (ABI {built}, this checkout needs "
                f"{ABI_VERSION}): rebuild it; {BUILD_HINT}"
            )
        _module = _native
    return _module


def available() -> bool:
    """Whether the extension can be loaded."""
    try:
        load()
    except NativeExtensionError:
        return False
    return True


_OUT_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16"}


def _check_cpu_contiguous(name: str, t: torch.Tensor, dtypes: tuple[torch.dtype, ...], numel: int) -> None:
    if t.device.type != "cpu":
        raise ValueError(f"{name} must be on CPU, got device {t.device}")
    if t.dtype not in dtypes:
        valid = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype {valid}, got {str(t.dtype).removeprefix('torch.')}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.numel() != numel:
        raise ValueError(f"{name} has {t.numel()} elements, expected {numel}")


def adam_step(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    adamw: bool = True,
    copy_out: torch.Tensor | None = None,
    threads: int | None = None,
) -> None:
    """One Adam (``adamw=False``: L2) or AdamW update of ``param`` in place, in one pass.

    ``param``, ``exp_avg``, ``exp_avg_sq``: contiguous fp32 CPU tensors of one
    numel; ``grad``: fp32 or bf16, same numel, multiplied by ``grad_scale``
    before use (not modified). ``step`` is the 1-based count including this
    update. ``copy_out``: a bf16/fp16 CPU tensor that receives the updated
    params rounded to nearest even. Matches `torch.optim.AdamW`/`Adam`.
    """
    native = load()
    n = param.numel()
    _check_cpu_contiguous("param", param, (torch.float32,), n)
    _check_cpu_contiguous("grad", grad, (torch.float32, torch.bfloat16), n)
    _check_cpu_contiguous("exp_avg", exp_avg, (torch.float32,), n)
    _check_cpu_contiguous("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    out_ptr, out_dtype = 0, native.OutDtype.NONE
    if copy_out is not None:
        _check_cpu_contiguous("copy_out", copy_out, tuple(_OUT_DTYPES), n)
        out_ptr, out_dtype = copy_out.data_ptr(), getattr(native.OutDtype, _OUT_DTYPES[copy_out.dtype])
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count including this update), got {step}")
    native.adam_step(
        param.data_ptr(),
        grad.data_ptr(),
        native.GradDtype.BF16 if grad.dtype == torch.bfloat16 else native.GradDtype.F32,
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        out_ptr,
        out_dtype,
        n,
        lr=float(lr),
        beta1=float(betas[0]),
        beta2=float(betas[1]),
        eps=float(eps),
        weight_decay=float(weight_decay),
        grad_scale=float(grad_scale),
        step=int(step),
        adamw=bool(adamw),
        threads=int(threads or 0),
    )


def _fp32(x: float) -> float:
    """``x`` rounded to fp32, as the kernel rounds its hyperparameters."""
    return float(np.float32(x))


def adam_rollback(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    grad_scale: float = 1.0,
    adamw: bool = True,
    threads: int | None = None,
) -> None:
    """Undo one `adam_step` in place, in one pass: ``param``, ``exp_avg`` and ``exp_avg_sq`` go back to
    their values before it, to within a few ulps.

    Pass what the step got: the same ``grad`` (not modified since) and the same
    hyperparameters, ``step`` being the count of the step undone (the caller
    decrements its own counter). Used for speculative steps: a step started
    before the global gradient norm was known is rolled back and redone when
    clipping or an fp16 overflow applies. Only a step whose gradients were
    finite can be undone (NaN/inf reached the state); check a group's gradients
    before stepping it speculatively.

    Raises ValueError when the step cannot be undone, because it overwrote
    state: ``betas[0] == 0`` (exp_avg became the gradient), ``betas[1] == 0``
    (exp_avg_sq became its square) or, with ``adamw``, ``lr * weight_decay == 1``
    (the decay zeroed the parameters); callers then do not speculate.

    Accuracy ([Note: rollback error] in native/cpu_adam.cpp): p within about
    2 ulp of max(|p_before|, |p_after|); m within about 2 ulp of
    max(|m_before|, |m_after|, (1 - beta1)|g|) / beta1; v likewise with
    (1 - beta2) g^2 and beta2; exact zeros where the step started from zeros
    (the first step, untouched embedding rows). A redo after the rollback
    matches the direct step to ~1e-7 of max|p| unless the gradient was far
    above its history (~2e-5 at 1000x) or, with Adam's L2 term, on a first step.
    """
    native = load()
    n = param.numel()
    _check_cpu_contiguous("param", param, (torch.float32,), n)
    _check_cpu_contiguous("grad", grad, (torch.float32, torch.bfloat16), n)
    _check_cpu_contiguous("exp_avg", exp_avg, (torch.float32,), n)
    _check_cpu_contiguous("exp_avg_sq", exp_avg_sq, (torch.float32,), n)
    if step < 1:
        raise ValueError(f"step must be >= 1 (the count of the step being undone), got {step}")
    beta1, beta2 = float(betas[0]), float(betas[1])
    if _fp32(1.0 - _fp32(1.0 - beta1)) == 0.0:
        raise ValueError(
            f"cannot roll back a step with beta1={beta1}: it replaced exp_avg by the gradient, "
            "so the old exp_avg is gone (do not step speculatively with beta1 == 0)"
        )
    if _fp32(beta2) == 0.0:
        raise ValueError(
            f"cannot roll back a step with beta2={beta2}: it replaced exp_avg_sq by the squared gradient, "
            "so the old exp_avg_sq is gone (do not step speculatively with beta2 == 0)"
        )
    if adamw and weight_decay != 0.0 and _fp32(1.0 - float(lr) * float(weight_decay)) == 0.0:
        raise ValueError(
            f"cannot roll back an AdamW step with lr * weight_decay = {float(lr) * float(weight_decay)}: "
            "its decay factor 1 - lr * weight_decay is 0, so the step zeroed the parameters "
            "(do not step speculatively with lr * weight_decay == 1)"
        )
    native.adam_rollback(
        param.data_ptr(),
        grad.data_ptr(),
        native.GradDtype.BF16 if grad.dtype == torch.bfloat16 else native.GradDtype.F32,
        exp_avg.data_ptr(),
        exp_avg_sq.data_ptr(),
        n,
        lr=float(lr),
        beta1=beta1,
        beta2=beta2,
        eps=float(eps),
        weight_decay=float(weight_decay),
        grad_scale=float(grad_scale),
        step=int(step),
        adamw=bool(adamw),
        threads=int(threads or 0),
    )


def convert_f32(src: torch.Tensor, dst: torch.Tensor, *, threads: int | None = None) -> None:
    """``dst.copy_(src)`` for fp32 ``src`` into bf16/fp16 ``dst`` (round to nearest even), multi-threaded."""
    native = load()
    _check_cpu_contiguous("src", src, (torch.float32,), src.numel())
    _check_cpu_contiguous("dst", dst, tuple(_OUT_DTYPES), src.numel())
    native.convert_f32(
        src.data_ptr(), dst.data_ptr(), getattr(native.OutDtype, _OUT_DTYPES[dst.dtype]), src.numel(), int(threads or 0)
    )


def probe_copy(src: torch.Tensor, dst: torch.Tensor, *, threads: int | None = None) -> None:
    """Copy fp32 ``src`` to ``dst`` on the native thread pool (a bandwidth probe)."""
    native = load()
    _check_cpu_contiguous("src", src, (torch.float32,), src.numel())
    _check_cpu_contiguous("dst", dst, (torch.float32,), src.numel())
    native.probe_copy(src.data_ptr(), dst.data_ptr(), src.numel(), int(threads or 0))


def probe_adam_pattern(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, threads: int | None = None
) -> None:
    """``p += g; m += g; v += g``: the fp32 Adam step's memory traffic with no arithmetic."""
    native = load()
    for name, t in (("p", p), ("g", g), ("m", m), ("v", v)):
        _check_cpu_contiguous(name, t, (torch.float32,), p.numel())
    native.probe_adam_pattern(p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), p.numel(), int(threads or 0))


def simd_path() -> str:
    """The SIMD path `adam_step` uses now: ``"avx512"``, ``"avx2"`` or ``"scalar"``."""
    return load().simd_path()


def best_simd_path() -> str:
    """The best SIMD path this CPU supports."""
    return load().best_simd_path()


def set_simd_path(name: str) -> None:
    """Force ``"avx512"``, ``"avx2"`` or ``"scalar"`` for `adam_step`, `adam_rollback`, `convert_f32`,
    `split_master` and `join_master` (for tests); ``"auto"`` restores the best."""
    try:
        load().set_simd_path(name)
    except Exception as err:  # pybind maps std::invalid_argument to ValueError
        raise ValueError(str(err)) from err


def threads() -> int:
    """Threads the native kernels use by default (env ``ZKERNEL_NATIVE_THREADS``, else usable cores)."""
    return load().pool_threads()


def share_cores(ranks_per_host: int) -> None:
    """Give this rank its share of the host's usable cores when several ranks share a host.

    [Note: host cores]
    Every rank's pool defaults to all usable cores, so four ranks on one host would run
    four times as many threads as cores through the CPU step and the checksums, and each
    rank's step would be slower than with its share. ``ZKERNEL_NATIVE_THREADS`` (set by the
    user) wins; a single rank keeps every core.
    """
    if ranks_per_host <= 1 or os.environ.get("ZKERNEL_NATIVE_THREADS"):
        return
    set_threads(max(1, len(os.sched_getaffinity(0)) // ranks_per_host))


def set_threads(n: int) -> None:
    """Resize the native thread pool (the calling thread counts as one)."""
    if n < 1:
        raise ValueError(f"threads must be >= 1, got {n}")
    load().set_pool_threads(int(n))


# -- CRC32C -------------------------------------------------------------------


def buffer_address(buffer: Any, *, writable: bool = False, what: str = "buffers") -> tuple[int, int]:
    """(address, nbytes) of a contiguous CPU tensor or a C-contiguous buffer-protocol object.

    ``writable``: refuse read-only buffers (for reads into them). ``what`` names
    the argument in the errors.
    """
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError(f"{what} must be on CPU, got a tensor on {buffer.device}")
        if not buffer.is_contiguous():
            raise ValueError(f"{what} must be contiguous")
        return buffer.data_ptr(), buffer.numel() * buffer.element_size()
    try:
        view = memoryview(buffer)
    except TypeError as err:
        raise TypeError(
            f"{what} must be a CPU tensor or support the buffer protocol, got {type(buffer).__name__}"
        ) from err
    if not view.c_contiguous:
        raise ValueError(f"{what} must be C-contiguous")
    if writable and view.readonly:
        raise ValueError(f"cannot read into a read-only buffer ({what})")
    array = np.frombuffer(view.cast("B"), dtype=np.uint8)
    return array.__array_interface__["data"][0], view.nbytes


def _check_crc(name: str, value: int) -> int:
    value = int(value)
    if not 0 <= value <= 0xFFFFFFFF:
        raise ValueError(f"{name} must be a CRC32C value in 0..2**32-1, got {value}")
    return value


def crc32c(data: Any, seed: int = 0, *, threads: int | None = None) -> int:
    """CRC32C (Castagnoli, as SSE4.2's crc32 instruction computes it) of ``data``'s bytes.

    ``data``: a contiguous CPU tensor of any dtype (its bytes in memory order)
    or a C-contiguous buffer-protocol object (bytes, bytearray, memoryview,
    numpy array). ``seed``: the CRC32C of the bytes before, so
    ``crc32c(b, seed=crc32c(a)) == crc32c(a + b)``; 0 to start.
    ``crc32c(b"123456789") == 0xE3069283``. Runs on the SSE4.2 instruction
    (three interleaved lanes) where the CPU has it, else slicing-by-8 tables;
    inputs over 1 MiB are split over the native thread pool (``threads``; None:
    all) and the pieces' CRCs combined.
    """
    native = load()
    address, nbytes = buffer_address(data, what="crc32c data")
    return native.crc32c(address, nbytes, _check_crc("seed", seed), int(threads or 0))


def crc32c_combine(crc_a: int, crc_b: int, len_b: int) -> int:
    """CRC32C of ``A + B`` from ``crc32c(A)``, ``crc32c(B)`` and ``len(B)`` (no data needed)."""
    if len_b < 0:
        raise ValueError(f"len_b must be >= 0, got {len_b}")
    return load().crc32c_combine(_check_crc("crc_a", crc_a), _check_crc("crc_b", crc_b), int(len_b))


def crc32c_path() -> str:
    """The path `crc32c` uses now: ``"sse4.2"`` or ``"table"``."""
    return load().crc32c_path()


def best_crc32c_path() -> str:
    """The fastest CRC32C path this CPU supports."""
    return load().best_crc32c_path()


def set_crc32c_path(name: str) -> None:
    """Force ``"sse4.2"`` or ``"table"`` (for tests); ``"auto"`` restores the best."""
    try:
        load().set_crc32c_path(name)
    except Exception as err:  # pybind maps std::invalid_argument to ValueError
        raise ValueError(str(err)) from err


def has_split_master() -> bool:
    """Whether the built extension has the split-master codec (`zkernel.platform.split_master` uses the
    torch path without it, e.g. on a checkout built before it)."""
    try:
        return hasattr(load(), "split_master")
    except NativeExtensionError:
        return False


def split_master(
    master: torch.Tensor, low: torch.Tensor, ties: torch.Tensor, *, threads: int | None = None
) -> None:
    """Write fp32 ``master``'s low halves into ``low`` (int16) and its tie bits into ``ties`` (uint8,
    packed, ``(numel + 7) // 8`` bytes), in one multi-threaded pass.

    Called by `zkernel.platform.split_master.split_master` for CPU tensors (after every host
    optimizer step of a tier that keeps masters split); see [Note: the master's low half] there for
    the encoding. All three contiguous CPU tensors; ``threads``: None for the pool's default.
    """
    native = load()
    n = master.numel()
    _check_cpu_contiguous("master", master, (torch.float32,), n)
    _check_cpu_contiguous("low", low, (torch.int16,), n)
    _check_cpu_contiguous("ties", ties, (torch.uint8,), (n + 7) // 8)
    native.split_master(master.data_ptr(), low.data_ptr(), ties.data_ptr(), n, int(threads or 0))


def join_master(
    high: torch.Tensor,
    low: torch.Tensor,
    ties: torch.Tensor,
    out: torch.Tensor,
    *,
    threads: int | None = None,
) -> None:
    """Rebuild fp32 masters into ``out`` from their bf16 roundings ``high`` (the parameter), ``low``
    (int16) and ``ties`` (uint8, packed), in one multi-threaded pass.

    Called by `zkernel.platform.split_master.join_master` for CPU tensors (before every host
    optimizer step of a tier that keeps masters split); the inverse of `split_master` for every
    master whose round-to-nearest-even is ``high`` (a NaN comes back as a NaN). All four contiguous
    CPU tensors; ``threads``: None for the pool's default.
    """
    native = load()
    n = out.numel()
    _check_cpu_contiguous("high", high, (torch.bfloat16,), n)
    _check_cpu_contiguous("low", low, (torch.int16,), n)
    _check_cpu_contiguous("ties", ties, (torch.uint8,), (n + 7) // 8)
    _check_cpu_contiguous("out", out, (torch.float32,), n)
    native.join_master(high.data_ptr(), low.data_ptr(), ties.data_ptr(), out.data_ptr(), n, int(threads or 0))
