"""The ``zkernel demo``: a small GPT trained with zkernel on an embedded corpus.

* `zkernel.demo.gpt` -- a plain-torch GPT that can be built on the meta device.
* `zkernel.demo.corpus` -- the embedded English text and its char-level tokenizer.
* `zkernel.demo.train` -- the training each rank runs; ``python -m zkernel.demo`` (`zkernel.demo.__main__`) is the program;
  ``zkernel demo`` launches it through ``torch.distributed.run``.
"""
