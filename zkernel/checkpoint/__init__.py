"""Checkpoints and state dicts: sharded, crash-safe, loadable on any world size, partitioner or tier.

A checkpoint is keyed by parameter name and element offset, never by
zkernel's groups (which differ by partitioner, unit policy, bucket size and
world size): each partitioner says which elements of which parameters its
shard of a group holds (`zkernel_describe_shard`), each tier hands over or
takes back what it stores (`OptimizerTier.read_state`/`write_state`,
`ParamsTier.read_shard`/`write_shard`). On disk::

    DIR/latest                        text: the tag of the newest committed checkpoint
    DIR/latest.checksum               JSON: the tags ``latest`` may hold, sealed with its checksum
    DIR/<tag>/manifest.json           JSON, written last (the commit point): its own checksum on its
                                      first line (`sealed`: a flipped byte anywhere is an error), format version,
                                      world size, config, every parameter's shape, dtype and
                                      fragments (rank, start, numel), optimizer scalars per
                                      parameter, buffers, the state-dict keys, step counters,
                                      loss scale, lr, every rank's RNG states, and each file's
                                      size, checksum algorithm (CRC-32C where the native
                                      extension has it, else CRC-32), header checksum and
                                      per-MiB block checksums
    DIR/<tag>/rank00000.safetensors   one per rank: tensors "<kind>/<name>/<start>", kind one of
                                      master, state.<optimizer state>, param (frozen values),
                                      buffer (rank 0); each a 1-D run of elements; and
                                      extra/<key>/0 (rank 0): a module's extra state, the
                                      bytes torch.save wrote (`extra_state`); client/state/0
                                      (rank 0): save_checkpoint's client_state, the same way
                                      (`client_state`)

Tensors come from safetensors, the rest from JSON; a module's extra state is
unpickled with ``weights_only=True`` (tensors, containers, primitive values), as is the
client state.
Modules: `format` (names, file records, atomic files), `sealed` (the manifest and ``latest``, each
checked against its own checksum), `checksum`, `blockio` and
`safetensors_io` (streaming writes, verified ranged reads), `save`, `load`,
`reader` (the index over fragments), `state_dict`, `consolidate`, `extra_state`, `client_state`.
"""

from zkernel.checkpoint.consolidate import consolidate, consolidate_to_file
from zkernel.checkpoint.format import CheckpointError
from zkernel.checkpoint.load import LoadedCheckpoint

__all__ = ["CheckpointError", "LoadedCheckpoint", "consolidate", "consolidate_to_file"]
