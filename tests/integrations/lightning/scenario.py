"""Lightning runs for tests/integrations/lightning: ``python -m tests.integrations.lightning.scenario OUT MODE...``.

Both ranks are forked from this process once it has imported Lightning (on a 2-core box importing it
takes most of a run's time), with the variables torchrun sets, so Lightning finds its processes
launched (as under ``torchrun``) and joins them; ``--launch`` instead starts one process and lets
Lightning's own launcher start the second rank, as a plain ``python script.py`` does.

A tiny GPT LightningModule (AdamW with two parameter groups of their own lr and weight decay,
a per-step LambdaLR warm-up) trained by the real ``Trainer(accelerator="cpu", devices=2)``, which
launches the second rank itself by running this module again. Each rank writes what it saw to
``OUT.<rank>.json``, per MODE: every micro-batch's training loss and every validation loss, in order.

MODE:
  ddp      ``strategy="ddp"``, two epochs: the reference.
  zero3    ``ZKernelStrategy`` (zero3, optimizer and parameters on the CPU) for one epoch,
           ``trainer.save_checkpoint``, then a new Trainer, strategy and module resume with
           ``fit(ckpt_path=...)`` for the second epoch.
  named    ``strategy="zkernel"``, two epochs, then ``validate`` with the same Trainer.
           A fresh Trainer then runs ``test(ckpt_path=...)`` from the epoch-1 checkpoint.
  meta     ``strategy="zkernel"`` with the layers built in ``configure_model`` (on the meta device,
           materialised by the engine), two epochs.
  short    7 micro-batches per rank, so Lightning steps a window of one at the epoch's end: "ddp"
           and then "zkernel_stage_2" for two epochs each (losses under "ddp" and "zero2").
  bf16     ``strategy="zkernel_stage_3_offload"``, ``precision="bf16-mixed"``, two epochs.
  convert  ``ZKernelStrategy`` (zero3, optimizer and parameters on the CPU) for one epoch with
           ``tag="converted"``, ``trainer.save_checkpoint``; rank 0 writes ``engine.state_dict()`` to
           ``OUT.engine.pt`` and converts the directory to ``OUT.converted.ckpt``
           (`zkernel.integrations.lightning.convert_checkpoint`); the engine also saves ``OUT.bare``
           (no Lightning state). Then ``strategy="ddp"`` and ZKernelStrategy each resume the second
           epoch from the converted file (losses under "ddp_resumed" and "zkernel_resumed").
  file     ``strategy="ddp"`` for one epoch and ``trainer.save_checkpoint`` (one file); rank 0 writes a
           copy without the optimizer's moments. ZKernelStrategy resumes the second epoch from the file,
           DDP from the copy ("ddp_fresh"); a fresh Trainer tests the file under ZKernelStrategy; then
           ``fit(ckpt_path=...)`` of a missing path and of a file that is no checkpoint: the errors.
  sgd      ``strategy="zkernel"`` with SGD(momentum=0.9): the error is written (last: it ends the run).
"""

from __future__ import annotations

import importlib
import json
import os
import socket
import sys
import time
import traceback
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import zkernel.integrations.lightning as zl

# ZKERNEL_SCENARIO_LIGHTNING=lightning.pytorch runs it on the unified package instead of pytorch_lightning.
pl = importlib.import_module(os.environ.get("ZKERNEL_SCENARIO_LIGHTNING", "pytorch_lightning"))
ZKernelStrategy = zl.strategy_class(pl.__name__)

VOCAB, DIM, CONTEXT, LAYERS = 32, 16, 8, 2
ACCUMULATE, CLIP = 2, 1.0


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        x = x + self.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class TinyGPT(pl.LightningModule):
    def __init__(self, optimizer: str = "adamw", late: bool = False, tag: str = "plain") -> None:
        super().__init__()
        self.save_hyperparameters()
        self.optimizer_name, self.late = optimizer, late
        self.losses: list[float] = []
        self.val_losses: list[float] = []
        self.test_losses: list[float] = []
        self.built_on_meta: bool | None = None
        if not late:
            self._build()

    def _build(self) -> None:
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(CONTEXT, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln_f, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def configure_model(self) -> None:
        if self.late and not hasattr(self, "head"):
            self._build()
            self.built_on_meta = self.head.weight.is_meta

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def _loss(self, batch) -> torch.Tensor:
        tokens = batch[0]
        logits = self(tokens[:, :-1])
        return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.losses.append(float(loss.detach()))
        return loss

    def validation_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.val_losses.append(float(loss))
        return loss

    def test_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.test_losses.append(float(loss))
        return loss

    def configure_optimizers(self):
        decay = [p for n, p in self.named_parameters() if p.dim() >= 2 and "wte" not in n and "wpe" not in n]
        rest = [p for n, p in self.named_parameters() if not (p.dim() >= 2 and "wte" not in n and "wpe" not in n)]
        if self.optimizer_name == "sgd":
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
        optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 1e-2}],
            lr=2e-2, betas=(0.9, 0.95), eps=1e-8,
        )
        warmup = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": warmup, "interval": "step"}}


def data(n: int) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randint(0, VOCAB, (n, CONTEXT + 1), generator=generator)), batch_size=2)


# ZKERNEL_SCENARIO_ACCELERATOR=gpu runs it on GPUs (tests/integrations/lightning, the cuda test).
ACCELERATOR = os.environ.get("ZKERNEL_SCENARIO_ACCELERATOR", "cpu")


def trainer(strategy, epochs: int, precision: str = "32-true") -> pl.Trainer:
    return pl.Trainer(
        accelerator=ACCELERATOR, devices=2, strategy=strategy, max_epochs=epochs, precision=precision,
        accumulate_grad_batches=ACCUMULATE, gradient_clip_val=CLIP, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
    )


def zero3_offload():
    return ZKernelStrategy(config={"partitioner": "zero3", "offload": {"optimizer": "cpu", "params": "cpu"}})


def run_mode(mode: str, out: str) -> dict:
    """Train as ``mode`` says (see the module docstring); what this rank saw."""
    train, val = data(32), data(8)  # 8 micro-batches per rank and epoch: 4 optimizer steps
    if mode == "sgd":
        module, run = TinyGPT("sgd"), trainer("zkernel", 1)
        try:
            run.fit(module, train)
        except Exception as error:  # noqa: BLE001 - the error is the result
            return {"error": f"{type(error).__name__}: {error}", "losses": module.losses}
        return {"error": None, "losses": module.losses}
    module, extra = TinyGPT(), {}
    if mode in ("ddp", "named"):
        run = trainer(mode if mode == "ddp" else "zkernel", 2)
        run.fit(module, train, val)
        losses, val_losses = module.losses, list(module.val_losses)
        run.validate(module, val, verbose=False)  # the same Trainer again, after fit: the engine kept
        extra["validated"] = module.val_losses[len(val_losses):]
    elif mode == "bf16":
        run = trainer("zkernel_stage_3_offload", 2, precision="bf16-mixed")
        run.fit(module, train, val)
        losses, val_losses = module.losses, module.val_losses
    elif mode == "zero3":
        run = trainer(zero3_offload(), 1)
        run.fit(module, train, val)
        checkpoint = f"{out}.ckpt"
        run.save_checkpoint(checkpoint)
        resumed, run = TinyGPT(), trainer(zero3_offload(), 2)
        run.fit(resumed, train, val, ckpt_path=checkpoint)
        losses, val_losses = module.losses + resumed.losses, module.val_losses + resumed.val_losses
        tested = TinyGPT()
        trainer(zero3_offload(), 1).test(tested, val, ckpt_path=checkpoint, verbose=False)
        extra["test_losses"] = tested.test_losses
    elif mode == "convert":
        module = TinyGPT(tag="converted")
        run_convert(module, train, val, out, extra)
        losses, val_losses, run = module.losses, module.val_losses, extra.pop("run")
    elif mode == "file":
        run_file(module, train, val, out, extra)
        losses, val_losses, run = module.losses, module.val_losses, extra.pop("run")
    elif mode == "short":
        short = data(28)
        reference, run = TinyGPT(), trainer("ddp", 2)
        run.fit(reference, short)
        run = trainer("zkernel_stage_2", 2)
        run.fit(module, short)
        losses, val_losses = module.losses, []
        extra["ddp"] = reference.losses
        extra["ddp_lr"] = [g["lr"] for g in reference.trainer.optimizers[0].param_groups]
    elif mode == "meta":
        module = TinyGPT(late=True)
        run = trainer("zkernel", 2)
        run.fit(module, train, val)
        losses, val_losses = module.losses, module.val_losses
        extra["built_on_meta"] = module.built_on_meta
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    config = getattr(run.strategy, "config", None)
    return {
        "losses": losses,
        "val_losses": val_losses,
        "global_step": run.global_step,
        "epoch": run.current_epoch,
        "strategy": type(run.strategy).__name__,
        "strategy_package": type(run.strategy).__mro__[2].__module__.split(".strategies")[0],
        "partitioner": getattr(config, "partitioner", None),
        "precision": getattr(config, "precision", None),
        "lr": [g["lr"] for g in run.optimizers[0].param_groups],
        **extra,
    }


def run_convert(module: TinyGPT, train: DataLoader, val: DataLoader, out: str, extra: dict) -> None:
    """The "convert" mode (module docstring): ``module`` trains epoch 1 under zero3; ``extra`` gets the rest
    (and the Trainer, as "run")."""
    from zkernel.integrations.lightning import convert_checkpoint

    run = trainer(zero3_offload(), 1)
    run.fit(module, train, val)
    directory, converted = f"{out}.ckpt", f"{out}.converted.ckpt"
    run.save_checkpoint(directory)
    engine = run.strategy.engine
    weights = engine.state_dict()
    engine.save_checkpoint(f"{out}.bare")  # a zkernel checkpoint without Lightning's state
    if run.strategy.is_global_zero:
        torch.save(weights, f"{out}.engine.pt")
        convert_checkpoint(directory, converted)
    run.strategy.barrier()
    extra["losses_epoch1"] = module.losses
    for name, strategy in (("ddp_resumed", "ddp"), ("zkernel_resumed", zero3_offload())):
        resumed, again = TinyGPT(), trainer(strategy, 2)
        again.fit(resumed, train, val, ckpt_path=converted)
        extra[name] = {"losses": resumed.losses, "val_losses": resumed.val_losses, "global_step": again.global_step,
                       "lr": [g["lr"] for g in again.optimizers[0].param_groups]}
    extra["run"] = run


def run_file(module: TinyGPT, train: DataLoader, val: DataLoader, out: str, extra: dict) -> None:
    """The "file" mode (module docstring): ``module`` trains epoch 1 under DDP; ``extra`` gets the rest
    (and the Trainer, as "run")."""
    run = trainer("ddp", 1)
    run.fit(module, train, val)
    saved, fresh = f"{out}.ddp.ckpt", f"{out}.fresh.ckpt"
    run.save_checkpoint(saved)
    if run.strategy.is_global_zero:
        checkpoint = torch.load(saved, weights_only=True)
        for state in checkpoint["optimizer_states"]:
            state["state"] = {}  # DDP resumed with fresh moments: the reference
        torch.save(checkpoint, fresh)
        Path(f"{out}.garbage.ckpt").write_bytes(b"not a checkpoint")
    run.strategy.barrier()
    for name, strategy, path in (("ddp_fresh", "ddp", fresh), ("zkernel_resumed", zero3_offload(), saved)):
        resumed, again = TinyGPT(), trainer(strategy, 2)
        again.fit(resumed, train, val, ckpt_path=path)
        extra[name] = {"losses": resumed.losses, "val_losses": resumed.val_losses, "global_step": again.global_step,
                       "lr": [g["lr"] for g in again.optimizers[0].param_groups]}
    tested = TinyGPT()
    trainer(zero3_offload(), 1).test(tested, val, ckpt_path=saved, verbose=False)
    extra["test_losses"] = tested.test_losses
    for name, path in (("missing", f"{out}.missing.ckpt"), ("garbage", f"{out}.garbage.ckpt")):
        try:
            trainer(zero3_offload(), 2).fit(TinyGPT(), train, ckpt_path=path)
            extra[name] = None
        except Exception as error:  # noqa: BLE001 - the error is the result
            extra[name] = f"{type(error).__name__}: {error}"
    extra["run"] = run


def main(out: str, modes: list[str]) -> None:
    """Every mode in turn in the same two processes (Lightning launches the second rank at the first fit,
    which runs this script again; later Trainers find the ranks and the process group there)."""
    results = {}
    for mode in modes:
        start = time.perf_counter()
        results[mode] = run_mode(mode, out)
        results[mode]["seconds"] = time.perf_counter() - start
    rank = int(torch.distributed.get_rank()) if torch.distributed.is_initialized() else 0
    Path(f"{out}.{rank}.json").write_text(json.dumps(results))


def fork_ranks(out: str, modes: list[str], world: int = 2) -> int:
    """Run `main` on ``world`` ranks forked from this process; 0 when every rank succeeded."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    children = []
    for rank in range(world):
        pid = os.fork()
        if pid == 0:
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), GROUP_RANK="0",
                              LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
            code = 1
            try:
                main(out, modes)
                code = 0
            except BaseException:  # noqa: BLE001 - reported, then the rank exits
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        children.append(pid)
    return max(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) != 0 for pid in children)


if __name__ == "__main__":
    if sys.argv[1] == "--launch":
        main(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(fork_ranks(sys.argv[1], sys.argv[2:]))
