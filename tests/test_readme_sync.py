"""README.zh-CN.rst is README.rst in Chinese; these tests keep the two in step.

The prose is translated. What a reader types, what the scripts print, the code excerpts,
the option and file names, the links and the outline are not: they must be the same in
both, so a change made to one README and not to the other fails here. ``differences``
compares two texts aspect by aspect; the tests run it on the real files and on copies
with one change made to one side only, to show each aspect is really watched.
"""

import functools
import io
import re
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import docutils.core
import pytest
from docutils import nodes
from test_readme import PROMPT, ROOT, code_blocks, literal_blocks, output_lines

ENGLISH = ROOT / "README.rst"
CHINESE = ROOT / "README.zh-CN.rst"
FIGURE = re.compile(r"\d+(?:[.,]\d+)*")


def doctree(readme: Path) -> nodes.document:
    return _parsed(readme.read_text())


@functools.lru_cache(maxsize=128)
def _parsed(text: str) -> nodes.document:
    # Keyed by the text, so a mutated copy is parsed anew. Warnings are
    # test_readme.py's business; here only the parsed structure matters.
    return docutils.core.publish_doctree(
        text,
        settings_overrides={"warning_stream": io.StringIO(), "report_level": 5, "halt_level": 5},
    )


def commands(readme: Path) -> list[str]:
    """The lines of the literal blocks that a reader types: those with a '$ ' prompt."""
    return [line for block in literal_blocks(readme.read_text()) for line in block if PROMPT.match(line)]


def code_excerpts(readme: Path) -> list[list[str]]:
    return code_blocks(readme.read_text())


def literal_block_texts(readme: Path) -> list[str]:
    """Every literal block and code excerpt, whole and byte for byte, in order."""
    return [block.astext() for block in doctree(readme).findall(nodes.literal_block)]


def sections(tree: nodes.document) -> list[nodes.section]:
    return list(tree.findall(nodes.section))


def section_levels(readme: Path) -> list[int]:
    """The outline: the level of every section in order (1 for '====', 2 for '----' here)."""
    tree = doctree(readme)
    assert isinstance(tree[0], nodes.title), f"{readme.name} lost its title: its outline shifted"
    return [
        1 + sum(isinstance(node, nodes.section) for node in _ancestors(section)) for section in sections(tree)
    ]


def _ancestors(node: nodes.Node) -> list[nodes.Node]:
    found = []
    while node.parent is not None:
        node = node.parent
        found.append(node)
    return found


def sections_per_level(readme: Path) -> dict[int, int]:
    return dict(Counter(section_levels(readme)))


def inline_literals(readme: Path) -> Counter[str]:
    """Option names, file names, values: every ``inline literal``, with how often it occurs."""
    return Counter(literal.astext() for literal in doctree(readme).findall(nodes.literal))


def internal_links(readme: Path) -> list[int]:
    """Which section each internal link (`Queue type`_) points to, by the section's place in the outline."""
    tree = doctree(readme)
    place = {id_: number for number, section in enumerate(sections(tree)) for id_ in section["ids"]}
    return [
        place.get(reference["refid"], -1)
        for reference in tree.findall(nodes.reference)
        if reference.get("refid")
    ]


def external_links(readme: Path) -> list[str]:
    return sorted(
        {
            reference["refuri"]
            for reference in doctree(readme).findall(nodes.reference)
            if reference.get("refuri", "").startswith(("http://", "https://"))
        }
    )


def table_figures(readme: Path) -> list[list[list[str]]]:
    """The numbers in every table, cell by cell: the words are translated, the figures are not."""
    return [
        [
            [" ".join(FIGURE.findall(entry.astext())) for entry in row.findall(nodes.entry)]
            for row in table.findall(nodes.row)
        ]
        for table in doctree(readme).findall(nodes.table)
    ]


ASPECTS: dict[str, Callable[[Path], Any]] = {
    "commands": commands,
    "output lines": output_lines,
    "code excerpts": code_excerpts,
    "literal blocks": literal_block_texts,
    "section levels": section_levels,
    "sections per level": sections_per_level,
    "inline literals": inline_literals,
    "internal links": internal_links,
    "external links": external_links,
    "table figures": table_figures,
}
# No aspect may agree by being empty in both.
MAY_BE_EMPTY: set[str] = set()


def differences(english: Path, chinese: Path) -> list[str]:
    """The aspects in which two READMEs are out of step."""
    return [name for name, extract in ASPECTS.items() if extract(english) != extract(chinese)]


def top_link(readme: Path) -> str | None:
    """Where the first link of the first paragraph under the title points."""
    paragraph = doctree(readme).next_node(nodes.paragraph)
    reference = None if paragraph is None else paragraph.next_node(nodes.reference)
    return None if reference is None else reference.get("refuri")


@pytest.mark.parametrize("aspect", ASPECTS)
def test_the_readmes_are_in_step(aspect):
    english, chinese = ASPECTS[aspect](ENGLISH), ASPECTS[aspect](CHINESE)
    assert english or aspect in MAY_BE_EMPTY, f"README.rst has no {aspect}: the parsing broke"
    assert chinese == english


def test_the_readmes_link_to_each_other_at_the_top():
    assert top_link(ENGLISH) == CHINESE.name
    assert top_link(CHINESE) == ENGLISH.name


def test_the_chinese_readme_is_not_a_copy():
    text = CHINESE.read_text()
    assert len(re.findall(r"[\u4e00-\u9fff]", text)) > 2000
    assert "Round-robin dispatching" not in text


def _swap_first_two(pattern: str) -> Callable[[str], str]:
    def swap(text: str) -> str:
        first, second = list(re.finditer(pattern, text, re.M))[:2]
        return (
            text[: first.start()]
            + second[0]
            + text[first.end() : second.start()]
            + first[0]
            + text[second.end() :]
        )

    return swap


def _add(line: str) -> Callable[[str], str]:
    return lambda text: text + line


# One change each, made to one README only, and the aspect that must then differ.
MUTATIONS: dict[str, tuple[Callable[[str], str], str]] = {
    "an output line removed": (lambda text: text.replace("     [x] Done\n", "", 1), "output lines"),
    "two output lines swapped": (
        _swap_first_two(r"^ +\[x\] Sent '(First|Second) message\.+'$"),
        "output lines",
    ),
    "an output line reworded": (
        lambda text: text.replace("unfinished tasks returned to the queue: 1\n", "tasks requeued: 1\n"),
        "output lines",
    ),
    "a command changed": (
        lambda text: text.replace(
            "shell3$ python new_task.py Third", "shell3$ python new_task.py --stdin Third"
        ),
        "commands",
    ),
    "the rabbitmqctl command changed": (
        lambda text: text.replace("list_queues name messages_ready", "list_queues name"),
        "commands",
    ),
    "two commands swapped": (
        _swap_first_two(r"^ +shell3\$ python new_task\.py (First|Second) .*$"),
        "commands",
    ),
    "a code excerpt changed": (
        lambda text: text.replace("set_qos(prefetch_count=args.prefetch)", "set_qos(prefetch_count=1)"),
        "code excerpts",
    ),
    "a literal block reindented": (
        lambda text: text.replace("    Timeout: 60.0 seconds ...\n", "      Timeout: 60.0 seconds ...\n"),
        "literal blocks",
    ),
    "a section added": (_add("\nExtra\n=====\n\nText.\n"), "sections per level"),
    "a subsection added": (_add("\nExtra\n-----\n\nText.\n"), "section levels"),
    "a section demoted": (
        lambda text: re.sub(r"^(Docker Compose)\n=+$", r"\1\n--------------", text, flags=re.M),
        "section levels",
    ),
    "an option renamed": (
        lambda text: text.replace("``--grace-seconds``", "``--grace``", 1),
        "inline literals",
    ),
    "an option dropped": (
        lambda text: text.replace("``--fail-once-on``", "--fail-once-on", 1),
        "inline literals",
    ),
    "two internal links swapped": (_swap_first_two(r"`[^`<>]+`_(?!_)"), "internal links"),
    "an external link changed": (
        lambda text: text.replace(
            "https://aio-pika.readthedocs.io/", "https://aio-pika.readthedocs.io/en/latest/"
        ),
        "external links",
    ),
    "a table added": (
        _add("\n+------+-----+\n| a    | 1.5 |\n+------+-----+\n"),
        "table figures",
    ),
}


@pytest.fixture
def copies(tmp_path):
    english, chinese = tmp_path / ENGLISH.name, tmp_path / CHINESE.name
    english.write_text(ENGLISH.read_text())
    chinese.write_text(CHINESE.read_text())
    return english, chinese


def test_differences_finds_none_between_the_real_files(copies):
    assert differences(*copies) == []


@pytest.mark.parametrize("side", ["README.rst", "README.zh-CN.rst"])
@pytest.mark.parametrize("mutation", MUTATIONS)
def test_a_change_to_one_readme_only_is_caught(copies, mutation, side):
    change, aspect = MUTATIONS[mutation]
    readme = next(path for path in copies if path.name == side)
    before = readme.read_text()
    readme.write_text(change(before))
    assert readme.read_text() != before, f"{mutation}: the change no longer applies to {side}"
    assert aspect in differences(*copies)


@pytest.mark.parametrize(("readme", "other"), [(ENGLISH, CHINESE), (CHINESE, ENGLISH)], ids=["en", "zh-CN"])
def test_a_lost_or_moved_link_line_is_caught(tmp_path, readme, other):
    copy = tmp_path / readme.name
    text = readme.read_text()
    link = f"`{other.name} <{other.name}>`_"
    line = next(line for line in text.splitlines() if line.endswith(link))
    without = text.replace(f"{line}\n\n", "", 1)
    assert without != text
    copy.write_text(without)
    assert top_link(copy) != other.name
    copy.write_text(f"{without}\n{line}\n")
    assert top_link(copy) != other.name
