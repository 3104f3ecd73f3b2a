"""`hf-asymkv eval synthetic | needle | attention | ppl | long-decode | frontier | press | lm-eval | report`:
arguments, checks before the model loads, output.

Every command prints its markdown table; with ``--out DIR`` it also writes ``<name>.json`` (rows, summary,
the exact command, model, versions, seeds, threads), ``<name>.md`` and its PNG figure, each atomically.
The model commands take ``--stress-outliers`` (:mod:`hf_asymkv.evals.stress`): the model then gets synthetic key
outliers, and every table, file and figure title says it is a stress case.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

from ..bench.schemes import PRESET_NAMES, scheme_names
from ..evals.forms import TAIL_FORM
from ..evals.needle import TASKS
from ..evals.stress import OUTLIER_PRESETS, parse_outlier_spec, stress_description
from . import lm_eval_cmd, press
from .args import (
    add_model_args,
    add_threads_arg,
    at_least,
    command_line,
    existing_file,
    fraction_list,
    input_arg,
    input_problem,
    int_list,
    load_model_from_args,
    name_list,
    output_folder,
    set_threads,
)
from .form_args import add_form_args, add_shared_prefill_arg, forms_from_args

__all__ = ["add_parser"]

DEFAULT_SCHEMES = ("dynamic,hf-quanto-int4,hf-fp8,asymkv,asymkv-fp8,k4v4-sym,k4v8-inverted,int8-per-tensor,"
                   "asymkv-sinks4,asymkv-w32,asymkv-w512")
LONG_DECODE_SCHEMES = ",".join(["dynamic", *(f"asymkv-{name}" for name in PRESET_NAMES), "hf-fp8", "hf-quanto-int4"])


def _prepare(args, needs_text: bool, lengths: dict[str, list[int]]):
    """Checks that need no weights (``lengths``: ``{flag: token counts}`` against the model config's position
    limit), then threads, model and the schemes it supports.

    Returns:
        ``(model, tokenizer, schemes, skipped, text, text_source)``.
    """
    from ..evals.common import check_length, check_schemes, schemes_for
    from ..evals.haystack import load_text
    from ..evals.stress import layer_ratios, stress_model
    from ..models import load_config
    from ..plots import require_matplotlib

    schemes = check_schemes(args.schemes)
    config = load_config(args.model)  # config.json only: lengths fail before the weights load
    for flag, values in lengths.items():
        for length in values:
            check_length(config, length, flag)
    if args.stress_outliers:  # layers named by the spec exist: checked before the weights load
        layer_ratios(parse_outlier_spec(args.stress_outliers), config.get_text_config(decoder=True).num_hidden_layers)
    text, source = load_text(args.text_file) if needs_text else (None, None)
    if args.out:
        require_matplotlib()  # fail now, not after an hour of measuring
    set_threads(args.threads)
    model, tokenizer = load_model_from_args(args)
    args.stress = stress_model(model, tokenizer, args.stress_outliers) if args.stress_outliers else None
    schemes, skipped = schemes_for(model, schemes)
    return model, tokenizer, schemes, skipped, text, source


def _model_name(model: str, stress: str | None) -> str:
    """The model's name in figure titles: its last path part, and the stress label when it has synthetic outliers
    (``stress``: the ``--stress-outliers`` spec)."""
    name = model.split("/")[-1]
    return f"{name} + key outliers {stress!r} (STRESS CASE)" if stress else name


def _headline(model: str, stress: str | None) -> str:
    """What a table starts with: the stress label for a stress model, nothing otherwise."""
    return f"**{stress_description(model)}** (`--stress-outliers {stress}`)\n\n" if stress else ""


def _stress_of(meta: dict | None) -> str | None:
    """The ``--stress-outliers`` spec a result file's metadata records, if any."""
    return ((meta or {}).get("stress_outliers") or {}).get("spec")


def _heartbeat(name: str):
    """A line on stderr about once a minute, ``--quiet`` or not: where the run is and how long it has taken."""
    from ..evals.common import Heartbeat

    return Heartbeat(f"eval {name}")


def _meta(args, model, seconds: float, **settings) -> dict:
    from ..evals.common import run_meta

    stress = {"stress_outliers": args.stress} if args.stress_outliers else {}
    return run_meta(model, args.model, command_line(args), seconds=round(seconds, 1), **stress, **settings)


def _write_md(path: Path, meta: dict, table: str) -> None:
    """``Command: ...`` then ``table`` (which starts with the stress label of a stress model, :func:`_headline`)."""
    from ..core.fileio import atomic_write_text

    atomic_write_text(path, f"Command: `{meta['command']}`\n\n{table}\n")


def _cmd_needle(args) -> int:
    from ..evals.figures import plot_needle_heatmaps
    from ..evals.report import flips, needle_markdown, write_json
    from ..evals.retrieval import accuracy_table, heatmap_grid, run_needle

    tasks = args.tasks
    if args.text_file is not None and args.haystack != "text":
        raise ValueError(f"--haystack-file is the text haystack's source; add --haystack text "
                         f"(got --haystack {args.haystack})")
    model, tokenizer, schemes, skipped, text, source = _prepare(args, args.haystack == "text",
                                                                {"--lengths": args.lengths})
    forms = forms_from_args(args)
    start = time.perf_counter()
    rows = run_needle(model, tokenizer, schemes, args.lengths, args.depths, tasks, args.samples, args.haystack, text,
                      args.seed, show_progress=not args.quiet, tick=_heartbeat("needle"), forms=forms,
                      shared_chunk=args.shared_prefill_chunk or None)
    seconds = time.perf_counter() - start
    by_length, by_task = accuracy_table(rows, "length"), accuracy_table(rows, "task")
    names = list(by_length)  # scheme by scheme, each scheme's forms side by side
    agreement = {s: sum(r.same_as_full for r in rows if r.scheme == s) / sum(r.scheme == s for r in rows)
                 for s in names}
    table = _headline(args.model, args.stress_outliers) + needle_markdown(
        by_length, by_task, args.lengths, tasks, agreement, flips([asdict(r) for r in rows]), skipped)
    print(table)
    if args.out:
        out = Path(args.out)
        grids = {s: heatmap_grid(rows, s, args.lengths, args.depths) for s in names}
        meta = _meta(args, model, seconds, haystack=args.haystack, text_source=source, seed=args.seed,
                     samples=args.samples, forms=forms, shared_prefill_chunk=args.shared_prefill_chunk)
        write_json(out / "needle.json", {
            "meta": meta, "schemes": schemes, "forms": forms, "skipped": skipped, "lengths": args.lengths, "depths": args.depths,
            "tasks": tasks, "accuracy_by_length": by_length, "accuracy_by_task": by_task,
            "same_tokens_as_full": agreement, "heatmaps": grids, "rows": [asdict(r) for r in rows]})
        _write_md(out / "needle.md", meta, table)
        plot_needle_heatmaps(grids, args.lengths, args.depths,
                             f"{_model_name(args.model, args.stress_outliers)}: needle accuracy "
                             f"({args.haystack} haystack, {', '.join(tasks)})", out / "needle_heatmaps.png")
    return 0


def _cmd_attention(args) -> int:
    from ..evals.attention import induction_scores, run_attention
    from ..evals.figures import plot_attention_layers
    from ..evals.report import attention_markdown, write_json

    if args.queries > args.length // 2:
        raise ValueError(f"--queries must be in [1, {args.length // 2}], got {args.queries}")
    model, tokenizer, schemes, skipped, _, _ = _prepare(args, False, {"--length": [args.length]})
    start = time.perf_counter()
    rows = run_attention(model, tokenizer, schemes, args.length, args.samples, args.queries, seed=args.seed,
                         show_progress=not args.quiet, tick=_heartbeat("attention"),
                         shared_chunk=args.shared_prefill_chunk or None)
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None else None
    induction = induction_scores(model, seed=args.seed, prefix_ids=bos)
    seconds = time.perf_counter() - start
    table = _headline(args.model, args.stress_outliers) + attention_markdown(rows, induction, skipped)
    print(table)
    if args.out:
        out = Path(args.out)
        meta = _meta(args, model, seconds, length=args.length, samples=args.samples, queries=args.queries,
                     seed=args.seed, shared_prefill_chunk=args.shared_prefill_chunk)
        write_json(out / "attention.json", {"meta": meta, "schemes": schemes, "skipped": skipped,
                                            "induction": induction, "rows": [asdict(r) for r in rows]})
        _write_md(out / "attention.md", meta, table)
        plot_attention_layers(rows, induction, f"{_model_name(args.model, args.stress_outliers)}, {args.length} "
                              f"tokens, last {args.queries} queries", out / "attention_layers.png")
    return 0


def _cmd_ppl(args) -> int:
    from ..evals.ppl import run_ppl
    from ..evals.report import ppl_markdown, write_json

    if args.prefix is not None and args.prefix > args.length - 2:
        raise ValueError(f"--prefix must be in [1, {args.length - 2}], got {args.prefix}")
    model, tokenizer, schemes, skipped, text, source = _prepare(args, True, {"--length": [args.length]})
    start = time.perf_counter()
    rows = run_ppl(model, tokenizer, schemes, text, args.length, args.windows, args.prefix, args.chunk,
                   show_progress=not args.quiet, tick=_heartbeat("ppl"))
    seconds = time.perf_counter() - start
    table = _headline(args.model, args.stress_outliers) + ppl_markdown(rows, skipped)
    print(table)
    if args.out:
        meta = _meta(args, model, seconds, text_source=source, length=args.length, windows=args.windows,
                     prefix=args.prefix or args.length // 2, chunk=args.chunk)
        write_json(Path(args.out) / "ppl.json", {"meta": meta, "schemes": schemes, "skipped": skipped,
                                                 "rows": [asdict(r) for r in rows]})
        _write_md(Path(args.out) / "ppl.md", meta, table)
        _plot_ppl(Path(args.out), _model_name(args.model, args.stress_outliers), [asdict(r) for r in rows],
                  args.length)
    return 0


def _plot_ppl(folder: Path, name: str, rows: list[dict], length: int) -> None:
    from ..evals.figures import plot_ppl

    plot_ppl(rows, f"{name}: perplexity through each scheme ({length}-token windows)", folder / "ppl.png")


def _cmd_long_decode(args) -> int:
    from ..evals.long_decode import long_decode_markdown, plot_long_decode, run_long_decode
    from ..evals.report import write_json

    model, tokenizer, schemes, skipped, text, source = _prepare(
        args, True, {"--prompt-length + --steps": [args.prompt_length + args.steps]})
    start = time.perf_counter()
    rows = run_long_decode(model, tokenizer, schemes, text, args.prompt_length, args.steps, args.prompts,
                           args.segment, args.seed, show_progress=not args.quiet, tick=_heartbeat("long-decode"))
    seconds = time.perf_counter() - start
    table = _headline(args.model, args.stress_outliers) + long_decode_markdown(rows, args.segment, skipped)
    print(table)
    if args.out:
        out = Path(args.out)
        meta = _meta(args, model, seconds, text_source=source, prompt_length=args.prompt_length, steps=args.steps,
                     prompts=args.prompts, segment=args.segment, seed=args.seed)
        write_json(out / "long_decode.json", {"meta": meta, "schemes": schemes, "skipped": skipped,
                                              "rows": [asdict(r) for r in rows]})
        _write_md(out / "long_decode.md", meta, table)
        plot_long_decode(rows, f"{_model_name(args.model, args.stress_outliers)}: {args.steps} tokens after a "
                         f"{args.prompt_length}-token prompt ({args.prompts} prompt(s))", out / "long_decode.png",
                         args.segment)
    return 0


def _cmd_report(args) -> int:
    from ..core.fileio import atomic_write_text
    from ..evals.figures import plot_summary
    from ..evals.report import read_results, summary_markdown

    folder = Path(args.folder).expanduser()
    if (folder / "frontier.json").is_file():  # redrawn from its JSON: table wording and figure of this version
        print(_redraw_frontier(folder))
        if not any((folder / f"{name}.json").is_file() for name in ("needle", "attention", "ppl")):
            return 0
    needle, attention, ppl = read_results(folder)
    meta = next(part["meta"] for part in (needle, attention, ppl) if part)
    table = _headline(meta["model"], _stress_of(meta)) + summary_markdown(needle, attention, ppl)
    print(table)
    atomic_write_text(folder / "summary.md", table + "\n")
    if ppl:  # redrawn from the JSON, so a folder from an older run gets the figure too
        _plot_ppl(folder, _model_name(ppl["meta"]["model"], _stress_of(ppl["meta"])), ppl["rows"],
                  ppl["meta"]["length"])
    if needle and ppl:
        delta = {r["scheme"]: r["delta_pct"] for r in ppl["rows"]}
        points = {s: (delta[s], acc["all"]) for s, acc in needle["accuracy_by_length"].items() if s in delta}
        name = _model_name(needle["meta"]["model"], _stress_of(needle["meta"]))
        plot_summary(points, f"{name}: perplexity misses what retrieval shows", folder / "summary.png")
    return 0


def _redraw_frontier(folder: Path) -> str:
    """``frontier.md`` and ``frontier.png`` of a frontier run again from its ``frontier.json`` (rows as measured;
    the Pareto check, the wording and the figure of this version). Returns the table."""
    import json

    from ..evals.frontier import FrontierRow, frontier_markdown, pareto_check, pareto_markdown
    from ..evals.frontier_plot import frontier_title, plot_frontier

    data = json.loads((folder / "frontier.json").read_text(encoding="utf-8"))
    meta = data["meta"]
    rows = [FrontierRow(**row) for row in data["rows"]]
    prompts = len(meta["lengths"]) * len(meta["depths"]) * len(meta["tasks"]) * meta["samples"]
    stress = _stress_of(meta)
    table = (_headline(meta["model"], stress) + frontier_markdown(rows, prompts, data.get("skipped")) + "\n\n"
             + pareto_markdown(pareto_check(rows)))
    _write_md(folder / "frontier.md", meta, table)
    plot_frontier(rows, frontier_title({**meta, "model": _model_name(meta["model"], stress)}), folder / "frontier.png")
    return table


def _cmd_frontier(args) -> int:
    from ..evals.frontier import DEFAULT_SCHEMES as FRONTIER_SCHEMES
    from ..evals.frontier import run_frontier
    from ..evals.frontier_plot import frontier_title, plot_frontier

    if args.text_file is not None and not args.ppl_length and not args.decode_steps:
        raise ValueError("--text-file is the Δperplexity and long-decode text; --ppl-length 0 measures no perplexity "
                         "and --decode-steps 0 no long decode")
    args.schemes = args.schemes or list(FRONTIER_SCHEMES)
    lengths = {"--lengths": args.lengths, "--attention-length": [args.attention_length] if args.attention_length else [],
               "--ppl-length": [args.ppl_length] if args.ppl_length else []}
    model, tokenizer, schemes, skipped, text, source = _prepare(args, args.ppl_length > 0, lengths)
    settings = {"lengths": args.lengths, "depths": args.depths, "tasks": args.tasks, "samples": args.samples,
                "attention_length": args.attention_length, "bytes_length": args.bytes_length or max(args.lengths),
                "ppl_length": args.ppl_length, "ppl_windows": args.ppl_windows, "decode_steps": args.decode_steps,
                "decode_prompt_length": args.decode_prompt_length, "text_source": source,
                "seed": args.seed}
    start, timeline = time.perf_counter(), []

    def write(rows, status: str | None = None) -> str:
        return _write_frontier(args, model, rows, schemes, skipped, time.perf_counter() - start,
                               {**settings, "status": status or "complete", "timeline": timeline}, partial=status)

    def save(state) -> None:  # after every unit of work: a run stopped midway leaves what it measured
        timeline.append([state.status(), round(time.perf_counter() - start, 1)])
        if args.out and not state.complete:
            write(state.rows(), state.status())

    rows = run_frontier(model, tokenizer, schemes, args.lengths, args.depths, args.tasks, args.samples,
                        args.attention_length, args.bytes_length, args.seed, args.ppl_length, args.ppl_windows, text,
                        args.decode_steps, args.decode_prompt_length, show_progress=not args.quiet, tick=_heartbeat("frontier"), on_step=save)
    print(write(rows))
    if args.out:
        plot_frontier(rows, frontier_title({"model": _model_name(args.model, args.stress_outliers), **settings}), Path(args.out) / "frontier.png")
    return 0


def _write_frontier(args, model, rows, schemes, skipped, seconds: float, settings: dict,
                    partial: str | None = None) -> str:
    """The table and Pareto check; with ``--out``, ``frontier.json`` and ``frontier.md`` (atomically). ``partial``
    (what was measured so far) marks the partial results written after each unit of work."""
    from ..evals.frontier import frontier_markdown, pareto_check, pareto_markdown
    from ..evals.report import write_json

    checks = pareto_check(rows)
    prompts = len(args.lengths) * len(args.depths) * len(args.tasks) * args.samples
    table = (_headline(args.model, args.stress_outliers) + frontier_markdown(rows, prompts, skipped) + "\n\n"
             + pareto_markdown(checks))
    if partial:
        table = (f"**Partial results**: the run stopped or is still running; measured so far: {partial}. "
                 "Unmeasured columns read -.\n\n" + table)
    if args.out:
        out = Path(args.out)
        meta = _meta(args, model, seconds, **settings)
        write_json(out / "frontier.json", {"meta": meta, "schemes": schemes, "skipped": skipped,
                                           "rows": [asdict(r) for r in rows], "pareto": checks})
        _write_md(out / "frontier.md", meta, table)
    return table


def _cmd_eval_synthetic(args) -> int:
    import json
    from dataclasses import asdict
    from pathlib import Path

    from ..core.fileio import atomic_write_text
    from ..evals.synthetic import format_synthetic, run_synthetic

    rows = run_synthetic(args.seeds)
    table = format_synthetic(rows)
    print(table)
    if args.out:
        out = Path(args.out)
        atomic_write_text(out / "synthetic.json", json.dumps({"seeds": args.seeds, "rows": [asdict(r) for r in rows]},
                                                              indent=2))
        atomic_write_text(out / "synthetic.md", table + "\n")
    return 0


def _outlier_spec(text: str) -> str:
    """argparse ``type=`` of ``--stress-outliers``: a preset name or a well-formed ``LAYER:RATIO`` list."""
    try:
        parse_outlier_spec(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--stress-outliers: ")) from None
    return text


def _add_stress_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stress-outliers", type=_outlier_spec, default=None, metavar="SPEC",
                   help="STRESS CASE: give the model synthetic key outliers without changing its outputs (k_proj rows "
                   "of a rotary pair x s, the matching q_proj rows x 1/s): a preset "
                   f"({', '.join(f'{k}: {v}' for k, v in OUTLIER_PRESETS.items())}) or LAYER:RATIO pairs such as "
                   "'0:150,-1:150,*:10' (each KV head's largest key pair made RATIO x its median pair; -1 is the last "
                   "layer, * every other). Llama-like attention only (q_proj/k_proj, no q/k norm). Every output is "
                   "labelled as a stress case")


def _results_folder(text: str) -> str | None:
    """Why ``text`` is not an existing folder that ``eval report`` can write its summary into (None: it is)."""
    from ..core.fileio import output_problem

    return input_problem(text, "folder") or output_problem(text, "folder")


def _common(p: argparse.ArgumentParser, name: str, text_flag: str | None = None,
            schemes: str = DEFAULT_SCHEMES) -> None:
    add_model_args(p)
    _add_stress_arg(p)
    p.add_argument("--schemes", type=name_list(scheme_names(), "cache scheme"), default=schemes,
                   help=f"comma-separated scheme names, from: {', '.join(scheme_names())} (dynamic is always "
                   "added first as the reference; schemes a model cannot use are listed as skipped)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed")
    add_threads_arg(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars (a line about once a minute still says "
                   "where the run is)")
    p.add_argument("--out", type=output_folder, default=None, help=f"folder for {name}.json, {name}.md and the figure")
    if text_flag:
        _add_text_file(p, text_flag)


def _add_text_file(p: argparse.ArgumentParser, flag: str, use: str = "") -> None:
    input_arg(p, flag, dest="text_file", check=existing_file, default=None,
                   help=f"local UTF-8 text file{use} (default: the built-in corpus, Python's pydoc_data.topics)")


def add_parser(sub) -> None:
    """The ``eval`` command and its subcommands."""
    p = sub.add_parser("eval", help="evaluations: synthetic head, needle retrieval, attention damage, perplexity, "
                                    "bytes-vs-damage frontier, report of a results folder")
    evals = p.add_subparsers(dest="eval_command", title="evaluations", metavar="EVAL")
    p.set_defaults(func=None, usage_parser=p)  # `hf-asymkv eval` alone lists the evaluations
    e = evals.add_parser("synthetic", help="the reference article's synthetic head, our quantizers, several seeds")
    e.add_argument("--seeds", type=at_least(1), default=5, help="number of random heads")
    e.add_argument("--out", type=output_folder, default=None, help="folder for synthetic.json and synthetic.md")
    e.set_defaults(func=_cmd_eval_synthetic)

    e = evals.add_parser("needle", help="RULER-style needle retrieval grid (length x depth x task) per scheme")
    _common(e, "needle", "--haystack-file")
    e.add_argument("--lengths", type=int_list, default="1024,2048,4096,8192",
                   help="token budgets, prompt + answer (default 1024,2048,4096,8192)")
    e.add_argument("--depths", type=fraction_list, default="0,0.25,0.5,0.75,1",
                   help="needle depths in [0, 1] (default 0,0.25,0.5,0.75,1)")
    e.add_argument("--tasks", type=name_list(TASKS, "task"), default=",".join(TASKS),
                   help=f"comma-separated tasks, from: {', '.join(TASKS)}")
    e.add_argument("--samples", type=at_least(1), default=1, help="prompts per (length, depth, task) cell")
    e.add_argument("--haystack", default="noise", choices=["noise", "needles", "text"],
                   help="filler: repeated noise, distractor needles, or natural text (--haystack-file)")
    add_form_args(e, default=TAIL_FORM, tail=True)
    e.set_defaults(func=_cmd_needle)

    e = evals.add_parser("attention", help="per-layer attention KL and top-k overlap vs full precision")
    _common(e, "attention")
    e.add_argument("--length", type=at_least(1), default=4096, help="prompt length in tokens")
    e.add_argument("--samples", type=at_least(1), default=2, help="prompts, needle depths spread")
    e.add_argument("--queries", type=at_least(1), default=32,
                   help="last prompt tokens whose attention is compared (at most half of --length)")
    add_shared_prefill_arg(e)
    e.set_defaults(func=_cmd_attention)

    e = evals.add_parser("ppl", help="perplexity through each scheme's quantized history, on long text")
    _common(e, "ppl", "--text-file")
    e.add_argument("--length", type=at_least(3), default=4096, help="window length in tokens")
    e.add_argument("--windows", type=at_least(1), default=2, help="windows at evenly spaced text offsets")
    e.add_argument("--prefix", type=at_least(1), default=None,
                   help="tokens prefilled before scoring, below --length (default length/2)")
    e.add_argument("--chunk", type=at_least(1), default=64, help="tokens per scoring call")
    e.set_defaults(func=_cmd_ppl)

    e = evals.add_parser("long-decode", help="KL per 64-token segment and greedy agreement along a long generation")
    _common(e, "long_decode", "--text-file", schemes=LONG_DECODE_SCHEMES)
    e.add_argument("--prompt-length", type=at_least(1), default=2048,
                   help="prompt tokens (a window of the text), prefilled in full precision")
    e.add_argument("--steps", type=at_least(1), default=512,
                   help="generated tokens teacher-forced through each cache, one per step")
    e.add_argument("--prompts", type=at_least(1), default=1, help="prompts at evenly spaced text offsets")
    e.add_argument("--segment", type=at_least(1), default=64, help="steps per KL segment")
    e.set_defaults(func=_cmd_long_decode)

    e = evals.add_parser("frontier", help="bytes vs damage of our settings and every peer format, Pareto check")
    add_model_args(e)
    _add_stress_arg(e)
    e.add_argument("--schemes", type=name_list(scheme_names(), "cache scheme"), default=None,
                   help=f"comma-separated scheme names, from: {', '.join(scheme_names())} (default: our settings, "
                   "presets, int8-per-tensor, every peer emulation and transformers' QuantizedCache; dynamic always "
                   "first)")
    e.add_argument("--lengths", type=int_list, default="2048,4096", help="needle token budgets")
    e.add_argument("--depths", type=fraction_list, default="0.1,0.5,0.9", help="needle depths in [0, 1]")
    e.add_argument("--tasks", type=name_list(TASKS, "task"), default="multikey",
                   help=f"comma-separated needle tasks, from: {', '.join(TASKS)}")
    e.add_argument("--samples", type=at_least(1), default=1, help="prompts per (length, depth, task) cell")
    e.add_argument("--attention-length", type=at_least(0), default=2048,
                   help="prompt length for per-layer attention KL (0 skips it)")
    e.add_argument("--bytes-length", type=at_least(1), default=None,
                   help="tokens for the byte count (default: the longest --lengths)")
    e.add_argument("--ppl-length", type=at_least(3, zero_ok=True), default=2048,
                   help="window length in tokens for Δperplexity, second half scored (0 skips it)")
    e.add_argument("--ppl-windows", type=at_least(1), default=1, help="Δperplexity windows at spread text offsets")
    e.add_argument("--decode-steps", type=at_least(1, zero_ok=True), default=0,
                   help="long-decode columns (eval long-decode): generated tokens per prompt (0, the default, skips "
                   "them; 512 is the evaluation's own default)")
    e.add_argument("--decode-prompt-length", type=at_least(1), default=2048, help="long-decode prompt tokens")
    _add_text_file(e, "--text-file", " for Δperplexity and the long-decode prompts")
    e.add_argument("--seed", type=int, default=0, help="prompt seed")
    add_threads_arg(e)
    e.add_argument("--quiet", action="store_true", help="no progress bars (a line about once a minute still says "
                   "where the run is)")
    e.add_argument("--out", type=output_folder, default=None, help="folder for frontier.json, frontier.md and frontier.png")
    e.set_defaults(func=_cmd_frontier)

    press.add_parser(evals)
    lm_eval_cmd.add_parser(evals)

    e = evals.add_parser("report", help="one table: needle accuracy beside attention damage and perplexity; a "
                                        "frontier run's table and figure drawn again from its frontier.json")
    input_arg(e, "folder", check=_results_folder,
                   help="an --out folder holding needle.json / attention.json / ppl.json / frontier.json (summary.md, "
                        "frontier.md and the figures are written into it)")
    e.set_defaults(func=_cmd_report)
