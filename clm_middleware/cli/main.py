"""The ``clm`` command line.

User errors (``ClmError``: a bad file, a missing model, a setting out of range)
print one clean line and exit 1, never a traceback. Ctrl-C exits 130 and SIGTERM
143 after the report of finished turns is written. A ``RuntimeWarning`` the library
raises (quantizing on a CPU without native bf16, a damaged disk-cache entry) prints
as one ``warning: ...`` line on stderr, as the CLI's own warnings do; any other
warning keeps Python's format.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import click

from clm_middleware.cli.bench_cmd import bench
from clm_middleware.cli.chat_cmd import chat
from clm_middleware.cli.eval_cmd import eval_group
from clm_middleware.cli.replay_cmd import replay
from clm_middleware.cli.serve_cmd import serve
from clm_middleware.cli.stats_cmd import stats
from clm_middleware.errors import ClmError

_PACKAGE = Path(__file__).resolve().parent.parent


def _one_line_warnings(fallback):
    """A ``warnings.showwarning`` that prints the library's runtime warnings as one
    ``warning: ...`` line and hands any other warning to ``fallback``."""

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        if issubclass(category, RuntimeWarning) and Path(filename).resolve().is_relative_to(_PACKAGE):
            click.echo(f"warning: {message}", err=True)
        else:
            fallback(message, category, filename, lineno, file, line)

    return show


class ClmGroup(click.Group):
    """Turns library errors into one-line CLI errors, and its runtime warnings into
    one-line CLI warnings."""

    def invoke(self, ctx: click.Context):
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _one_line_warnings(warnings.showwarning)
                return super().invoke(ctx)
        except ClmError as error:
            raise click.ClickException(str(error)) from None
        except KeyboardInterrupt:  # before a command's own handling (loading the model): 130, not click's 1
            click.echo("interrupted", err=True)
            ctx.exit(130)


@click.group(cls=ClmGroup)
@click.version_option(package_name="clm-middleware")
def cli() -> None:
    """clm-middleware: a local chat model manages its own context over a block-pool KV cache."""


cli.add_command(replay)
cli.add_command(bench)
cli.add_command(eval_group)
cli.add_command(chat)
cli.add_command(stats)
cli.add_command(serve)


def main() -> None:
    cli(prog_name="clm")


if __name__ == "__main__":
    main()
