"""Start-up: the CLI's help and its argument and file errors load neither torch nor transformers."""

from __future__ import annotations

import subprocess
import sys

import pytest

PROBE = """
import sys
from clm_middleware.cli.main import cli
try:
    cli.main(args={args!r}, prog_name="clm", standalone_mode=False)
except Exception as error:
    print(type(error).__name__, error)
heavy = sorted(m for m in ("torch", "transformers", "langchain_core") if m in sys.modules)
print("heavy:", ",".join(heavy) or "none")
"""


def _run(args: list[str]) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(args=args)], capture_output=True, text=True, timeout=120, check=True
    )
    return done.stdout


@pytest.mark.parametrize("args", [["--help"], ["replay", "--help"], ["serve", "--help"], ["eval", "--help"]])
def test_help_loads_no_heavy_library(args):
    assert _run(args).strip().endswith("heavy: none")


def test_a_bad_transcript_is_refused_before_the_model_libraries_load(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"role": "user", "content": "hi"}\n{"role": "wizard", "content": "x"}\n')
    out = _run(["replay", str(bad), "--model", "tiny"])
    assert "bad.jsonl:2: unknown role 'wizard'" in out
    assert out.strip().endswith("heavy: none")


def test_the_package_exports_resolve_on_first_use():
    import clm_middleware

    assert clm_middleware.Conversation.__name__ == "Conversation"
    assert {"Conversation", "Engine", "ChatCLM", "__version__"} <= set(dir(clm_middleware))
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        _ = clm_middleware.Nope


def test_every_error_kind_imports_from_the_package():
    import inspect

    import clm_middleware
    from clm_middleware import errors

    kinds = [value for _, value in inspect.getmembers(errors, inspect.isclass) if issubclass(value, errors.ClmError)]
    assert len(kinds) > 10
    assert all(getattr(clm_middleware, kind.__name__) is kind for kind in kinds)
    assert all(kind.__name__ in clm_middleware.__all__ for kind in kinds)
