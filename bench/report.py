"""What every benchmark does at its end: print the table, write the JSON, and the Markdown page if asked."""

import json
import statistics
from pathlib import Path


def write_json(results: dict, json_path: str | Path) -> None:
    Path(json_path).parent.mkdir(parents=True, exist_ok=True)
    Path(json_path).write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {json_path}")


def ms_table(title: str, cells: dict[str, list[float]]) -> str:
    """A Markdown table of timings (seconds in, milliseconds out): each cell's median and maximum."""
    lines = [f"| {title} | ms p50 | ms max |", "|---|---:|---:|"]
    lines += [f"| {name} | {1000 * statistics.median(times):.2f} | {1000 * max(times):.2f} |" for name, times in cells.items()]
    return "\n".join(lines)


def publish(results: dict, text: str, json_path: str, markdown_path: str | None, page: tuple[str, str] = ("", "")) -> None:
    """`page`: the Markdown page's head and tail around the table."""
    print(text)
    write_json(results, json_path)
    if markdown_path:
        Path(markdown_path).write_text(page[0] + text + page[1])
        print(f"wrote {markdown_path}")
