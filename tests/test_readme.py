"""README.md and the pages of docs/: every Python block runs as written, and every link leads somewhere.

Each page's blocks read as one session, in order: a block may use what an
earlier block of the same page defined (``model``, ``AdamOptimizer``, ...);
each page starts its own session, so its first block makes its own imports. A
block that starts a job from torchrun's environment (``init_rpc_from_env``) is
a program of its own and runs under ``torch.distributed.run`` with three
processes on 127.0.0.1. The recipes for Lightning and Hugging Face's Trainer
run inside those trainers, in tests/amp/test_loss_scale_trainers.py.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from _deadlines import scaled
from _procs import torchrun
from _readme import DOCS, README, ROOT, all_python_blocks, is_trainer_recipe, page_name, pages, python_blocks

TORCHRUN_DEADLINE_S = 120
SESSION_DEADLINE_S = 300
README_MAX_BYTES = 15 * 1024

# The fewest Python blocks each page holds, so that a block lost in an edit (a fence
# mistyped as ```py, say) fails here instead of silently running nothing.
MIN_BLOCKS = {
    "README.md": 2,
    "docs/optim.md": 1,
    "docs/torch-tools.md": 1,
    "docs/amp.md": 4,
    "docs/agn.md": 2,
    "docs/checkpoint.md": 1,
    "docs/gradients.md": 1,
}


def _is_program(source: str) -> bool:
    return "init_rpc_from_env()" in source


def _session(page: Path) -> list[tuple[int, str]]:
    return [(line, s) for line, s in python_blocks(page) if not (_is_program(s) or is_trainer_recipe(s))]


def test_pages_have_their_python_blocks():
    counts = {page_name(page): len(python_blocks(page)) for page in pages()}
    short = {name: counts.get(name, 0) for name, least in MIN_BLOCKS.items() if counts.get(name, 0) < least}
    assert not short, f"pages with fewer Python blocks than {MIN_BLOCKS}: {short}"
    blocks = all_python_blocks()
    assert [name for name, _, s in blocks if _is_program(s)] == ["docs/agn.md"]
    # Lightning's plugin and manual optimization, Hugging Face's Trainer.
    assert [name for name, _, s in blocks if is_trainer_recipe(s)] == ["docs/amp.md"] * 3


def test_session_blocks_run_in_order(tmp_path):
    """Each page's blocks run one after another in a namespace of the page's own, as a reader would.

    One interpreter runs every page (importing torch once), each page in a fresh namespace and a
    fresh working directory, so a page that relies on another page's names or files fails."""
    sessions = [(page_name(page), _session(page)) for page in pages()]
    sessions = [(name, blocks) for name, blocks in sessions if blocks]
    driver = tmp_path / "sessions.py"
    driver.write_text(
        "import os, sys\n"
        f"sessions = {sessions!r}\n"
        "for number, (name, blocks) in enumerate(sessions):\n"
        "    os.makedirs(f'page{number}')\n"
        "    os.chdir(f'page{number}')\n"
        "    namespace = {'__name__': '__main__'}\n"
        "    for line, source in blocks:\n"
        "        try:\n"
        "            exec(compile(source, f'{name}:{line}', 'exec'), namespace)\n"
        "        except BaseException:\n"
        "            print(f'{name} block at line {line} failed', file=sys.stderr)\n"
        "            raise\n"
        "    os.chdir('..')\n"
    )
    result = subprocess.run(
        [sys.executable, str(driver)],
        capture_output=True,
        text=True,
        timeout=scaled(SESSION_DEADLINE_S),
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr[-4000:]


@pytest.mark.parametrize(
    ("name", "line"), [(name, line) for name, line, source in all_python_blocks() if _is_program(source)]
)
def test_torchrun_block_runs_under_torchrun(tmp_path, name, line):
    source = dict(python_blocks(ROOT / name))[line]
    program = tmp_path / "docs_job.py"
    program.write_text(source)
    returncode, output = torchrun([str(program)], nproc=3, deadline_s=TORCHRUN_DEADLINE_S, cwd=tmp_path)
    assert returncode == 0, f"{name} block at line {line}:\n{output[-4000:]}"


def test_readme_is_a_front_door():
    size = README.stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes, over {README_MAX_BYTES}: move it to docs/"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors for the page's headings: lowercased, punctuation dropped, spaces as hyphens."""
    anchors: set[str] = set()
    text = re.sub(r"^```.*?^```$", "", page.read_text(), flags=re.M | re.S)
    for heading in re.findall(r"^#+ +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        anchor, n = slug, 0
        while anchor in anchors:
            n += 1
            anchor = f"{slug}-{n}"
        anchors.add(anchor)
    return anchors


def _relative_links(page: Path) -> list[str]:
    """Link targets in the page's prose (not in code), other than web addresses."""
    text = re.sub(r"^ *```.*?^ *```$", "", page.read_text(), flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    targets = re.findall(r"\]\(([^)\s]+)\)", text)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


@pytest.mark.parametrize("name", [page_name(page) for page in pages()])
def test_relative_links_lead_to_a_file_and_anchor(name):
    page = ROOT / name
    broken = []
    for target in _relative_links(page):
        path, _, anchor = target.partition("#")
        linked = (page.parent / path).resolve() if path else page
        if not linked.is_file():
            broken.append(f"{target}: no file {linked}")
        elif anchor and anchor not in _anchors(linked):
            broken.append(f"{target}: no heading with anchor #{anchor} in {page_name(linked)}")
    assert not broken, f"{name}: " + "; ".join(broken)


def test_readme_links_every_docs_page_through_the_index():
    index = DOCS / "index.md"
    assert "docs/index.md" in _relative_links(README)
    listed = {(DOCS / target.partition("#")[0]).resolve() for target in _relative_links(index)}
    unlisted = [page_name(page) for page in sorted(DOCS.glob("*.md")) if page != index and page not in listed]
    assert not unlisted, f"docs/index.md does not list {unlisted}"
