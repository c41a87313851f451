"""The JSON files of a checkpoint that carry their own checksum: ``manifest.json`` and ``latest.checksum``.

[Note: sealed JSON] A checkpoint's rank files are checksummed block by block
in the manifest; the manifest itself, and ``latest``, need a checksum too, or
a flipped bit in a step counter, the learning rate, an optimizer scalar or an
RNG state loads silently as different state. The manifest is the commit point
(written last, by one atomic rename), so its checksum must be inside it, not
in a second file that a kill could leave out of step with it. `seal` writes
the JSON with a first member holding the checksum of the rest::

    {
     "checksum": "crc32c:1a2b3c4d",
     "format": "zkernel-checkpoint",
     ...

and the checksum covers the document without that line (``{`` newline, then
everything after it), byte for byte. `unseal` matches the first line exactly
(an upper-case hex digit or an unknown algorithm is damage, not a variant) and
checks the rest, so every byte of the file is covered: a byte flipped in the
checksum line breaks the match or changes the expected value, one flipped
anywhere else changes the checksum (a CRC catches every change of up to 32
bits in a row). It stays plain JSON for any other reader.

``latest`` stays the plain tag DeepSpeed's tools and users' scripts read. Its
checksum is ``latest.checksum`` beside it: a sealed list of the tags
``latest`` may hold. A save writes it listing the old and the new tag, then
replaces ``latest``, then writes it with the new tag alone, so a kill at any
moment leaves a ``latest`` that it lists, and a load refuses a ``latest`` it
does not list (a flipped byte turning ``step5`` into ``step7``, which may exist
too). Manifests of format version 1 and directories without
``latest.checksum`` (written before this) still load, unverified, with a
warning event saying so.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from zkernel.checkpoint.checksum import checksum_function, default_algorithm
from zkernel.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    LATEST,
    LATEST_CHECKSUM,
    MANIFEST,
    TAG_PATTERN,
    UNSEALED_VERSIONS,
    CheckpointError,
    NoCheckpoint,
    write_atomic,
)
from zkernel.telemetry.log import get_logger

log = get_logger()

_SEAL = re.compile(rb'\{\n "checksum": "([a-z0-9]{1,16}):([0-9a-f]{8})",\n')
LATEST_FORMAT = "zkernel-latest"


def seal(document: dict[str, Any]) -> bytes:
    """``document`` as indented JSON whose first member is the checksum of the rest ([Note: sealed JSON])."""
    if not document or "checksum" in document:
        raise ValueError("a sealed document is a non-empty dict without a 'checksum' key")
    body = json.dumps(document, indent=1, default=str).encode()  # starts with b"{\n"
    algorithm = default_algorithm()
    value = checksum_function(algorithm)(memoryview(body))
    return b'{\n "checksum": "%s:%08x",\n' % (algorithm.encode(), value) + body[2:]


def unseal(raw: bytes, path: Path, what: str, fix: str) -> dict[str, Any] | None:
    """The document in ``raw`` (the bytes of ``path``, a ``what``) after checking its checksum; None when
    it has no checksum line (an unsealed file: the caller decides whether that is allowed). ``fix``: what
    to do about a damaged one, for the error."""
    found = _SEAL.match(raw)
    if found is None:
        return None
    algorithm, expected = found.group(1).decode(), int(found.group(2), 16)
    try:
        checksum = checksum_function(algorithm)
    except CheckpointError as exc:
        raise CheckpointError(f"{what} {path} cannot be verified: {exc}; {fix}") from None
    if checksum(memoryview(b"{\n" + raw[found.end() :])) != expected:
        raise CheckpointError(
            f"{what} {path} is truncated or damaged: checksum mismatch (its content does not match the "
            f"{algorithm} checksum on its first line); {fix}"
        )
    try:
        document = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:  # a checksum over bytes that were never JSON
        raise CheckpointError(f"{what} {path} is damaged (not valid JSON: {exc}); {fix}") from None
    if not isinstance(document, dict):
        raise CheckpointError(f"{what} {path} is damaged (not a JSON object); {fix}")
    return document


# -- the manifest ----------------------------------------------------------------------------------


def read_manifest(tag_dir: Path) -> dict[str, Any]:
    """Read and check ``tag_dir/manifest.json`` (its checksum too); every problem is a `CheckpointError`
    naming it."""
    path = tag_dir / MANIFEST
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(
            f"{tag_dir} has no {MANIFEST}: the save that wrote it did not complete, or it is not a "
            "zkernel checkpoint"
        ) from None
    manifest = unseal(raw, path, "checkpoint manifest", _USE_ANOTHER)
    sealed = manifest is not None
    if not sealed:
        try:
            manifest = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(
                f"checkpoint manifest {path} is truncated or damaged (not valid JSON: {exc})"
            ) from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{path} is not a zkernel checkpoint manifest (no \"format\": {FORMAT!r})")
    version = manifest.get("version")
    if version != FORMAT_VERSION and version not in UNSEALED_VERSIONS:
        newer = isinstance(version, int) and version > FORMAT_VERSION
        raise CheckpointError(
            f"checkpoint manifest {path} has format version {version!r}; this zkernel reads versions "
            f"{', '.join(map(str, (*UNSEALED_VERSIONS, FORMAT_VERSION)))}"
            + (" (the checkpoint was written by a newer zkernel: upgrade)" if newer else "")
        )
    if not sealed:
        if version not in UNSEALED_VERSIONS or "checksum" in manifest:
            raise CheckpointError(
                f"checkpoint manifest {path} is damaged: its first line, the manifest's own checksum, is "
                f"missing or garbled; {_USE_ANOTHER}"
            )
        log.warning(
            "zkernel.checkpoint.manifest_unverified",
            path=str(path),
            version=version,
            reason="written before manifests carried their own checksum: its counters, scalars and RNG states "
            "cannot be verified; save again to protect them",
        )
    for key, kind in _MANIFEST_KEYS.items():
        if not isinstance(manifest.get(key), kind):
            raise CheckpointError(f"checkpoint manifest {path} is damaged: {key!r} missing or not a {kind.__name__}")
    return manifest


_USE_ANOTHER = "load another checkpoint (pass its tag), or save again"
_MANIFEST_KEYS = {
    "world_size": int,
    "files": dict,
    "params": dict,
    "buffers": dict,
    "state_dict": list,
    "optimizer_state": dict,
    "engine": dict,
    "ranks": list,
}


# -- latest ----------------------------------------------------------------------------------------


def read_latest(root: Path, committed: list[str]) -> str:
    """The tag ``root/latest`` names, checked against ``latest.checksum`` ([Note: sealed JSON]);
    ``committed``: the committed tags, for the error messages."""
    path = root / LATEST
    fix = f"pass the tag to load (committed checkpoints in {root}: {committed or 'none'})"
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise NoCheckpoint(
            f"{root} has no {LATEST!r} file, so there is no checkpoint to load by default; "
            f"committed checkpoints there: {committed or 'none'}"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}; {fix}") from None
    try:
        tag = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CheckpointError(
            f"{path} is damaged: it should hold the tag of the newest checkpoint as text, but its "
            f"{len(raw)} bytes are not text ({raw[:16]!r}...); {fix}, or write that tag into it"
        ) from None
    if not TAG_PATTERN.fullmatch(tag) or tag in (LATEST, LATEST_CHECKSUM):
        raise CheckpointError(
            f"{path} is damaged: it should hold the tag of the newest checkpoint, but holds {tag[:80]!r}, "
            f"which is not a checkpoint tag; {fix}, or write that tag into it"
        )
    recorded = _recorded_latest(root)
    if recorded is None:
        log.warning(
            "zkernel.checkpoint.latest_unverified",
            path=str(path),
            tag=tag,
            reason=f"no {LATEST_CHECKSUM} beside it (written by an older zkernel, or by hand): its tag "
            "cannot be verified; the next save writes one",
        )
    elif not any(raw in (t.encode(), t.encode() + b"\n") for t in recorded):
        raise CheckpointError(
            f"{path} is damaged or was edited: it names {tag!r}, but {root / LATEST_CHECKSUM}, written with it, "
            f"records {recorded}; {fix}. If you pointed {LATEST} at {tag!r} on purpose, delete "
            f"{root / LATEST_CHECKSUM}"
        )
    return tag


def _recorded_latest(root: Path) -> list[str] | None:
    """The tags ``latest.checksum`` allows ``latest`` to hold; None where there is no such file."""
    path = root / LATEST_CHECKSUM
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None
    fix = f"pass the tag to load, or, if {root / LATEST} is right, delete {path}"
    document = unseal(raw, path, f"the checksum of {LATEST}", fix)
    tags = None if document is None else document.get("latest")
    if (
        document is None
        or document.get("format") != LATEST_FORMAT
        or not isinstance(tags, list)
        or not all(isinstance(t, str) for t in tags)
    ):
        raise CheckpointError(f"{path} is damaged (not the sealed record of the tags {LATEST} may hold); {fix}")
    return tags


def write_latest(root: Path, tag: str) -> None:
    """Point ``root/latest`` at ``tag``, with ``latest.checksum`` in step at every moment ([Note: sealed JSON])."""
    path = root / LATEST
    try:
        previous = path.read_bytes().decode("utf-8").strip()
    except (OSError, UnicodeDecodeError):
        previous = None
    both = [tag] + ([previous] if previous and previous != tag and TAG_PATTERN.fullmatch(previous) else [])
    write_atomic(root / LATEST_CHECKSUM, seal({"format": LATEST_FORMAT, "latest": both}))
    write_atomic(path, f"{tag}\n".encode())
    if len(both) > 1:
        try:
            write_atomic(root / LATEST_CHECKSUM, seal({"format": LATEST_FORMAT, "latest": [tag]}))
        except OSError as exc:  # committed: the record listing both tags still verifies latest
            log.warning("zkernel.checkpoint.latest_checksum_kept", path=str(root / LATEST_CHECKSUM), error=str(exc))


def latest_names(root: Path, tag: str) -> bool:
    """Whether ``root/latest`` holds ``tag`` (read as bytes: a damaged file is simply not ``tag``)."""
    try:
        return (root / LATEST).read_bytes().strip() == tag.encode()
    except OSError:
        return False
