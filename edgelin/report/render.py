"""The report's text: one list of blocks rendered twice, as Markdown (images beside it) and as one
self-contained HTML page (images inlined as base64). Every string is user-visible plain text: it is
escaped for HTML and for Markdown table cells, never interpreted."""

from __future__ import annotations

import base64
import html
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Paragraph:
    text: str
    note: bool = False  # a call-out (mixed artifacts): a blockquote


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


@dataclass(frozen=True)
class Image:
    file: str
    alt: str


Block = Heading | Paragraph | Table | Image


def _md_cell(text: str) -> str:
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\n", " ")


def markdown(blocks: list[Block]) -> str:
    lines: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            lines += ["#" * block.level + " " + block.text, ""]
        elif isinstance(block, Paragraph):
            lines += [("> " if block.note else "") + block.text, ""]
        elif isinstance(block, Table):
            lines.append("| " + " | ".join(_md_cell(c) for c in block.columns) + " |")
            lines.append("|" + "|".join(" --- " for _ in block.columns) + "|")
            lines += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
            lines.append("")
        else:
            lines += [f"![{block.alt}]({block.file})", ""]
    return "\n".join(lines)


STYLE = """body{font-family:system-ui,-apple-system,Segoe UI,sans-serif;max-width:1100px;margin:2em auto;padding:0 1em;
color:#222;line-height:1.45}table{border-collapse:collapse;margin:.6em 0 1.4em;font-size:.9em}
th,td{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top}th{background:#f2f2f2}
img{max-width:100%;border:1px solid #eee;margin:.4em 0 1.2em}blockquote{border-left:4px solid #e0a000;
margin:1em 0;padding:.4em 1em;background:#fff8e5}code{font-size:.95em}"""


def page(blocks: list[Block], folder: Path, title: str) -> str:
    """The HTML page; `folder` holds the PNGs, read and inlined here."""
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             f"<title>{html.escape(title)}</title><style>{STYLE}</style></head><body>"]
    for block in blocks:
        if isinstance(block, Heading):
            parts.append(f"<h{block.level}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            text = f"<p>{html.escape(block.text)}</p>"
            parts.append(f"<blockquote>{text}</blockquote>" if block.note else text)
        elif isinstance(block, Table):
            head = "".join(f"<th>{html.escape(c)}</th>" for c in block.columns)
            body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>"
                           for row in block.rows)
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            data = base64.b64encode((folder / block.file).read_bytes()).decode("ascii")
            parts.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(block.alt)}">')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
