"""The ``zkernel demo``: a small GPT trained with zkernel on an embedded corpus.

* `zkernel.cli.demo.gpt` -- a plain-torch GPT that can be built on the meta device.
* `zkernel.cli.demo.corpus` -- the embedded English text and its char-level tokenizer.
* `zkernel.cli.demo.train` -- the training each rank runs; ``python -m zkernel.cli.demo`` (`zkernel.cli.demo.__main__`) is the program;
  ``zkernel demo`` launches it through ``torch.distributed.run``.
"""
