"""Values nothing has written yet, and the calls that refuse to use them.

[Note: values left unset] A model built on the meta device gets its values
from the initialiser zero3 runs on each unit (`initialize`'s ``init_fn``).
Where the initialiser leaves a value unset (one the model sets only in its
constructor, as CLIP's ``logit_scale``, which Hugging Face's ``_init_weights``
never writes, or SD3's sinusoidal ``pos_embed`` buffer; or one whose module
has no ``reset_parameters()`` and no ``init_fn`` was given, as in a diffusers
model built with accelerate's ``init_empty_weights()``), the usual next step
writes it anyway: pretrained weights through `Engine.load_state_dict`, or a
checkpoint through `Engine.load_checkpoint`. So `initialize` does not refuse
such a model: the partitioner reports the names (`RuntimeContext.left_unset`),
`initialize` logs a warning naming them, each load takes off the names it
wrote, and until none is left every call that would use or hand out the values
(a forward, however it is called; `state_dict`, `save_checkpoint`,
`gathered_parameters`) raises an error naming them, on every rank alike (the
names are the same on every rank: each builds the same units from the same
seeds). A value is never used unset, and the check costs one truth test per
forward. The price: a run from scratch that forgot its ``init_fn`` hears of it
at `initialize` as a warning, and as an error only at its first forward.
Parameters and persistent buffers are deferred; a non-persistent buffer
(rotary ``inv_freq``) is in no state dict a load could write it from, so one
left unset stays an error at `initialize`.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn

from zkernel.telemetry.log import get_logger

log = get_logger()


class UnsetValues:
    """The names of values (parameters, persistent buffers) the partitioner left unset and no load has
    written since, in the model's order."""

    def __init__(self, module: nn.Module, left_unset: Iterable[str]) -> None:
        left = set(left_unset)
        named = [n for n, _ in (*module.named_parameters(), *module.named_buffers()) if n in left]
        self.names: list[str] = named + sorted(left - set(named))
        if self.names:
            log.warning(
                "zkernel.initialize.values_unset",
                values=self.names[:8],
                count=len(self.names),
                advice="the initialiser left these values unset; load them (engine.load_state_dict or "
                "load_checkpoint) before the first forward, or pass an init_fn that writes them (a Hugging Face "
                "model: init_fn=model._init_weights), or give their modules a reset_parameters()",
            )

    def written(self, names: Iterable[str]) -> None:
        """Called by a load after it wrote the parameters and buffers ``names`` (canonical names)."""
        if self.names:
            done = set(names)
            self.names = [name for name in self.names if name not in done]

    def require(self, action: str) -> None:
        """Raise a `ValueError` naming the unset values, if any, before ``action`` uses them."""
        if self.names:
            more = f" and {len(self.names) - 8} more" if len(self.names) > 8 else ""
            raise ValueError(
                f"{action} needs every value of the model, but the meta-device initialiser left "
                f"{', '.join(f'`{n}`' for n in self.names[:8])}{more} unset and no load has written them since. "
                "Load them first (engine.load_state_dict with the pretrained weights, or engine.load_checkpoint), "
                "or give their modules a reset_parameters(), or pass zkernel.initialize(..., init_fn=fn) where "
                "fn writes them (a Hugging Face model: init_fn=model._init_weights; for a value that leaves "
                "unset, as CLIP's logit_scale, a function that calls it and also fills that value)"
            )
