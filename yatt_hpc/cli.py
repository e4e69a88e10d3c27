"""The `yatt-hpc` command line.

    yatt-hpc plan configs/demo_cpu.yaml --set placement.mode=disjoint
    yatt-hpc config show configs/demo_cpu.yaml
    yatt-hpc run configs/demo_cpu.yaml --run-dir runs/demo

User errors (bad config, impossible layout, bad data, no Slurm) print one message and exit 2.
Tracebacks are for bugs only.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from yatt_hpc.ckpt.cli import ckpt as _ckpt_group
from yatt_hpc.config import RunConfig, load_config, to_yaml
from yatt_hpc.placement import Plan, plan

EXIT_USER_ERROR = 2


class UserError(click.ClickException):
    exit_code = EXIT_USER_ERROR


class _Group(click.Group):
    """Turns every known user error into one `error: ...` message and exit code 2."""

    def invoke(self, ctx: click.Context):
        from yatt_hpc.errors import USER_ERRORS
        from yatt_hpc.launch.local import LaunchError

        try:
            return super().invoke(ctx)
        except USER_ERRORS + (LaunchError,) as err:
            raise UserError(str(err)) from None


def _overrides(fn):
    return click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                        help="Override a config field, e.g. --set train.steps=10 (repeatable).")(fn)


def load_and_plan(config: str, overrides: tuple[str, ...]) -> tuple[RunConfig, Plan]:
    cfg = load_config(config, overrides)
    return cfg, plan(cfg)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="yatt-hpc")
def main() -> None:
    """yatt-hpc: Slurm-native RL post-training (trainer, rollout and GenRM as ranks of one MPI world)."""


@main.group(cls=_Group)
def config() -> None:
    """Inspect configs: the resolved YAML and the field reference."""


@config.command("show")
@click.argument("config_path", metavar="CONFIG")
@_overrides
def config_show(config_path: str, overrides: tuple[str, ...]) -> None:
    """Print CONFIG fully resolved (defaults filled in, overrides applied, layout checked)."""
    cfg, _ = load_and_plan(config_path, overrides)
    click.echo(to_yaml(cfg), nl=False)


@config.command("docs")
def config_docs() -> None:
    """Print the config reference (Markdown) generated from the field docstrings."""
    from yatt_hpc.config.docs import reference_markdown

    click.echo(reference_markdown(), nl=False)


@main.command("plan")
@click.argument("config_path", metavar="CONFIG")
@_overrides
@click.option("--run-dir", default="RUN_DIR", show_default=True, help="Run directory shown in the launch line.")
@click.option("--sbatch", "as_sbatch", is_flag=True, help="Print the equivalent sbatch script instead.")
def plan_cmd(config_path: str, overrides: tuple[str, ...], run_dir: str, as_sbatch: bool) -> None:
    """Show where every group runs and the exact launch `run`/`submit` would perform."""
    from yatt_hpc.placement.show import print_plan

    cfg, p = load_and_plan(config_path, overrides)
    if as_sbatch:
        from yatt_hpc.launch.sbatch import SbatchError, render_sbatch

        try:
            click.echo(render_sbatch(cfg, p, run_dir, sys.executable), nl=False)
        except SbatchError as err:
            raise UserError(str(err)) from None
        return
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # pipes and logs: keep table rows on one line
    from yatt_hpc.runtime.inputs import policy_layer_count

    print_plan(p, run_dir, console, python=sys.executable, cfg=cfg, num_layers=policy_layer_count(cfg))


@main.command("run")
@click.argument("config_path", metavar="CONFIG")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for config.yaml, logs/, tb/, metrics and checkpoints.")
@_overrides
def run_cmd(config_path: str, run_dir: Path, overrides: tuple[str, ...]) -> None:
    """Run CONFIG: one MPI world (mpirun here, srun --mpi=pmix inside a Slurm allocation)."""
    from yatt_hpc.ckpt.layout import checkpoints_dir
    from yatt_hpc.ckpt.manifest import complete_message, completed_step
    from yatt_hpc.launch.local import launch_run
    from yatt_hpc.runtime.inputs import check_model_dirs

    cfg, p = load_and_plan(config_path, overrides)
    check_model_dirs(cfg)
    done = completed_step(checkpoints_dir(run_dir), cfg.train.steps)
    if done is not None:  # no ranks to start: running a finished run again costs no start-up
        click.echo(complete_message(run_dir, done, cfg.train.steps))
        sys.exit(0)
    code = launch_run(cfg, p, run_dir)
    if code:
        click.echo(f"yatt-hpc run: the job failed (exit {code}); per-rank logs are in {run_dir / 'logs'}", err=True)
    sys.exit(code)


@main.command("tb")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
@click.option("--port", default=6006, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True)
def tb_cmd(run_dir: Path, port: int, host: str) -> None:
    """Start TensorBoard on RUN_DIR/tb and print its URL (Ctrl-C stops it)."""
    import subprocess

    logdir = run_dir / "tb"
    if not logdir.is_dir():
        raise UserError(f"{logdir} does not exist: RUN_DIR must be a yatt-hpc run directory with tensorboard in logging.trackers")
    exe = Path(sys.executable).with_name("tensorboard")
    click.echo(f"TensorBoard for {logdir}: http://{host}:{port}/")
    sys.exit(subprocess.call([str(exe), "--logdir", str(logdir), "--port", str(port), "--host", host]))


@main.command("report")
@click.argument("run_dir", type=click.Path(exists=True, file_okay=False, path_type=Path))
def report_cmd(run_dir: Path) -> None:
    """Write RUN_DIR/report.png (reward, accuracy, KL, phase times) and print a text summary."""
    from yatt_hpc.metrics.report import ReportError, text_summary, write_report

    try:
        out = write_report(run_dir)
        click.echo(text_summary(run_dir))
    except ReportError as err:
        raise UserError(str(err)) from None
    click.echo(f"report: {out}")


def _slurm_errors(fn):
    """Slurm verbs: one-line `Error: ...` and exit 2 for everything the user has to fix."""
    import functools

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from yatt_hpc.launch.jobs import SlurmError
        from yatt_hpc.launch.sbatch import SbatchError

        try:
            return fn(*args, **kwargs)
        except (SlurmError, SbatchError) as err:
            raise UserError(str(err)) from None
    return wrapper


@main.command("submit")
@click.argument("config_path", metavar="CONFIG")
@click.option("--run-dir", required=True, type=click.Path(file_okay=False, path_type=Path),
              help="Directory for config.yaml, logs/, tb/, metrics, checkpoints and submitit's files.")
@_overrides
@click.option("--dry-run", is_flag=True, help="Print the exact sbatch script; submit nothing.")
@click.option("--wait", is_flag=True, help="Wait until the job ends; exit 0 only if it COMPLETED.")
@_slurm_errors
def submit_cmd(config_path: str, run_dir: Path, overrides: tuple[str, ...], dry_run: bool, wait: bool) -> None:
    """Submit CONFIG to Slurm (through submitit): one het component per group when disjoint."""
    from yatt_hpc.launch.submitit_exec import dry_run_text, submit_command

    cfg, p = load_and_plan(config_path, overrides)
    if dry_run:
        click.echo(dry_run_text(cfg, p, run_dir), nl=False)
        return
    sys.exit(submit_command(cfg, p, run_dir, wait, click.echo))


@main.command("status")
@click.argument("job", required=False)
@_slurm_errors
def status_cmd(job: str | None) -> None:
    """Show JOB per het component and step (sacct), or the last day's jobs."""
    from yatt_hpc.launch.jobs import print_status, require_slurm

    require_slurm("status")
    print_status(job, Console(width=None if Console().is_terminal else 160))


@main.command("logs")
@click.argument("job", metavar="JOB|RUN_DIR")
@click.option("--group", type=click.Choice(["trainer", "rollout", "genrm"]), help="Show this group's rank logs.")
@click.option("--follow", "-f", is_flag=True, help="Keep printing new lines until the job ends.")
@_slurm_errors
def logs_cmd(job: str, group: str | None, follow: bool) -> None:
    """Print a job's launcher logs (one per restart), or with --group its ranks' logs."""
    from contextlib import suppress

    from yatt_hpc.launch.jobs import find_logs, require_slurm, show_logs

    require_slurm("logs")
    with suppress(KeyboardInterrupt):  # Ctrl-C ends --follow
        show_logs(find_logs(job), group, follow)


@main.command("cancel")
@click.argument("job")
@_slurm_errors
def cancel_cmd(job: str) -> None:
    """Cancel JOB (all het components and steps): the ranks save at the signal, and the job is not requeued."""
    from yatt_hpc.launch.jobs import cancel, require_slurm

    require_slurm("cancel")
    cancel(job)
    click.echo(f"cancelled job {job}; `yatt-hpc status {job}` shows it leave the queue")


main.add_command(_ckpt_group)  # yatt-hpc ckpt list / verify / export-hf


if __name__ == "__main__":  # pragma: no cover
    main()
