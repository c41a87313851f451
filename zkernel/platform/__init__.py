"""What zkernel runs on: torch.distributed, CUDA streams, the native extension, files.

`distributed` (process-group wrappers), `streams`, `native` (the pybind11
kernels: CPU Adam, CRC32C, the async file I/O engine), `aio`, `host_memory`
(pinned, aligned host buffers), `machine` (capacities and measured rates),
`sizes` (byte sizes read and written), `compiled` (torch.compile helpers),
`adam_math` (the reference of the native Adam kernels), `split_master` (an
fp32 master as its bf16 rounding and low half; its CUDA kernels in
`split_master_triton`).
"""
