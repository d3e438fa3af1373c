"""Every relative link of README.md and docs/*.md reaches a file of the checkout, and a link's
`#anchor` a heading of its page (GitHub's slugs), so a page moved, renamed or rewritten does not leave
dead links behind."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not `-` or `_`), spaces to `-`."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    found: set[str] = set()
    fenced = False
    for line in page.read_text(encoding="utf-8").splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            base = slug(m.group(1))
            name, n = base, 0
            while name in found:  # a repeated heading gets -1, -2, ...
                n += 1
                name = f"{base}-{n}"
            found.add(name)
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"^```.*?^```", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)  # not inside code blocks
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


def test_every_relative_link_of_the_readme_and_docs_resolves():
    assert len(PAGES) > 10
    dead = []
    for page in PAGES:
        for target in links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                dead.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in anchors(file):
                dead.append(f"{page.relative_to(ROOT)}: {target} (no such heading in {file.relative_to(ROOT)})")
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_the_slugs_are_githubs():
    assert slug("Long prompts: chunked prefill (`prefill_chunk_tokens`, `prefill_decode_steps`)") == (
        "long-prompts-chunked-prefill-prefill_chunk_tokens-prefill_decode_steps"
    )
    assert slug("The README's URL on the VM") == "the-readmes-url-on-the-vm"
    assert slug("Faults, and how the cluster heals") == "faults-and-how-the-cluster-heals"
