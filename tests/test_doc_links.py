"""Every repository file the docs link to exists: the map of files in docs/architecture.md ("Where to find what")
and the other pages' links went stale when the tree was reorganised into rooms, and nothing noticed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
_LINK = re.compile(r"\]\(((?:\.\./)?[^)\s#]+)(?:#[^)]*)?\)")


def _repository_links(page: Path) -> list[str]:
    links = []
    for target in _LINK.findall(page.read_text()):
        if "://" in target or target.startswith("mailto:"):
            continue
        links.append(target)
    return links


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_linked_files_exist(page):
    missing = [t for t in _repository_links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_the_check_sees_a_stale_link(tmp_path):
    page = tmp_path / "docs" / "page.md"
    page.parent.mkdir()
    page.write_text("[`kv_pool.py`](../cloud_verifier/kv_pool.py) and [ok](page.md)")
    assert [t for t in _repository_links(page) if not (page.parent / t).exists()] == ["../cloud_verifier/kv_pool.py"]
