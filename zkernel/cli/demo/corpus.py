"""The demo's default corpus, embedded so the demo needs no download, and its char tokenizer.

The text is original prose written for zkernel: a plain account of what ZeRO
does with the memory of data-parallel training. It is small (a few KB), which
is enough for a character-level model to show its loss falling within a minute.
"""

from __future__ import annotations

import torch

TEXT = """\
When a model is trained with plain data parallelism, every worker keeps a full copy of everything.
Each one holds the parameters, the gradients, and the state of the optimizer, and each one runs the
same update on the same numbers. The work is shared, but the memory is not. Adding workers makes
training faster, yet it never lets a larger model fit, because the largest copy is the one that
decides what fits.

The memory of training falls into a few plain piles. There are the parameters, which the forward
pass reads. There are the gradients, which the backward pass writes. There are the master weights,
kept in full precision when the model computes in half precision, and there are the two running
averages that Adam keeps for every weight. For a model trained in mixed precision, the optimizer
piles are by far the largest: twelve bytes for each weight, against two for the parameter itself
and two for its gradient.

The first stage of ZeRO removes the waste in the optimizer piles. The weights are cut into as many
slices as there are workers, and each worker keeps the master weights and the Adam averages only for
its own slice. After the backward pass the gradients are still averaged across all workers, but each
worker then updates only the slice it owns. When the step is done, the workers share their updated
slices, so that every worker again holds the whole model for the next forward pass. The arithmetic
is the same as before; only the place where it happens has moved.

The second stage does the same for the gradients. A worker does not need the whole averaged gradient,
only the part that belongs to its own slice. So instead of an all-reduce, which leaves the full sum on
every worker, the gradients are reduced and scattered at once: each worker receives the sum for its
slice and nothing else. This costs the same amount of traffic on the network, and it can start while
the backward pass is still running, one bucket of gradients at a time, so that the network and the
processor work side by side.

The third stage goes furthest and cuts the parameters themselves. Between uses, a worker keeps only
its slice of each layer. Just before a layer runs, the workers gather the slices into a whole layer,
the layer computes, and the gathered copy is thrown away at once. The backward pass gathers each
layer again in reverse order. Memory for the model now falls with the number of workers, and the
only full copy that ever exists is the copy of the one layer that is running. The price is more
traffic, which is hidden by fetching the next layer while the current one computes.

A model that is too large to build on one worker can be built in pieces as well. Its structure is
first created on a device that holds no data at all, so that the shapes are known but no memory is
used. Then each layer in turn is given real memory, filled with its initial values, cut into slices,
and freed, so that no worker ever holds more than one whole layer beyond its own slices.

When even the sum of all the processor memory is not enough, the slices can move further away. The
optimizer state can live in the main memory of the host, where an optimized routine updates it on
the central processor, and the parameters can wait on fast disks until they are needed. The layers
then travel from disk to host memory to the accelerator and back, and a good schedule keeps all three
transfers busy at the same time. In this way the size of a model is bounded by the memory of the
whole machine, not by the memory of one device.

None of this changes what the model learns. The same batches produce the same gradients, the same
averages and the same updates as plain data parallelism would; the numbers are only kept in fewer
places. That is the whole idea: keep each piece of training state exactly once, on the worker that
needs it, and bring it to the others only for the short moment when they need it too.
"""


class CharTokenizer:
    """Maps each distinct character of a text to an id and back."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self._ids = {c: i for i, c in enumerate(self.chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self._ids[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[int(i)] for i in ids)


def load_corpus(text: str = TEXT) -> tuple[CharTokenizer, torch.Tensor]:
    """The tokenizer of ``text`` and the whole text as a 1-D tensor of ids."""
    tokenizer = CharTokenizer(text)
    return tokenizer, tokenizer.encode(text)


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``seq_len`` tokens and their next-token targets."""
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len + 1)
    windows = data[starts[:, None] + offsets]
    return windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
