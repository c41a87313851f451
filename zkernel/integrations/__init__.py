"""zkernel behind the training frameworks users already run.

- ``zkernel.integrations.transformers``: ``ZKernelTrainer``, a drop-in for the Hugging Face
  ``transformers.Trainer``.
- ``zkernel.integrations.lightning``: ``ZKernelStrategy``, a Lightning strategy, registered by name.

Each module imports its framework when it is imported itself, never from ``import zkernel``;
install them with ``pip install "zkernel[transformers]"`` or ``"zkernel[lightning]"``.
"""
