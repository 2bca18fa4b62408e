from pathlib import Path

from vllm_fastload.docgen import render

ROOT = Path(__file__).resolve().parents[2]


def test_configuration_reference_is_in_sync():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == render(), "docs/configuration.md drifted: run `python -m vllm_fastload.docgen > docs/configuration.md`"


def test_readme_links_the_docs():
    readme = (ROOT / "README.md").read_text()
    for doc in ("docs/index.md", "docs/operations.md", "docs/troubleshooting.md", "docs/configuration.md",
                "docs/benchmarks.md", "docs/design.md"):
        assert doc in readme and (ROOT / doc).is_file()
