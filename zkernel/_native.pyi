"""Type stub of the compiled extension built from native/ (see native/bindings.cpp).

Buffers cross as integer addresses plus lengths; use the checked wrappers in
`zkernel.native` and `zkernel.aio` rather than calling these directly.
"""

import enum
from collections.abc import Callable

def abi_version() -> int: ...
def pool_threads() -> int: ...
def set_pool_threads(threads: int) -> None: ...

class GradDtype(enum.Enum):
    F32 = 0
    BF16 = 1

class OutDtype(enum.Enum):
    NONE = 0
    BF16 = 1
    F16 = 2

def adam_step(
    param: int,
    grad: int,
    grad_dtype: GradDtype,
    exp_avg: int,
    exp_avg_sq: int,
    out: int,
    out_dtype: OutDtype,
    n: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float,
    step: int,
    adamw: bool,
    threads: int = 0,
) -> None: ...
def adam_rollback(
    param: int,
    grad: int,
    grad_dtype: GradDtype,
    exp_avg: int,
    exp_avg_sq: int,
    n: int,
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    grad_scale: float,
    step: int,
    adamw: bool,
    threads: int = 0,
) -> None: ...
def convert_f32(src: int, dst: int, dst_dtype: OutDtype, n: int, threads: int = 0) -> None: ...
def simd_path() -> str: ...
def best_simd_path() -> str: ...
def set_simd_path(name: str) -> None: ...
def probe_copy(src: int, dst: int, n: int, threads: int = 0) -> None: ...
def probe_adam_pattern(p: int, g: int, m: int, v: int, n: int, threads: int = 0) -> None: ...

class AioOp(enum.Enum):
    READ = 0
    WRITE = 1

class AioResult:
    @property
    def id(self) -> int: ...
    @property
    def op(self) -> AioOp: ...
    @property
    def path(self) -> str: ...
    @property
    def offset(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    @property
    def error(self) -> int: ...
    @property
    def eof(self) -> bool: ...
    @property
    def error_offset(self) -> int: ...
    @property
    def direct(self) -> bool: ...

class AioEngine:
    def __init__(
        self, *, block_size: int, threads: int, queue_depth: int, direct: bool, alignment: int
    ) -> None: ...
    def submit(self, op: AioOp, buffer: int, nbytes: int, path: str, offset: int) -> int: ...
    def wait(self, id: int) -> AioResult: ...
    def wait_any(self) -> AioResult: ...
    def wait_all(self) -> list[AioResult]: ...
    def done(self, id: int) -> bool: ...
    def pending(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def threads(self) -> int: ...
    @property
    def queue_depth(self) -> int: ...
    @property
    def direct(self) -> bool: ...
    @property
    def alignment(self) -> int: ...

class AlignedBuffer:
    def __init__(self, nbytes: int, alignment: int) -> None: ...
    @property
    def address(self) -> int: ...
    @property
    def nbytes(self) -> int: ...
    on_free: Callable[[], object] | None

def preallocate_file(path: str, nbytes: int) -> int: ...
