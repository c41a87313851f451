"""Whether a boundary's step is taken, agreed by every rank before any of it is kept.

[Note: a step is all-or-nothing] A step updates many groups, on several ranks,
some of them during backward (host steps whose coefficient is known early,
[Note: early and speculative steps] in `zkernel.kernel.step_pipeline`). Two
things can make a step wrong only after some groups took it: a gradient that
is not finite ([Note: non-finite gradients] in `zkernel.kernel.step_scaling`), and a
write of the optimizer's state back to where it lives that failed (a full
disk, an I/O error: `OptimizerTier.take_write_failures`, and a parameter
shard's: `ParamsTier.take_write_failures`; the tier keeps the newest values in
host memory). Both are decided once per step, at the end of a
boundary backward, in the one all-reduce the global norm already makes: its
scalar becomes ``[squared norm, failed]``, so every rank learns that a write
failed on some rank with no collective of its own (where no gradient is
sharded, the pair is all-reduced only where a tier can fail writes).

* a non-finite norm: the step is skipped on every rank (counted in
  ``skipped_steps``, logged), as an fp16 overflow is;
* a failed write: the step is *not taken* on any rank. Groups that stepped
  during backward are rolled back (``zkernel_rollback_optimizer``), the
  window's gradients are dropped, the counters go back to the window's start,
  and every rank raises the same `OSError` from `Engine.step` (the failing
  rank its own, naming the file; the others one naming that rank and file).
  Every rank is then at the previous step; once there is room the script runs
  the window's micro-batches again (forward, backward, step) and training
  continues exactly. A failure found after a step's outcome was agreed (its
  own late writes, as a parameter shard's writes always are: they start
  when the group's update is in) leaves that step taken (its values in
  memory, read from there until a write succeeds) and fails the next one. `step()` again without the window's backward is refused with
  an error saying so, on every rank alike, so no rank waits in a collective
  the others never issue.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

from zkernel.telemetry.log import get_logger

log = get_logger()

__all__ = ["StepOutcome"]


class StepOutcome:
    """The write failures this rank saw, and whether any rank saw one (``failed``)."""

    def __init__(self, distributed: bool) -> None:
        self.distributed = distributed
        self.local: list[BaseException] = []
        self.failed = False

    def collect(self, tiers) -> None:
        """Take the write failures of ``tiers`` (the optimizer and params tiers) since the last step
        (``failed``: this rank's alone)."""
        for tier in tiers:
            if tier.may_fail_writes:
                self.local += tier.take_write_failures()
        self.failed = bool(self.local)

    def agree(self, sq_norm: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor]) -> float:
        """All-reduce ``sq_norm`` with the failure flag in one collective; return the summed norm."""
        pair = torch.stack([sq_norm.reshape(()).float(), torch.full((), float(self.failed), device=sq_norm.device)])
        total, failed = all_reduce(pair).tolist()
        self.failed = failed > 0
        return total

    def raise_failure(self, tiers, step: int, also: list[BaseException] = ()) -> None:
        """Raise the agreed failure of step ``step`` on this rank (collective: every rank calls it);
        ``tiers``: as for `collect`; ``also``: what failed while the step was being undone, attached as notes."""
        local = self.local + [e for tier in tiers if tier.may_fail_writes for e in tier.take_write_failures(wait=True)]
        self.local, self.failed = [], False
        described = None
        if local:
            first = local[0]
            described = (getattr(first, "errno", None), getattr(first, "strerror", None) or str(first), getattr(first, "filename", None))
        rank, ranks = 0, [described]
        if self.distributed:
            rank = dist.get_rank()
            ranks = [None] * dist.get_world_size()
            dist.all_gather_object(ranks, described)
        failing = [r for r, d in enumerate(ranks) if d is not None]
        if local:
            error = local[0]
            for other in local[1:]:
                error.add_note(f"also failed: {other}")
        elif also:
            error = also[0]
        else:
            errno, text, filename = ranks[failing[0]] if failing else (None, "a write failed", None)
            error = OSError(errno, f"{text} (a swap-file write on rank {failing[0] if failing else '?'})", filename)
        log.error("zkernel.step.not_taken", step=step, failing_ranks=failing, error=str(error))
        for other in also:
            if other is not error:
                error.add_note(f"also failed while the step was undone: {other!r}")
        error.add_note(
            f"step {step} was not taken on any rank (failed writes on rank(s) {failing}; this is rank {rank}): "
            "every group is at the previous step, its newest state kept in host memory where its write "
            "failed; free space (or fix the disk), then run this accumulation window's micro-batches "
            "again (forward, backward, step) on every rank"
        )
        raise error
