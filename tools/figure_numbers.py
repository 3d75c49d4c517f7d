"""A Sphinx extension: the book numbers its figures per chapter ("Fig. 8.3"), not across the book.

Without a numbered table of contents Sphinx counts figures across all pages (chapter 8's third figure was
"Fig. 31"). Numbering the table of contents would number every heading too, and Jupyter Book 1 restarts
that numbering at each part. So this extension runs after Sphinx has numbered the figures and renumbers each
chapter's figures (and tables and listings with captions) 1, 2, 3 ... in page order, prefixed with the
chapter's number, taken from its file name (`book/08_chunk_kernel` -> 8). Pages without a chapter number
(the introduction, the appendices) keep Sphinx's numbers. `_config.yml` loads it as a local extension.
"""

import re

CHAPTER = re.compile(r"(?:^|/)(\d+)_[^/]*$")


def chapter_number(docname: str) -> int | None:
    """The chapter a page belongs to, from its name (`book/08_chunk_kernel` -> 8), or None."""
    match = CHAPTER.search(docname)
    return int(match.group(1)) if match else None


def renumber(app, env) -> list[str]:
    """Rewrite `env.toc_fignumbers` as (chapter, n), n counting each kind of numbered node in page order."""
    changed = []
    for docname, kinds in env.toc_fignumbers.items():
        chapter = chapter_number(docname)
        if chapter is None:
            continue
        for numbers in kinds.values():
            in_page_order = sorted(numbers, key=numbers.get)
            for n, node_id in enumerate(in_page_order, start=1):
                numbers[node_id] = (chapter, n)
        changed.append(docname)
    return changed


def setup(app):
    # After Sphinx's own numbering (the toctree collector listens at the default priority, 500).
    app.connect("env-get-updated", renumber, priority=900)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
