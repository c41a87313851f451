"""Compatibility with other trainers' inputs: DeepSpeed configs and lr schedulers (`deepspeed`), and torch
Adam/AdamW optimizers (`torch_optim`)."""
