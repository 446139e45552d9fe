"""README.rst cannot include the scripts, so these tests hold it to them.

Every output line it shows must be one a script prints, every code excerpt must be in
a script, every option it uses must exist, and it must render without a warning.
"""

import ast
import io
import re
import subprocess
import sys
from pathlib import Path

import docutils.core
import pytest
from test_round_robin import TASKS

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ["new_task_initial.py", "new_task.py", "tasks_worker.py"]
READMES = sorted(ROOT.glob("README*.rst"))
PROMPT = re.compile(r"^\s*(?:shell\d+)?\$ ")


def literal_blocks(text: str) -> list[list[str]]:
    """The indented blocks that follow a line ending in '::'."""
    blocks: list[list[str]] = []
    lines = text.splitlines()
    for number, line in enumerate(lines):
        if not line.rstrip().endswith("::"):
            continue
        block: list[str] = []
        for following in lines[number + 1 :]:
            if following.strip() and not following.startswith((" ", "\t")):
                break
            block.append(following)
        blocks.append(_dedent(block))
    return blocks


def code_blocks(text: str) -> list[list[str]]:
    blocks = []
    for match in re.finditer(r"^\.\. code-block:: python\n\n((?:(?: .*)?\n)+)", text, re.M):
        blocks.append([line for line in match[1].splitlines() if line.strip()])
    return blocks


def _dedent(block: list[str]) -> list[str]:
    filled = [line for line in block if line.strip()]
    indent = min((len(line) - len(line.lstrip()) for line in filled), default=0)
    return [line[indent:] for line in filled]


def output_lines(readme: Path) -> list[str]:
    """Lines of the literal blocks that are script output: ' [x] ...', ' [*] ...', 'error: ...'."""
    found = []
    for block in literal_blocks(readme.read_text()):
        # The block was dedented to its prompt lines; output keeps its one leading space.
        for line in block:
            stripped = line.strip()
            if stripped.startswith(("[x]", "[*]", "[!]", "error:")):
                found.append(" " + stripped if stripped.startswith("[") else stripped)
    return found


def printed_templates() -> list[re.Pattern[str]]:
    """A regex for every string the scripts can print: f-string fields match any text."""
    templates = []
    for name in SCRIPTS:
        tree = ast.parse((ROOT / name).read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.JoinedStr):
                parts = [
                    re.escape(part.value) if isinstance(part, ast.Constant) else ".+?" for part in node.values
                ]
                templates.append(re.compile("".join(parts)))
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) > 8:
                templates.append(re.compile(re.escape(node.value)))
    return templates


def printable(line: str, templates: list[re.Pattern[str]]) -> bool:
    # A printed line is built from one or two of the scripts' strings: the
    # "error: " prefix and explain()'s text, or a whole print() argument.
    body = line.removeprefix("error: ")
    return any(template.fullmatch(line) or template.fullmatch(body) for template in templates)


@pytest.mark.parametrize("readme", READMES, ids=lambda path: path.name)
def test_every_output_line_in_the_readme_is_printed_by_a_script(readme):
    templates = printed_templates()
    lines = output_lines(readme)
    assert len(lines) >= 20, "the walk-through's transcripts went missing"
    unknown = [line for line in lines if not printable(line, templates)]
    assert unknown == []


def test_readme_round_robin_transcript_is_the_tutorials():
    lines = output_lines(ROOT / "README.rst")
    assert [line for line in lines if line.startswith(" [x] Sent")][:5] == [
        f" [x] Sent {task!r}" for task in TASKS
    ]
    received = [line for line in lines if line.startswith(" [x] Received")][:5]
    assert received == [f" [x] Received {task!r}" for task in TASKS[0::2] + TASKS[1::2]]


@pytest.mark.parametrize("readme", READMES, ids=lambda path: path.name)
def test_every_code_excerpt_in_the_readme_is_in_a_script(readme):
    sources = {name: [line.strip() for line in (ROOT / name).read_text().splitlines()] for name in SCRIPTS}
    blocks = code_blocks(readme.read_text())
    assert blocks, "the walk-through's code excerpts went missing"
    for block in blocks:
        wanted = [line.strip() for line in block]
        assert any(
            any(lines[start : start + len(wanted)] == wanted for start in range(len(lines)))
            for lines in sources.values()
        ), f"not in any script: {block}"


@pytest.mark.parametrize("readme", READMES, ids=lambda path: path.name)
def test_every_command_in_the_readme_uses_real_options(readme):
    helps = {
        name: subprocess.run(
            [sys.executable, str(ROOT / name), "--help"], capture_output=True, text=True, check=True
        ).stdout
        for name in SCRIPTS
    }
    commands = [
        PROMPT.sub("", line)
        for block in literal_blocks(readme.read_text())
        for line in block
        if PROMPT.match(line) and " python " in f" {PROMPT.sub('', line)}"
    ]
    assert len(commands) >= 10
    for command in commands:
        script = re.search(r"python (\S+\.py)", command)
        assert script, command
        assert script[1] in SCRIPTS, command
        for option in re.findall(r"(?<!\S)(--[a-z-]+)", command):
            assert option in helps[script[1]], f"{command}: {option} is not an option of {script[1]}"


@pytest.mark.parametrize("readme", READMES, ids=lambda path: path.name)
def test_readme_renders_without_warnings(readme):
    warnings = io.StringIO()
    docutils.core.publish_doctree(
        readme.read_text(),
        settings_overrides={"warning_stream": warnings, "report_level": 2, "halt_level": 5},
    )
    assert warnings.getvalue() == ""


def test_readme_test_command_is_what_ci_runs():
    readme = (ROOT / "README.rst").read_text()
    command = re.search(r"pip install -e '\.\[test\]' && (.+)", readme)
    assert command, "the quick start lost its test command"
    assert command[1].strip() in (ROOT / ".ci" / "run").read_text()
