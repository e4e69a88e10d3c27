"""The `yatt-hpc` command line.

    yatt-hpc plan configs/demo_cpu.yaml --set placement.mode=disjoint
    yatt-hpc config show configs/demo_cpu.yaml
    yatt-hpc run configs/demo_cpu.yaml --run-dir runs/demo

User errors (bad config, impossible layout, bad data) print one message and exit 2; a verb that
is not built yet says so and exits 3. Tracebacks are for bugs only.
"""
from __future__ import annotations

import sys
from pathlib import Path

import click
from rich.console import Console

from yatt_hpc.config import ConfigError, RunConfig, load_config, to_yaml
from yatt_hpc.placement import Plan, PlanError, plan

EXIT_USER_ERROR = 2
EXIT_NOT_IMPLEMENTED = 3
USER_ERRORS: tuple[type[Exception], ...] = (ConfigError, PlanError)


class UserError(click.ClickException):
    exit_code = EXIT_USER_ERROR


class _Group(click.Group):
    """Turns every known user error into one `error: ...` message and exit code 2."""

    def invoke(self, ctx: click.Context):
        try:
            return super().invoke(ctx)
        except USER_ERRORS as err:
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
def plan_cmd(config_path: str, overrides: tuple[str, ...], run_dir: str) -> None:
    """Show where every group runs and the exact launch `run`/`submit` would perform."""
    from yatt_hpc.placement.show import print_plan

    _, p = load_and_plan(config_path, overrides)
    console = Console()
    if not console.is_terminal:
        console = Console(width=140)  # pipes and logs: keep table rows on one line
    print_plan(p, run_dir, console, python=sys.executable)


def _not_implemented(verb: str, issue: str):
    def command(**_: object) -> None:
        click.echo(f"yatt-hpc {verb}: not implemented yet ({issue}); nothing was done.", err=True)
        sys.exit(EXIT_NOT_IMPLEMENTED)

    command.__name__ = verb
    return command


_PENDING = {
    "run": ("Run a job locally (mpirun) or inside a Slurm allocation.", "the spine issue, #3"),
    "submit": ("Submit a run to Slurm through submitit.", "the Slurm-launch issue, #4"),
    "status": ("Show a job's state per group and step.", "the Slurm-launch issue, #4"),
    "cancel": ("Cancel a job.", "the Slurm-launch issue, #4"),
    "logs": ("Show a job's logs.", "the Slurm-launch issue, #4"),
    "ckpt": ("List, verify and export checkpoints.", "the checkpoint issue, #5"),
    "tb": ("Start TensorBoard on a run directory.", "the spine issue, #3"),
    "report": ("Write a run's report (PNG) and print a summary.", "the spine issue, #3"),
}
for _verb, (_help, _issue) in _PENDING.items():
    main.command(_verb, help=f"{_help} [not implemented yet]",
                 context_settings={"ignore_unknown_options": True, "allow_extra_args": True})(
        click.argument("args", nargs=-1, type=click.UNPROCESSED)(_not_implemented(_verb, _issue)))


if __name__ == "__main__":  # pragma: no cover
    main()
