"""`yatt-hpc ckpt`: list, verify and export checkpoints of a run directory.

    yatt-hpc ckpt list runs/demo                 # step, size, time, verified
    yatt-hpc ckpt verify runs/demo [--step 20]   # exit 1 if a checked checkpoint is bad
    yatt-hpc ckpt export-hf runs/demo --step 20 --out hf-step-20            # a LoRA run's: merged
    yatt-hpc ckpt export-peft runs/lora --step 20 --out adapter-step-20     # a LoRA run's adapters, for PEFT

DIR may be a run directory or its ``checkpoints/`` directory. User errors print one line, exit 2.
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import click
from rich.console import Console
from rich.table import Table

from yatt_hpc.ckpt import layout
from yatt_hpc.ckpt.errors import CheckpointError
from yatt_hpc.ckpt.manifest import read_marker, verify_step


class CkptUserError(click.ClickException):
    exit_code = 2


def _steps(run_dir: Path) -> list[layout.StepDir]:
    ckpt_dir = layout.resolve_checkpoints_dir(run_dir)
    steps = layout.list_steps(ckpt_dir)
    if not steps:
        raise CkptUserError(f"no checkpoints under {ckpt_dir}: DIR must be a run directory (or its "
                            "checkpoints/) of a run that saved at least once")
    return steps


def _size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def _saved_at(path: Path) -> float:
    """The commit time recorded in the marker; the directory's mtime when there is none."""
    try:
        return read_marker(path)["created"]
    except ValueError:
        return path.stat().st_mtime


_DIR = click.argument("run_dir", metavar="DIR", type=click.Path(file_okay=False, path_type=Path))


@click.group("ckpt")
def ckpt() -> None:
    """List, verify and export checkpoints."""


@ckpt.command("list")
@_DIR
def list_cmd(run_dir: Path) -> None:
    """Table of every checkpoint in DIR: step, size, time, verified (sha256 of every file)."""
    table = Table("step", "size", "time", "verified", title=str(layout.resolve_checkpoints_dir(run_dir)))
    for s in _steps(run_dir):
        problem = verify_step(s.path)
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(_saved_at(s.path)))
        table.add_row(str(s.step), f"{_size(s.path) / 2**20:.1f} MiB", when,
                      "[green]yes[/]" if problem is None else f"[red]no[/]: {problem}")
    console = Console() if sys.stdout.isatty() else Console(width=160)
    console.print(table)


@ckpt.command("verify")
@_DIR
@click.option("--step", type=int, default=None, help="Verify only this step (default: every checkpoint).")
def verify_cmd(run_dir: Path, step: int | None) -> None:
    """Check sizes and sha256 of every file against the manifest; exit 1 if one is bad."""
    steps = _steps(run_dir)
    if step is not None:
        steps = [s for s in steps if s.step == step]
        if not steps:
            raise CkptUserError(f"no checkpoint step {step} in {run_dir}; `yatt-hpc ckpt list {run_dir}` shows them")
    bad = 0
    for s in steps:
        problem = verify_step(s.path)
        bad += problem is not None
        click.echo(f"step {s.step}: {'ok' if problem is None else 'BAD: ' + problem}")
    sys.exit(1 if bad else 0)


LOST_WARN = 0.01
"""`export-hf --dtype` warns when this fraction of the trained changes rounds back to the original."""


@ckpt.command("export-hf")
@_DIR
@click.option("--step", type=int, required=True, help="Checkpoint step to export.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Output directory (HF layout: model.safetensors, config.json, tokenizer files).")
@click.option("--model-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Original HF model directory (default: model.path of the saved config).")
@click.option("--dtype", type=click.Choice(["float32", "bfloat16", "float16"]), default=None,
              help="Tensor dtype to write (default: the checkpoint's, float32); config.json says the same.")
@click.option("--critic", is_flag=True, default=False,
              help="Export the value model (a train.adv_estimator=gae run's) as a *ForTokenClassification, 1 label.")
def export_cmd(run_dir: Path, step: int, out: Path, model_dir: Path | None, dtype: str | None, critic: bool) -> None:
    """Merge the tensor-parallel shards of one checkpoint into a Hugging Face model directory (a LoRA run's
    adapters merged into its base model; with --critic, the value model)."""
    from yatt_hpc.ckpt.export_hf import export_critic, export_hf

    try:
        done = (export_critic if critic else export_hf)(run_dir, step, out, model_dir, dtype)
    except CheckpointError as err:
        raise CkptUserError(str(err)) from None
    if done.lost_in_cast is not None and done.lost_in_cast >= LOST_WARN:
        click.echo(f"warning: {done.lost_in_cast:.0%} of the weights training changed are back at their original "
                   f"value in {done.dtype} (the changes are below its resolution); export without --dtype "
                   "to keep them in float32", err=True)
    click.echo(f"exported step {step} to {out} ({done.dtype})")


@ckpt.command("export-peft")
@_DIR
@click.option("--step", type=int, required=True, help="Checkpoint step to export.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Output directory (PEFT layout: adapter_config.json, adapter_model.safetensors).")
@click.option("--model-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="The base HF model directory (default: model.path of the saved config); it must be the base the "
                   "adapters were trained on, and adapter_config.json names it.")
def export_peft_cmd(run_dir: Path, step: int, out: Path, model_dir: Path | None) -> None:
    """Write a LoRA run's adapters as a PEFT adapter directory (PeftModel.from_pretrained(base, OUT) loads it)."""
    from yatt_hpc.ckpt.export_hf import export_peft

    try:
        export_peft(run_dir, step, out, model_dir)
    except CheckpointError as err:
        raise CkptUserError(str(err)) from None
    click.echo(f"exported the adapters of step {step} to {out}")
