from pathlib import Path

from vllm_fastload.docgen import render

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_in_sync():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), \
        "docs/configuration.md drifted: run `python -m vllm_fastload.docgen > docs/configuration.md`"


def test_readme_links_the_docs():
    readme = (ROOT / "README.md").read_text()
    for doc in ("docs/index.md", "docs/operations.md", "docs/troubleshooting.md", "docs/configuration.md",
                "docs/benchmarks.md", "docs/design.md"):
        assert doc in readme and (ROOT / doc).is_file()


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    import re

    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(md: Path) -> set:
    import re

    seen: dict = {}
    out = set()
    fenced = False
    for line in md.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6} (.+)", line)
        if m:
            base = _slug(m.group(1))
            n = seen.get(base, 0)
            seen[base] = n + 1
            out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_markdown_links_to_repo_files_and_anchors_resolve():
    import re

    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.name}: {target} (no such heading)")
    assert not broken, broken
