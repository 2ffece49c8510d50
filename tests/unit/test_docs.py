from pathlib import Path

from clm_middleware.cli.docs import render_cli_reference

ROOT = Path(__file__).resolve().parents[2]


def test_cli_reference_page_matches_the_commands_help():
    committed = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    assert committed == render_cli_reference(), "run: python -m clm_middleware.cli.docs docs/cli.md"


def test_store_reference_page_matches_the_schema():
    from clm_middleware.store.docs import render_store_reference

    committed = (ROOT / "docs" / "store.md").read_text(encoding="utf-8")
    assert committed == render_store_reference(), "run: python -m clm_middleware.store.docs docs/store.md"
