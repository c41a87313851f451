"""DeepSpeed: its JSON config (`config`) and its lr schedulers (`scheduler`) read into zkernel's."""
