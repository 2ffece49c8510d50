"""The ``clm`` command line.

User errors (``ClmError``: a bad file, a missing model, a setting out of range)
print one clean line and exit 1, never a traceback. Ctrl-C exits 130 and SIGTERM
143 after the report of finished turns is written.
"""

from __future__ import annotations

import click

from clm_middleware.cli.bench_cmd import bench
from clm_middleware.cli.chat_cmd import chat
from clm_middleware.cli.eval_cmd import eval_group
from clm_middleware.cli.replay_cmd import replay
from clm_middleware.cli.serve_cmd import serve
from clm_middleware.cli.stats_cmd import stats
from clm_middleware.errors import ClmError


class ClmGroup(click.Group):
    """Turns library errors into one-line CLI errors."""

    def invoke(self, ctx: click.Context):
        try:
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
