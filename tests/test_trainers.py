"""rematc from the trainers people use: transformers' Trainer, accelerate's
Accelerator, two optimizer steps on a tiny Llama at a binding budget, the losses equal to
the same trainer's without rematc and the records showing the budget applied. The
snippets of docs/trainers.md are this code."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

import rematc
from tests.helpers import tiny_llama

transformers = pytest.importorskip("transformers")

STEPS = 2
BUDGET = 600_000  # bytes: 73% of the tiny Llama's unconstrained step at batch 2 (818,436 B)
# Under compile_regions the block's graph plans for both calls in flight, and the graphs
# plan in the order they first run, each with what the earlier ones left: the step fits
# from 609,792 B, but at 700,000 B the block takes the room the loss's graph needs after
# it, and the error states 708,096 B (which holds). rematc.compile(regions=True) surveys
# the step first and has no such gap.
REGIONS_BUDGET = 650_000


def llama() -> Any:
    return tiny_llama(2)


class Tokens(torch.utils.data.Dataset):  # type: ignore[type-arg]
    """Rows of token ids, each its own labels (the model shifts them)."""

    def __init__(self, rows: int = 8, seq: int = 32) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 128, (rows, seq), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def trainer_losses(model: Any, tmp_path: Any) -> list[float]:
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=STEPS, per_device_train_batch_size=2, learning_rate=1e-3,
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens())
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def test_transformers_trainer_trains_the_compiled_model_within_its_budget(tmp_path: Any) -> None:
    """The compiled model keeps its forward's signature, so the Trainer keeps the batch's
    columns (it dropped them all: "The batch received was empty"). The Trainer keeps only
    the loss, so the logits are counted freed as the forward returns (outputs="dropped"),
    and the check at the backward (rematc.OutputsKeptError) lets every step run."""
    expected = trainer_losses(llama(), tmp_path / "eager")
    torch._dynamo.reset()
    rematc.clear_records()
    model = rematc.compile(llama(), budget=BUDGET, compiler="eager", cache_dir=None, outputs="dropped")
    losses = trainer_losses(model, tmp_path / "rematc")
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses)
    assert losses == pytest.approx(expected, rel=1e-4)
    records = rematc.records()
    assert records and all(r.step_budget == BUDGET for r in records)
    assert any(r.solver != "save_all" for r in records)  # the budget binds
    assert any(r.dropped for r in records)


def test_a_budget_from_the_environment_applies_without_code_changes(
        tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``torch.compile(model, backend="rematc")`` as a trainer calls it, the budget in
    ``REMATC_BUDGET``."""
    monkeypatch.setenv("REMATC_BUDGET", str(BUDGET))
    model = torch.compile(llama(), backend="rematc", options={"compiler": "eager", "cache_dir": None})
    ids = Tokens()[0]["input_ids"][None]
    model(input_ids=ids, labels=ids).loss.backward()
    records = rematc.records()
    assert records and all(r.step_budget == BUDGET for r in records)
    assert all(r.budget_origin == f"$REMATC_BUDGET={BUDGET}" for r in records)


def test_a_malformed_budget_in_the_environment_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("REMATC_BUDGET", "lots")
    with pytest.raises(ValueError, match=r"^\$REMATC_BUDGET: "):
        rematc.Options.from_mapping(None)


def hand_written_steps(model: Any, optimizer: torch.optim.Optimizer,
                       backward: Any) -> list[float]:
    """:data:`STEPS` optimizer steps of a training loop written by hand, the loss's
    backward run by ``backward`` (the trainer's own); their losses."""
    data = Tokens()
    losses = []
    for step in range(STEPS):
        batch = data[2 * step]["input_ids"][None].repeat(2, 1)
        loss = model(input_ids=batch, labels=batch).loss
        backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def accelerate_losses(model: Any, *, compiled: bool, regions: bool = False) -> list[float]:
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if compiled and regions:
        # Each block compiles on its own and runs once per block before any backward.
        layers = len(model.model.layers)
        model = accelerate.utils.compile_regions(model, backend="rematc", options={
            "budget": REGIONS_BUDGET, "calls": layers, "compiler": "eager", "cache_dir": None})
    elif compiled:
        model = rematc.compile(model, budget=BUDGET, compiler="eager", cache_dir=None)
    model, optimizer = accelerator.prepare(model, optimizer)
    return hand_written_steps(model, optimizer, accelerator.backward)


@pytest.mark.parametrize("regions", [False, True], ids=["whole", "compile_regions"])
def test_accelerate_trains_the_compiled_model_within_its_budget(regions: bool) -> None:
    expected = accelerate_losses(llama(), compiled=False)
    torch._dynamo.reset()
    rematc.clear_records()
    losses = accelerate_losses(llama(), compiled=True, regions=regions)
    assert losses == pytest.approx(expected, rel=1e-4)
    records = rematc.records()
    assert records and all(r.step_budget == (REGIONS_BUDGET if regions else BUDGET) for r in records)
    assert any(r.solver != "save_all" for r in records)


def lightning_losses(model: Any, tmp_path: Any) -> list[float]:
    lightning = pytest.importorskip("lightning")

    class Causal(lightning.LightningModule):
        """A causal language model's training step, the model given (compiled or not)."""

        def __init__(self, model: torch.nn.Module) -> None:
            super().__init__()
            self.model = model
            self.losses: list[float] = []

        def training_step(self, batch: dict[str, torch.Tensor], index: int) -> torch.Tensor:
            loss: torch.Tensor = self.model(input_ids=batch["input_ids"], labels=batch["labels"]).loss
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    module = Causal(model)
    trainer = lightning.Trainer(
        max_steps=STEPS, accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    trainer.fit(module, torch.utils.data.DataLoader(Tokens(), batch_size=2))
    return module.losses


def test_lightning_trains_the_compiled_model_within_its_budget(tmp_path: Any) -> None:
    """A ``LightningModule`` whose model is compiled by rematc."""
    expected = lightning_losses(llama(), tmp_path / "eager")
    torch._dynamo.reset()
    rematc.clear_records()
    losses = lightning_losses(rematc.compile(llama(), budget=BUDGET, compiler="eager", cache_dir=None),
                              tmp_path / "rematc")
    assert len(losses) == STEPS and losses == pytest.approx(expected, rel=1e-4)
    records = rematc.records()
    assert records and all(r.step_budget == BUDGET for r in records)
    assert any(r.solver != "save_all" for r in records)


def fabric_losses(model: Any, *, compiled: bool) -> list[float]:
    lightning = pytest.importorskip("lightning")
    fabric = lightning.Fabric(accelerator="cpu", devices=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if compiled:
        model = rematc.compile(model, budget=BUDGET, compiler="eager", cache_dir=None)
    model, optimizer = fabric.setup(model, optimizer)
    return hand_written_steps(model, optimizer, fabric.backward)


def test_lightning_fabric_trains_the_compiled_model_within_its_budget() -> None:
    """Fabric compiles the model again with the arguments rematc.compile gave
    ``torch.compile`` (its backend and budget among them)."""
    expected = fabric_losses(llama(), compiled=False)
    torch._dynamo.reset()
    rematc.clear_records()
    losses = fabric_losses(llama(), compiled=True)
    assert losses == pytest.approx(expected, rel=1e-4)
    records = rematc.records()
    assert records and all(r.step_budget == BUDGET for r in records)
    assert any(r.solver != "save_all" for r in records)
