"""The ``gradzip`` command: ``demo``, ``train``, ``compare``, ``list``, ``plan``, ``bench``.

Configuration errors (bad spec strings, out-of-range values, missing files) print one line on
stderr and exit with status 2. Set ``GRADZIP_DEBUG=1`` to see the traceback instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import textwrap
import types
import typing
from collections.abc import Sequence
from typing import Any

from gradzip._cli_parser import OneLineParser
from gradzip.plan import command as plan_command
from gradzip.train.config import RunConfig, run_options
from gradzip.train.fields import Option

__all__ = ["build_parser", "main"]

log = logging.getLogger(__name__)

_FMT = argparse.RawDescriptionHelpFormatter

#: How many seeds ``gradzip demo`` runs each method on (one seed ranks nothing reliably).
DEFAULT_SEEDS = 3

#: What ``gradzip demo --quick`` shrinks the demo to (``--epochs``/``--limit-train``/``--seeds``
#: still win).
QUICK_DEMO = {"epochs": 1, "limit_train": 256, "seeds": 1}

DEMO_EPILOG = """\
Trains the embedded 8x8 digits task with 4 simulated workers, once per method and seed (3
seeds): none, top-k 1%, hard threshold (budget 1%), PowerSGD rank 1 and rank 4, and Accordion
switching PowerSGD between rank 1 (its aggressive level) and rank 4 (its gentle level, used
in critical regimes). Prints a table of means and ranges over the seeds, a summary line and
writes a plot.

examples:
  gradzip demo
  gradzip demo --out /tmp/demo --quiet
  gradzip demo --seeds 1      # a third of the time; one seed ranks nothing reliably
  gradzip demo --quick        # one epoch on 256 images, one seed: checks an install, no verdict
"""

TRAIN_EPILOG = """\
examples:
  gradzip train --task digits --workers 4 --compressor topk:ratio=0.01 --out runs/topk
  gradzip train --task digits --compressor powersgd:rank=1 --accordion powersgd:rank=4 \\
      --interval-epochs 2 --out runs/accordion
  gradzip train --task cifar10 --data ~/.cache/cifar10 --workers 4 \\
      --compressor powersgd:rank=2 --epochs 1 --limit-train 5000 --out runs/c10
  gradzip train --task lm --data wiki.train.tokens --compressor topk:ratio=0.02 --out runs/lm
  gradzip train --task digits --workers 2 --launcher procs --compressor topk:ratio=0.1 \\
      --out runs/procs                      # 2 local gloo processes through the DDP hook
  torchrun --nnodes 2 --nproc-per-node 8 -m gradzip train --task cifar10 --data DIR \\
      --compressor powersgd:rank=2 --out runs/big   # each process is one worker

Options left out take the task's defaults (see `gradzip list`). The learning rate is per
worker and scaled by the number of workers after a linear warm-up.

A run is checked whole before DIR is written to; DIR holding another configuration's results
is refused, and so is DIR holding this configuration's results without --resume (continue) or
--overwrite (start over; the old results stay until the new run finishes). A checkpoint is
saved every --checkpoint-every epochs; after an interruption, the same command with --resume
continues from it (also with more --epochs):
  gradzip train --task digits --compressor topk:ratio=0.01 --out runs/topk --resume
"""

COMPARE_EPILOG = """\
A grid file (TOML; YAML with PyYAML; JSON) has a [base] table of train options shared by all
runs, an optional [grid] of lists (cross product), and [[runs]] tables (each with an optional
label). Built-in presets: see `gradzip list`.

examples:
  gradzip compare digits-quick
  gradzip compare my-grid.toml --out results/my-grid
  gradzip compare cifar10-accordion --set data=~/.cache/cifar10 --set epochs=30

Finished runs (summary.json present with the same configuration) are skipped on a re-run;
--force re-runs them. Interrupted runs continue from their checkpoints. A run directory holding
another configuration's results is refused before any run starts.
"""

LIST_EPILOG = """\
examples:
  gradzip list
  gradzip list --json | python -m json.tool
"""


def _run_argument(field: dataclasses.Field[Any], option: Option,
                  hint: Any) -> tuple[str, dict[str, Any]]:
    """The flag and ``add_argument`` keywords of one run option, from its field: the type
    from the annotation, the default from the field, the rest from its :class:`Option`."""
    flag = option.flag or "--" + field.name.replace("_", "-")
    kwargs: dict[str, Any] = {"dest": field.name, "help": option.help}
    for key in ("metavar", "choices"):
        if getattr(option, key) is not None:
            kwargs[key] = getattr(option, key)
    if option.required:
        kwargs["required"] = True
    kinds = [a for a in typing.get_args(hint) if a is not type(None)]
    kind = kinds[0] if typing.get_origin(hint) is types.UnionType else hint
    default = field.default
    if kind is bool:
        if default is None:  # unset: the compressor's or the task's choice
            kwargs["action"] = argparse.BooleanOptionalAction
        else:  # off by default: --x turns it on; on by default: only --no-x is offered
            assert not default or flag.startswith("--no-"), f"{field.name}: a --no- flag"
            kwargs["action"] = "store_false" if default else "store_true"
    elif kind == tuple[str, ...]:  # repeatable
        kwargs["action"], default = "append", None
    elif kind in (int, float):
        kwargs["type"] = kind
    # Other kinds (text, and tuples written as text: "0.5,0.75") stay text; RunConfig parses.
    kwargs["default"] = default
    return flag, kwargs


def _add_run_options(parser: argparse.ArgumentParser) -> None:
    """Every command-line run option of :class:`~gradzip.train.config.RunConfig`, generated
    from its fields, grouped as their options say."""
    hints = typing.get_type_hints(RunConfig)
    groups: dict[str, Any] = {}
    for field, option in run_options():
        if not option.cli:
            continue
        if option.group not in groups:
            groups[option.group] = parser.add_argument_group(option.group)
        flag, kwargs = _run_argument(field, option, hints[field.name])
        groups[option.group].add_argument(flag, **kwargs)


def _option_keys() -> str:
    """The keys of grid files and ``--set``: every run option, wrapped for the epilog."""
    names = ", ".join(field.name for field, _ in run_options())
    return "\nrun options (keys of --set and of grid tables; see `gradzip train --help`):\n" + \
        textwrap.fill(names, width=90, initial_indent="  ", subsequent_indent="  ") + "\n"


def _cli_fields() -> list[str]:
    """The run options the command line sets (the others keep their defaults)."""
    return [field.name for field, option in run_options() if option.cli]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``gradzip`` command."""
    parser = OneLineParser(
        prog="gradzip", formatter_class=_FMT,
        description="Compressed-gradient data-parallel training: run, compare, inspect.",
        epilog="examples:\n  gradzip demo\n  gradzip list\n  gradzip train --help\n"
               "  gradzip compare digits-quick\n  gradzip plan --help\n  gradzip bench --help",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    parser.add_argument("--version", action="version", version=f"gradzip {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    demo = sub.add_parser("demo", help="train the embedded digits task with 6 methods, 3 seeds",
                          description="The main demo: no download, no flags.",
                          epilog=DEMO_EPILOG, formatter_class=_FMT)
    demo.add_argument("--out", default="gradzip-demo", help="output dir (default ./gradzip-demo)")
    demo.add_argument("--quiet", action="store_true", help="no progress output")
    demo.add_argument("--seeds", type=int, default=None, metavar="N",
                      help=f"seeds per method (default {DEFAULT_SEEDS}; the summary needs 2 or "
                           "more for a verdict)")
    demo.add_argument("--quick", action="store_true",
                      help=f"{QUICK_DEMO['epochs']} epoch on {QUICK_DEMO['limit_train']} training "
                           "images, one seed: a check that an install runs (seconds), not a "
                           "result")
    demo.add_argument("--epochs", type=int, default=None, help=argparse.SUPPRESS)
    demo.add_argument("--limit-train", type=int, default=None, help=argparse.SUPPRESS)
    train = sub.add_parser("train", help="one training run",
                           description="Train one run; writes DIR/metrics.jsonl and "
                                       "DIR/summary.json.",
                           epilog=TRAIN_EPILOG, formatter_class=_FMT)
    _add_run_options(train)
    train.add_argument("--resume", action="store_true",
                       help="continue the run in DIR from its last checkpoint (also to more "
                            "--epochs); without a checkpoint, start from the beginning")
    train.add_argument("--overwrite", action="store_true",
                       help="start over although DIR holds results of this configuration; "
                            "they are replaced only once the new run has finished")
    train.add_argument("--quiet", action="store_true", help="no progress bar")
    cmp = sub.add_parser("compare", help="run a grid of runs from a TOML file or preset",
                         description="Run a grid; print a table, write results.csv and "
                                     "compare.png.",
                         epilog=COMPARE_EPILOG + _option_keys(), formatter_class=_FMT)
    cmp.add_argument("config", metavar="CONFIG", help="grid file or preset name")
    cmp.add_argument("--out", default=None, help="output root (default: the file's `out`)")
    cmp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a run option for every run (repeatable)")
    cmp.add_argument("--force", action="store_true", help="re-run finished runs")
    cmp.add_argument("--tensorboard", action="store_true",
                     help="write OUT/tensorboard/<run>/ event files (one folder per run, so "
                          "`tensorboard --logdir OUT/tensorboard` overlays them)")
    cmp.add_argument("--quiet", action="store_true", help="no progress output")
    lst = sub.add_parser("list", help="compressors, tasks, models and presets",
                         description="List compressors (with parameters and defaults), tasks, "
                                     "models and compare presets.",
                         epilog=LIST_EPILOG, formatter_class=_FMT)
    lst.add_argument("--json", action="store_true", help="print JSON")
    plan_command.add_parser(sub)
    sub.add_parser("bench", help="communication benchmarks (gradzip bench --help)", add_help=False)
    return parser


def _version() -> str:
    from gradzip import __version__

    return __version__


def _progress(quiet: bool) -> bool:
    return not quiet and sys.stderr.isatty()


def _parse_override(text: str) -> tuple[str, Any]:
    from gradzip.spec import parse_value

    key, eq, value = text.partition("=")
    key = key.strip().replace("-", "_")
    if not eq or not key:
        raise ValueError(f"`--set` must be KEY=VALUE, got {text!r}")
    value = value.strip()
    return key, (None if value.lower() in ("none", "null") else parse_value(value))


# -- commands ---------------------------------------------------------------------------
def cmd_train(args: argparse.Namespace) -> int:
    from gradzip._cli_train import announce, result_lines
    from gradzip.train.runner import run

    cfg = RunConfig.from_dict({name: getattr(args, name) for name in _cli_fields()})
    summary = run(cfg, progress=_progress(args.quiet), resume=args.resume,
                  overwrite=args.overwrite, announce=announce)
    if summary is None:  # pragma: no cover - a torchrun rank other than 0 could return None
        return 0
    if os.environ.get("RANK", "0") != "0":
        return 0
    for line in result_lines(summary, cfg):
        print(line)
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from gradzip.train.compare import format_table, load_grid, run_grid

    overrides = dict(_parse_override(s) for s in args.overrides)
    grid = load_grid(args.config, overrides=overrides, out=args.out)
    quiet = args.quiet
    rows = run_grid(grid, force=args.force, progress=_progress(quiet),
                    stream=None if quiet else sys.stderr, tensorboard=args.tensorboard)
    print(f"{grid.name}: {len(rows)} runs")
    print(format_table(rows))
    files = rows[0]["_files"]
    print(f"csv: {files['csv']}")
    if files.get("tensorboard"):
        print(f"tensorboard: tensorboard --logdir {files['tensorboard']}")
    print(f"plot: {files['plot']}" if files["plot"] else "plot: (matplotlib not installed)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from gradzip.train.demo import run_demo

    overrides: dict[str, Any] = dict(QUICK_DEMO) if args.quick else {}
    seeds = overrides.pop("seeds", DEFAULT_SEEDS)
    if args.seeds is not None:
        seeds = args.seeds
    epochs = args.epochs or (int(os.environ["GRADZIP_DEMO_EPOCHS"])
                             if os.environ.get("GRADZIP_DEMO_EPOCHS") else None)
    if epochs is not None:
        overrides["epochs"] = epochs
    if args.limit_train is not None:
        overrides["limit_train"] = args.limit_train
    return run_demo(out=args.out, seeds=seeds, overrides=overrides,
                    progress=_progress(args.quiet), stream=None if args.quiet else sys.stderr)


def cmd_list(args: argparse.Namespace) -> int:
    from gradzip.spec import describe_compressors
    from gradzip.train.compare import list_presets
    from gradzip.train.models import available_models
    from gradzip.train.tasks import TASKS

    tasks = [
        {"name": t.name, "description": t.description, "metric": t.metric,
         "needs_data": t.needs_data, "models": list(t.models),
         "defaults": {**t.defaults.__dict__, "milestones": list(t.defaults.milestones)}}
        for t in TASKS.values()
    ]
    accordion = {
        "usage": "--compressor AGGRESSIVE --accordion GENTLE (same kind, or none); "
                 "--accordion-batch SMALL,LARGE for the batch-size variant",
        "options": {"eta": RunConfig.eta, "interval_epochs": "the task's default"},
        "example": "--compressor powersgd:rank=1 --accordion powersgd:rank=4",
    }
    info = {"compressors": describe_compressors(), "accordion": accordion, "tasks": tasks,
            "models": available_models(), "presets": list_presets()}
    if args.json:
        print(json.dumps(info, indent=2, default=str))
        return 0
    print("compressors (spec: name:key=value,...):")
    for c in info["compressors"]:
        params = ", ".join(f"{p['name']}={p['default']}" for p in c["parameters"]) or "-"
        print(f"  {c['name']:<10} {params}")
        print(f"  {'':<10} {c['description']}")
    print(f"\nAccordion (adaptive levels): {accordion['usage']}")
    print(f"  e.g. {accordion['example']} --eta 0.5 --interval-epochs 10")
    print("\ntasks:")
    for t in tasks:
        d = t["defaults"]
        print(f"  {t['name']:<8} {t['description']}")
        print(f"  {'':<8} model {d['model']}, {d['epochs']} epochs, batch {d['batch_size']}/worker,"
              f" lr {d['lr']}/worker, {t['metric']}")
    print("\nmodels: " + ", ".join(info["models"]))
    print("\ncompare presets:")
    for name, desc in info["presets"].items():
        print(f"  {name:<20} {desc}")
    return 0


def cmd_bench(argv: Sequence[str]) -> int:
    from gradzip import bench  # imported on demand: the benchmarks pull in more of torch

    return int(bench.main(list(argv)) or 0)


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return text or type(exc).__name__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``gradzip`` command; returns the exit status."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    debug = bool(os.environ.get("GRADZIP_DEBUG"))
    commands = [a for a in args_list if not a.startswith("-")]
    if commands and commands[0] == "bench":
        return cmd_bench(args_list[args_list.index("bench") + 1:])
    parser = build_parser()
    args = parser.parse_args(args_list)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s")
    handlers = {"train": cmd_train, "compare": cmd_compare, "demo": cmd_demo, "list": cmd_list,
                "plan": plan_command.run}
    try:
        return handlers[args.command](args)
    except (ValueError, TypeError) as exc:
        if debug:
            raise
        print(f"gradzip {args.command}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # stdout closed early (e.g. piped into `head`): nothing more to say.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1
    except (RuntimeError, TimeoutError, OSError) as exc:
        if debug:
            raise
        print(f"gradzip {args.command}: failed: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        hint = ""
        if args.command == "train" and os.environ.get("RANK", "0") == "0":
            from gradzip._cli_train import interrupted_hint

            hint = f"; {interrupted_hint(args_list, args.out, args.overwrite)}"
        print(f"gradzip {args.command}: interrupted{hint}", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
