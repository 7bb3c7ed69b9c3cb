"""benchmarks/results/ stays small and documented: its README names every file there.

A name is a backticked token of benchmarks/results/README.md (before its History section, which
lists files already deleted): an exact name, or a pattern with `*`, `?` or brace alternatives
(`{json,txt}`), relative to benchmarks/results/ (`benchmark_set/plan_*.json`). The tests compare
those names against the files on disk.
"""

import fnmatch
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MAX_BYTES = 1 << 20
# A file's name, not `.txt` or `<stem>.json` in prose; `../../` may lead it out of results/.
FILE_NAME = re.compile(r"(\.\./)*[\w*?][\w./*?-]*\.(json|txt|md|png)")


def expand(token: str) -> list[str]:
    """`a{b,c}d{e,f}` -> abde, abdf, acde, acdf."""
    m = re.search(r"\{([^{}]*)\}", token)
    if m is None:
        return [token]
    return [x for alt in m.group(1).split(",")
            for x in expand(token[:m.start()] + alt + token[m.end():])]


def named_tokens() -> list[str]:
    text = (RESULTS / "README.md").read_text().split("\n## History\n")[0]
    return [t for t in re.findall(r"`([^`\n]+)`", text) if " " not in t]


def result_files() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*")
                  if p.is_file() and p != RESULTS / "README.md")


def matches(path: str, pattern: str) -> bool:
    # fnmatch's `*` crosses `/`; a pattern names files of its own folder only.
    return path.count("/") == pattern.count("/") and fnmatch.fnmatchcase(path, pattern)


def test_every_file_is_named_by_the_readme():
    patterns = [x for t in named_tokens() for x in expand(t)]
    unnamed = [f for f in result_files() if not any(matches(f, p) for p in patterns)]
    assert not unnamed, f"files README.md does not name: {unnamed}"


def test_no_file_is_over_1_mb():
    large = [f for f in result_files() if (RESULTS / f).stat().st_size > MAX_BYTES]
    assert not large, f"files over 1 MB (keep a summary instead): {large}"


def test_every_named_file_exists():
    files = result_files()
    missing = []
    for token in named_tokens():
        names = expand(token)
        if not any(FILE_NAME.fullmatch(n) for n in names):
            continue  # an option, a schedule or a script's name, not a results file
        if re.search(r"[*?{]", token):
            if not any(matches(f, n) for f in files for n in names):
                missing.append(token)  # a pattern matching nothing is a stale row
        elif not ((RESULTS / token).is_file() or (ROOT / token).is_file()):
            missing.append(token)
    assert not missing, f"README.md names files that do not exist: {missing}"
