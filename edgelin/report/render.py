"""The report's text: one list of blocks rendered twice, as Markdown (images beside it) and as one
self-contained HTML page (images inlined as base64). Every string is plain text, never markup: HTML
escapes all of it; Markdown escapes what could start markup in edgelin's own words, and every character
Markdown or HTML gives a meaning to in text from a results file (a `User` piece): a device named
`<img onerror=...>` or `[x](javascript:...)` reads as itself."""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass
from pathlib import Path

from edgelin.output import escape_controls


@dataclass(frozen=True)
class User:
    """Text from a results file (a device name, a label, a command)."""

    text: str


# A block's text: edgelin's own words (str), or pieces of them and of results files' text.
Text = str | User | tuple[str | User, ...]
# Backslash-escaped in Markdown: in edgelin's words, what could open inline markup (or end a table cell);
# in a file's text, every ASCII punctuation mark CommonMark or GitHub's Markdown gives a meaning to.
_MD_OWN = re.compile(r"([\\`*_\[\]|~])")
_MD_USER = re.compile(r"([\\`*_{}\[\]()#+\-.!|~:$])")


def plain(text: Text) -> str:
    """The text as it reads."""
    pieces = text if isinstance(text, tuple) else (text,)
    return "".join(p.text if isinstance(p, User) else p for p in pieces)


def _md(text: Text) -> str:
    pieces = text if isinstance(text, tuple) else (text,)
    out = []
    for piece in pieces:
        user = isinstance(piece, User)
        flat = escape_controls(piece.text if user else piece)  # a newline would end a table row or heading
        out.append(html.escape((_MD_USER if user else _MD_OWN).sub(r"\\\1", flat), quote=user))
    return "".join(out)


def _html(text: Text) -> str:
    return html.escape(escape_controls(plain(text)))


@dataclass(frozen=True)
class Heading:
    text: Text
    level: int = 2


@dataclass(frozen=True)
class Paragraph:
    text: Text
    note: bool = False  # a call-out (mixed artifacts): a blockquote


@dataclass(frozen=True)
class Table:
    columns: tuple[str, ...]
    rows: tuple[tuple[Text, ...], ...]


@dataclass(frozen=True)
class Image:
    file: str  # edgelin's own name: letters, digits, '-' and '.png'
    alt: str

    def __post_init__(self) -> None:
        assert re.fullmatch(r"[a-z0-9-]+\.png", self.file), self.file


Block = Heading | Paragraph | Table | Image


def markdown(blocks: list[Block]) -> str:
    lines: list[str] = []
    for block in blocks:
        if isinstance(block, Heading):
            lines += ["#" * block.level + " " + _md(block.text), ""]
        elif isinstance(block, Paragraph):
            lines += [("> " if block.note else "") + _md(block.text), ""]
        elif isinstance(block, Table):
            lines.append("| " + " | ".join(_md(c) for c in block.columns) + " |")
            lines.append("|" + "|".join(" --- " for _ in block.columns) + "|")
            lines += ["| " + " | ".join(_md(c) for c in row) + " |" for row in block.rows]
            lines.append("")
        else:
            lines += [f"![{_md(block.alt)}]({block.file})", ""]
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
            parts.append(f"<h{block.level}>{_html(block.text)}</h{block.level}>")
        elif isinstance(block, Paragraph):
            text = f"<p>{_html(block.text)}</p>"
            parts.append(f"<blockquote>{text}</blockquote>" if block.note else text)
        elif isinstance(block, Table):
            head = "".join(f"<th>{_html(c)}</th>" for c in block.columns)
            body = "".join("<tr>" + "".join(f"<td>{_html(c)}</td>" for c in row) + "</tr>"
                           for row in block.rows)
            parts.append(f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>")
        else:
            data = base64.b64encode((folder / block.file).read_bytes()).decode("ascii")
            parts.append(f'<img src="data:image/png;base64,{data}" alt="{_html(block.alt)}">')
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"
