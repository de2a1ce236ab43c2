"""Write one benchmark's section of docs/benchmarks.md, leaving the others alone.

Each benchmark owns the text between `<!-- begin:NAME -->` and `<!-- end:NAME -->`.
"""

from __future__ import annotations

import os
import platform
import re
import time
from pathlib import Path

DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
HEADER = """# Benchmarks

Every figure here was written by a script under `benchmarks/`, whose command is given with it.
The machines are shared and noisy (2 cores), so each result is a ratio measured side by side in
one run; absolute times are context, not results.
"""


def machine() -> str:
    return f"{platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def write_section(name: str, title: str, command: str, body: str) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    section = (
        f"<!-- begin:{name} -->\n## {title}\n\n"
        f"Reproduce: `{command}`  \nLast run: {stamp} on {machine()}.\n\n{body.strip()}\n<!-- end:{name} -->"
    )
    text = DOC.read_text() if DOC.exists() else HEADER
    pattern = re.compile(rf"<!-- begin:{re.escape(name)} -->.*?<!-- end:{re.escape(name)} -->", re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _m: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    DOC.parent.mkdir(exist_ok=True)
    DOC.write_text(text)


def table(headers: list[str], rows: list[list[object]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)
