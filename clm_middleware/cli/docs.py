"""Render ``docs/cli.md`` from the commands' own help, so the page cannot drift.

``python -m clm_middleware.cli.docs docs/cli.md`` rewrites it; a test fails when the
committed page differs from what this renders.
"""

from __future__ import annotations

import click

from clm_middleware.cli.main import cli


def render_cli_reference() -> str:
    lines = [
        "# The `clm` command line",
        "",
        "Generated from the commands' own `--help` by `python -m clm_middleware.cli.docs docs/cli.md`;",
        "do not edit by hand.",
        "",
    ]
    context = click.Context(cli, info_name="clm", terminal_width=100, max_content_width=100)
    lines += ["```", cli.get_help(context), "```", ""]
    for name in sorted(cli.list_commands(context)):
        command = cli.get_command(context, name)
        sub = click.Context(command, info_name=f"clm {name}", parent=None, terminal_width=100, max_content_width=100)
        lines += [f"## clm {name}", "", "```", command.get_help(sub), "```", ""]
        if isinstance(command, click.Group):
            for child in sorted(command.list_commands(sub)):
                leaf = command.get_command(sub, child)
                leaf_context = click.Context(
                    leaf, info_name=f"clm {name} {child}", terminal_width=100, max_content_width=100
                )
                lines += [
                    f"### clm {name} {child}",
                    "",
                    "```",
                    leaf.get_help(leaf_context),
                    "```",
                    "",
                ]
    return "\n".join(lines)


if __name__ == "__main__":
    from clm_middleware.reference_docs import write_reference

    write_reference(render_cli_reference, "docs/cli.md", "command-line reference")
