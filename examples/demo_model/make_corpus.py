"""Rebuild ``kjv_narrative.txt`` from the King James Bible in Debian's ``bible-kjv-text`` package.

    apt-get download bible-kjv bible-kjv-text
    for d in bible-kjv*.deb; do dpkg-deb -x "$d" kjv; done
    kjv/usr/bin/bible -f -p "$PWD/kjv/usr/lib" gen1:1-rev22:21 > kjv_all.txt
    python examples/demo_model/make_corpus.py kjv_all.txt

``bible -f`` prints one verse a line as ``Ge1:1 In the beginning ...``. The narrative books listed
in BOOKS are kept, the references dropped, one verse a line, a blank line between chapters.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

BOOKS = {"Ge", "Exo", "Josh", "Jdgs", "Ruth", "1Sm", "2Sm", "1Ki", "2Ki", "Mat", "Mark", "Luke", "John", "Acts"}
VERSE = re.compile(r"^(\d?[A-Za-z]+)(\d+):(\d+) (.*)$")


def narrative(lines: list[str]) -> str:
    """The verses of BOOKS, one a line, chapters separated by a blank line."""
    out: list[str] = []
    chapter = None
    for line in lines:
        book, number, _, text = VERSE.match(line).groups()  # type: ignore[union-attr]
        if book not in BOOKS:
            continue
        if (book, number) != chapter and out:
            out.append("")
        chapter = (book, number)
        out.append(text.strip())
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    source = Path(sys.argv[1]).read_text(encoding="ascii").splitlines()
    (Path(__file__).parent / "kjv_narrative.txt").write_text(narrative(source), encoding="utf-8")
