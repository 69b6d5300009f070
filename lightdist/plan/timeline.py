"""``lightdist timeline DIR``: the pipeline schedule of the traces ``ProfileSteps`` wrote, drawn as one SVG timeline.

One row per rank, one box per stage's forward, backward or weight gradients of one microbatch, numbered by
microbatch; the gaps in a row are the time that rank waited on the others: the pipeline's bubble, which the rows'
busy shares put in numbers. Each rank's trace times its spans on the machine's clock, so ranks on one machine line up.
"""

from __future__ import annotations

import argparse
import json
import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Span", "draw_timeline", "main", "stage_spans"]

_NAME = re.compile(r"^stage (\d+) (forward|backward|weight gradients), microbatch (\d+)$")
_COLOURS = {"forward": "#4c78a8", "backward": "#59a14f", "weight gradients": "#f28e2b"}
_ROW, _LEFT, _WIDTH = 30, 70, 960


@dataclass(frozen=True)
class Span:
    """One stage's computation on one microbatch, in microseconds on the machine's clock."""

    stage: int
    kind: str
    microbatch: int
    start_us: float
    duration_us: float


def stage_spans(trace: Path) -> list[Span]:
    """The named stage spans of one rank's trace (a Chrome trace, as torch's profiler exports it), in time order."""
    events = json.loads(trace.read_text())["traceEvents"]
    spans = []
    for event in events:
        match = _NAME.match(event.get("name", ""))
        if match and event.get("ph") == "X":
            stage, kind, microbatch = int(match[1]), match[2], int(match[3])
            spans.append(Span(stage, kind, microbatch, float(event["ts"]), float(event["dur"])))
    return sorted(spans, key=lambda span: span.start_us)


def draw_timeline(spans_by_rank: dict[int, list[Span]]) -> str:
    """The SVG drawing of every rank's spans on one time axis."""
    spans = [span for rank_spans in spans_by_rank.values() for span in rank_spans]
    if not spans:
        raise ValueError(
            "The traces hold no pipeline stage spans ('stage N forward, microbatch M'): profile a run with "
            "pipeline_parallel_size > 1, on steps the run reaches."
        )
    start = min(span.start_us for span in spans)
    end = max(span.start_us + span.duration_us for span in spans)
    scale = _WIDTH / (end - start)
    height = _ROW * (len(spans_by_rank) + 2)
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{_LEFT + _WIDTH + 110}" height="{height}" '
        'font-family="sans-serif" font-size="11">',
        '<rect width="100%" height="100%" fill="white"/>',
    ]
    for row, (rank, rank_spans) in enumerate(sorted(spans_by_rank.items())):
        y = _ROW * row + 8
        busy = sum(span.duration_us for span in rank_spans) / (end - start)
        parts.append(f'<text x="4" y="{y + 15}">rank {rank}</text>')
        parts.append(f'<text x="{_LEFT + _WIDTH + 6}" y="{y + 15}">busy {busy:.0%}</text>')
        for span in rank_spans:
            x, width = _LEFT + (span.start_us - start) * scale, max(span.duration_us * scale, 0.5)
            parts.append(
                f'<rect x="{x:.1f}" y="{y}" width="{width:.1f}" height="22" fill="{_COLOURS[span.kind]}" '
                f'stroke="white" stroke-width="0.5"><title>stage {span.stage} {span.kind}, microbatch '
                f"{span.microbatch}: {span.duration_us / 1000:.2f} ms</title></rect>"
            )
            if width > 14:
                parts.append(
                    f'<text x="{x + width / 2:.1f}" y="{y + 15}" fill="white" text-anchor="middle">'
                    f"{span.microbatch}</text>"
                )
    axis_y = _ROW * len(spans_by_rank) + 18
    parts.append(f'<text x="{_LEFT}" y="{axis_y}">0 ms</text>')
    parts.append(f'<text x="{_LEFT + _WIDTH}" y="{axis_y}" text-anchor="end">{(end - start) / 1000:.1f} ms</text>')
    legend_x = _LEFT + 120
    for kind, colour in _COLOURS.items():
        parts.append(f'<rect x="{legend_x}" y="{axis_y - 10}" width="12" height="12" fill="{colour}"/>')
        parts.append(f'<text x="{legend_x + 16}" y="{axis_y}">{kind}</text>')
        legend_x += 130
    parts.append("</svg>")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="lightdist timeline",
        description="Draw the pipeline schedule of the traces lightdist.plugins.ProfileSteps wrote (rank*.json).",
    )
    parser.add_argument("traces", type=Path, help="the directory of the traces, ProfileSteps' dirpath")
    parser.add_argument("-o", "--output", type=Path, help="the SVG file to write; default: DIR/timeline.svg")
    args = parser.parse_args(argv)
    files = sorted(args.traces.glob("rank*.json"))
    if not files:
        parser.error(f"no rank*.json traces in {args.traces}: ProfileSteps(dirpath=...) writes them there")
    spans_by_rank = {int(file.stem.removeprefix("rank")): stage_spans(file) for file in files}
    output = args.output or args.traces / "timeline.svg"
    output.write_text(draw_timeline(spans_by_rank))
    print(f"lightdist: the schedule of {len(files)} ranks drawn in {output}")
