"""The user's pages speak to users: short enough to read, and no references a reader cannot place.

README.md, docs/*.md, CHANGELOG.md, bench/README.md and results/README.md name no numbered issue or session
("since issue 45", "session 19's cut") and no git commit hash ("fixed in 1de43b34"). Archive folder names
that carry an issue number (`results/tree_geneval_k8_issue45`) are real paths and stay, in backticks.
Pure file reading: no model, no project folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from conftest import REPO

README_MAX_LINES = 150
DOC_MAX_LINES = 400

# "issue 45", "Issue 45's", "sessions 13", "issue #46"
NUMBERED_REFERENCE = re.compile(r"\b(issues?|sessions?)\s+#?\d+", re.IGNORECASE)
# A standalone lowercase hex word, not part of a longer word, a path or a version (no word character, '/',
# '.' or '-' right before it; no word character or '-' right after it).
HEX_WORD = re.compile(r"(?<![\w/.-])[0-9a-f]{7,40}(?![\w-])")
# A hash of a file's bytes (md5, sha256, ...) is a fact a user can check: within this many characters after
# the word 'md5' or 'sha' (sha1, sha256, sha512) on the same line a hex word is not a commit.
DIGEST_CONTEXT = 40
DIGEST_WORD = re.compile(r"\b(md5|sha(1|256|512)?)\b", re.IGNORECASE)
# An inline code span that is a path (or an archive folder named after an issue) is left as it is.
CODE_SPAN = re.compile(r"`[^`\n]*`")


def user_pages() -> list[Path]:
    pages = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "CHANGELOG.md",
             REPO / "bench" / "README.md", REPO / "results" / "README.md"]
    return [page for page in pages if page.exists()]


def _without_path_spans(line: str) -> str:
    """The line with each backticked path (containing '/' or '_issue') blanked out, columns kept."""
    def blank(match: re.Match) -> str:
        span = match.group(0)
        return " " * len(span) if ("/" in span or "_issue" in span) else span
    return CODE_SPAN.sub(blank, line)


def _is_commit_like(word: str) -> bool:
    has_letter = any(c in "abcdef" for c in word)
    has_digit = any(c.isdigit() for c in word)
    return has_letter and has_digit and (7 <= len(word) <= 12 or len(word) == 40)


def offences(text: str) -> list[tuple[int, str, str]]:
    """(line number from 1, what, the words) for each numbered issue/session reference and commit hash."""
    found = []
    for number, raw in enumerate(text.splitlines(), start=1):
        line = _without_path_spans(raw)
        for match in NUMBERED_REFERENCE.finditer(line):
            found.append((number, "numbered issue/session reference", match.group(0)))
        for match in HEX_WORD.finditer(line):
            if not _is_commit_like(match.group(0)):
                continue
            if DIGEST_WORD.search(line[max(0, match.start() - DIGEST_CONTEXT):match.start()]):
                continue
            found.append((number, "commit hash", match.group(0)))
    return found


def test_the_checker_flags_issue_session_and_commit_references():
    assert offences("The default changed since issue 45.") == [
        (1, "numbered issue/session reference", "issue 45")]
    assert offences("ok\nfixed in commit 1de43b34") == [(2, "commit hash", "1de43b34")]
    assert [o[2] for o in offences("With Session 19's cut (issues #46) at ff96960d's code")] == [
        "Session 19", "issues #46", "ff96960d"]
    assert offences("a full hash " + "0123456789abcdef0123456789abcdef01234567") != []
    assert offences("the shape at 2c4cc55") == [(1, "commit hash", "2c4cc55")]  # 'shape' is no digest


def test_the_checker_passes_digests_paths_and_plain_numbers():
    assert offences("`credit.parquet` md5: 5656707f... and 064b57d9... (2 threads)") == []
    assert offences("sha256 0123abcd0123abcd, a sha of 765d5e67") == []
    assert offences("archive `results/tree_geneval_k8_issue45`, its section") == []
    assert offences("archive `tree_geneval_issue45`; sequence 1000004; 1.9e-3; the issues a user hits") == []
    assert offences("`states/c.0.0.0.0.0`, version 1.4.0, run 20260101") == []


@pytest.mark.parametrize("page", user_pages(), ids=lambda p: str(p.relative_to(REPO)))
def test_user_pages_name_no_issue_session_or_commit(page: Path):
    rel = page.relative_to(REPO)
    found = offences(page.read_text(encoding="utf-8"))
    assert not found, (
        f"{rel} speaks of work periods or commits a user cannot place; reword without the number:\n"
        + "\n".join(f"  {rel}:{number}: {what} {words!r}" for number, what, words in found))


def test_readme_and_docs_pages_stay_short():
    readme = REPO / "README.md"
    lines = len(readme.read_text(encoding="utf-8").splitlines())
    assert lines <= README_MAX_LINES, (
        f"README.md has {lines} lines (at most {README_MAX_LINES}): move detail to a page in docs/")
    too_long = []
    for page in sorted((REPO / "docs").glob("*.md")):
        count = len(page.read_text(encoding="utf-8").splitlines())
        if count > DOC_MAX_LINES:
            too_long.append(f"  {page.relative_to(REPO)}: {count} lines")
    assert not too_long, f"docs pages over {DOC_MAX_LINES} lines (split them):\n" + "\n".join(too_long)
