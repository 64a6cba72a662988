"""The docs agree with the code where a newcomer acts on them: the exit statuses."""

from __future__ import annotations

import re
from pathlib import Path

from fastft.protocol import exits

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_the_status_tables_are_protocol_exits():
    text = (ROOT / "docs" / "operating.md").read_text()
    rows = dict(re.findall(r"^\| (\d+) \| `(EXIT_\w+)` \|", text, re.MULTILINE))
    assert {int(k): v for k, v in rows.items()} == {
        getattr(exits, name): name
        for name in exits.__all__
        if name.startswith("EXIT_") and getattr(exits, name) in exits.FASTFT_STATUSES
    }
    job = dict(re.findall(r"^\| (\d+) \| (?!`)(.+?) \|$", text, re.MULTILINE))
    assert "failed" in job[str(exits.JOB_FAILED)]
    assert "Ctrl-C" in job[str(exits.JOB_INTERRUPTED)]
    assert "SIGTERM" in job[str(exits.JOB_PREEMPTED)]


def test_no_doc_says_a_sigterm_ends_the_job_with_0():
    """`fastft run` exits 143 after a SIGTERM (the docs said 0 in two places)."""
    wrong = [
        f"{p.name}: {m.group(0)}"
        for p in DOCS
        for m in re.finditer(r"SIGTERM[^.|]*?\bexits? (?:with )?0\b", p.read_text())
    ]
    assert wrong == []


def test_the_readme_fits_a_first_read_and_its_links_resolve():
    """At most 300 lines (issue 53: it was 377); every relative link names a file."""
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    links = re.findall(r"\]\(((?!https?:)[^)#]+)(?:#[^)]*)?\)", text)
    assert links and [p for p in links if not (ROOT / p).exists()] == []
    named = re.findall(r"\b(docs/\w+\.md)\b", text)
    assert [p for p in named if not (ROOT / p).exists()] == []


def _anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_docs_index_links_resolve_to_files_and_their_sections():
    """docs/README.md (find it by task) and measurements.md's contents by topic name files
    and sections that exist."""
    bad, seen = [], 0
    for page in ("README.md", "measurements.md"):
        text = (ROOT / "docs" / page).read_text()
        for path, anchor in re.findall(r"\]\(((?!https?:)[^)#]*)(?:#([^)]*))?\)", text):
            seen += 1
            target = (ROOT / "docs" / (path or page)).resolve()
            if not target.exists():
                bad.append(f"{page}: {path}")
            elif anchor:
                heads = re.findall(r"^#+ (.+)$", target.read_text(), re.MULTILINE)
                if anchor not in {_anchor(h) for h in heads}:
                    bad.append(f"{page}: {path}#{anchor}")
    assert seen >= 40 and bad == []


def test_the_flags_reference_is_the_codes():
    """docs/flags.md lists every flag as the code defines it: run `make flags-doc`."""
    from fastft.cli.flagdoc import render
    from fastft.launch.settings.flags import flag_rows

    text = (ROOT / "docs" / "flags.md").read_text()
    assert text == render(), "run: make flags-doc"
    assert "`--placement` | strict" in text and len(flag_rows()) >= 50
