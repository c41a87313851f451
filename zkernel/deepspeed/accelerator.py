"""``deepspeed.accelerator.get_accelerator()``: the device a DeepSpeed script asks for by name.

DeepSpeed scripts write ``get_accelerator().device_name(local_rank)`` instead of
``"cuda:N"`` so that they run on other devices. Here the accelerator is the one zkernel
computes on: CUDA where torch sees a GPU, else the CPU (a process then trains with
gloo, as zkernel does). On the CPU, as DeepSpeed's CPU accelerator, the device name
carries no index and ``set_device`` does nothing; what only a GPU has (streams,
memory statistics) is not offered and raises `AttributeError` naming what is.
"""

from __future__ import annotations

import torch


class Accelerator:
    """The device zkernel computes on, with the methods of DeepSpeed's accelerator that scripts call."""

    def __init__(self, device_type: str) -> None:
        self._type = device_type

    def __repr__(self) -> str:
        return f"Accelerator({self._type!r})"

    def device_name(self, device_index: int | None = None) -> str:
        """``"cuda"`` or ``"cuda:N"`` on a GPU; ``"cpu"`` on the CPU, whatever the index (as DeepSpeed's)."""
        if self._type == "cpu" or device_index is None:
            return self._type
        return f"{self._type}:{device_index}"

    def current_device_name(self) -> str:
        """The device this process computes on, with its index on a GPU."""
        if self._type == "cpu":
            return "cpu"
        return f"cuda:{torch.cuda.current_device()}"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._type == "cuda" else 0

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def device_count(self) -> int:
        """GPUs torch sees; 1 on the CPU (as DeepSpeed's CPU accelerator counts one device per node)."""
        return torch.cuda.device_count() if self._type == "cuda" else 1

    def is_available(self) -> bool:
        return True

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` this process's GPU; nothing on the CPU."""
        if self._type == "cuda":
            torch.cuda.set_device(device_index)

    def synchronize(self, device_index: int | None = None) -> None:
        """Wait for the GPU's queued work; nothing on the CPU, where work runs as it is called."""
        if self._type == "cuda":
            torch.cuda.synchronize(device_index)

    def empty_cache(self) -> None:
        if self._type == "cuda":
            torch.cuda.empty_cache()

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed) if self._type == "cpu" else torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed) if self._type == "cpu" else torch.cuda.manual_seed_all(seed)

    def is_bf16_supported(self) -> bool:
        return True if self._type == "cpu" else torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        """The backend zkernel forms its group with on this device: ``"nccl"`` on GPUs, ``"gloo"`` on the CPU."""
        return "nccl" if self._type == "cuda" else "gloo"

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1) -> torch.Tensor:
        return tensor.pin_memory() if self._type == "cuda" else tensor

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._type

    def __getattr__(self, name: str):
        gpu_only = name.startswith(("memory_", "max_memory", "reset_peak", "reset_max", "Stream", "Event")) or name in (
            "stream", "current_stream", "default_stream", "memory_stats", "total_memory", "available_memory")
        if self._type == "cuda" and gpu_only and hasattr(torch.cuda, name):
            return getattr(torch.cuda, name)
        raise AttributeError(
            f"the {self._type} accelerator of zkernel.deepspeed has no {name!r}"
            + (" (GPU streams and memory statistics exist only on a GPU)" if gpu_only else "")
        )


_accelerator: Accelerator | None = None


def get_accelerator() -> Accelerator:
    """The accelerator of this process (made on the first call): CUDA where torch sees a GPU, else the CPU."""
    global _accelerator
    if _accelerator is None:
        _accelerator = Accelerator("cuda" if torch.cuda.is_available() else "cpu")
    return _accelerator
