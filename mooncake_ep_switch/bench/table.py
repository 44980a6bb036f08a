"""The one table format every benchmark prints: rows with a ratio to an in-run baseline."""
from typing import List


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
                     f"{number(row['baseline_ms'], '.3f')} | {number(row['speedup'], '.2f')}x | {row.get('note', '')} |")
    return "\n".join(lines)
