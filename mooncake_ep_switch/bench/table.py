"""The one table format every benchmark prints: rows with a ratio to an in-run baseline."""
import argparse
from typing import Callable, List, Optional, Sequence


def format_rows(rows: List[dict]) -> str:
    """Markdown table of benchmark rows (keys: benchmark, shape, ours_ms, baseline, baseline_ms,
    speedup = baseline / ours, and an optional note); a None time or ratio prints as "-".

    Arguments:
        rows: list of dict with those keys (times in milliseconds).

    Returns:
        table: str, header, separator and one line per row, joined by newlines (no trailing newline).
    """
    lines = ["| benchmark | shape | ours (ms) | baseline | baseline (ms) | ratio (baseline/ours) | note |",
             "| --- | --- | ---: | --- | ---: | ---: | --- |"]
    def number(value, form):
        return "-" if value is None else format(value, form)

    for row in rows:
        lines.append(f"| {row['benchmark']} | {row['shape']} | {number(row['ours_ms'], '.3f')} | {row['baseline']} | "
                     f"{number(row['baseline_ms'], '.3f')} | {number(row['speedup'], '.2f')}"
                     f"{'' if row['speedup'] is None else 'x'} | {row.get('note', '')} |")
    return "\n".join(lines)


def run_table_cli(prog: str, description: str, rows_of: Callable[[bool], List[dict]],
                  argv: Optional[Sequence[str]], format_table: Callable[[List[dict]], str] = format_rows) -> int:
    """The command line every table benchmark shares: `--quick`, `--out FILE`; prints the table.

    Arguments:
        prog: program name for the usage line.
        description: help text (the benchmark module's docstring).
        rows_of: callable taking `quick` (bool) and returning the rows for `format_table`.
        argv: the arguments (without the program name).
        format_table: turns the rows into the markdown table (default `format_rows`: times and ratios).

    Returns:
        status: int, 0.
    """
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer iterations")
    parser.add_argument("--out", default=None, help="also write the table (markdown) to this file")
    args = parser.parse_args(argv)
    import torch

    torch.set_num_threads(1)
    table = format_table(rows_of(args.quick))
    print(table)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(table + "\n")
    return 0
