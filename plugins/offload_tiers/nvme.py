"""Tier ``nvme``: optimizer state (fp32 masters and declared state) and parameter shards in swap files.

The optimizer role is `NvmeTier` (``_nvme_optimizer``), the params role
`NvmeParamsTier` (``_nvme_params``); both keep their files in one run
directory per engine under ``offload.nvme_path`` (``_swap_dir``), move them
through the native async I/O engine with a reaper thread (``_io_queue``),
stage them in a bounded pool of page-locked blocks (``_arena``) and check
every read against the CRC32C of what was written (``_swap_file``). Each role
has its own options (``_nvme_options``).
"""

from __future__ import annotations

from zkernel.spec import ConfigError, hookimpl

from ._nvme_optimizer import NvmeTier
from ._nvme_options import NvmeParamsOptions, NvmeTierOptions
from ._nvme_params import NvmeParamsTier

__all__ = ["NvmeParamsOptions", "NvmeParamsTier", "NvmeTier", "NvmeTierOptions", "nvme_tier"]


def check_nvme_config(config, slot) -> None:
    """Either role keeps its swap files under ``offload.nvme_path``: it must be set."""
    if config.offload.nvme_path is None:
        raise ConfigError("offload.nvme_path is required when offload.optimizer or offload.params is 'nvme'")


def nvme_tier(context, role: str):
    return NvmeTier(context, role) if role == "optimizer" else NvmeParamsTier(context, role)


@hookimpl
def zkernel_register_offload_tiers(registry) -> None:
    registry.add(
        "nvme",
        nvme_tier,
        description="optimizer: fp32 masters and state in swap files under offload.nvme_path, streamed through the "
        "CPU step with read-ahead and write-behind; params: shards in swap files, read ahead per stage",
        options_cls={"optimizer": NvmeTierOptions, "params": NvmeParamsOptions},
        check=check_nvme_config,
    )


@hookimpl
def zkernel_size_offload_tier(name, role, options, device):
    from ._footprint import nvme_footprint

    return nvme_footprint(role, options) if name == "nvme" else None
