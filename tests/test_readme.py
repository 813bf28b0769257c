"""The README's two-minute tour runs as written, and so does every toy command
of the task pages in docs/ (those not marked long-running), in a fresh
directory holding only the configs, as a new user would run them."""

import os
import re
import shutil
import sys

import pytest
from conftest import ROOT, run_command

from mt.data.toy import TRANSLATION

DOC_PAGES = ("data.md", "training.md", "decoding.md", "attention.md")


def tour() -> list[str]:
    """The command lines of the README's tour (its first ```bash block)."""
    section = (ROOT / "README.md").read_text().split("## A two-minute tour", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, re.S)
    assert block, "the README's tour has no ```bash block"
    return [line for line in block.group(1).splitlines() if line.strip()]


def toy_commands() -> list[str]:
    """The commands of the task pages that run on the tour's toy model: indented code
    lines that start with `mt` or `echo`, mention the toy config or run, are not marked
    long-running and do not train (the tour trained runs/toy)."""
    commands = []
    for page in DOC_PAGES:
        for line in (ROOT / "docs" / page).read_text().splitlines():
            command = line.strip()
            if not line.startswith("    ") or not command.startswith(("mt ", "echo ")):
                continue
            toy = "runs/toy" in command or "configs/toy.yaml" in command
            if toy and "long-running" not in command and not command.startswith("mt train"):
                commands.append(command)
    return commands


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    where = tmp_path_factory.mktemp("newcomer")
    shutil.copytree(ROOT / "configs", where / "configs")
    return where


def shell(line: str, cwd) -> str:
    """Runs one documented command line with the environment's ``mt`` first on the PATH."""
    env = os.environ | {"PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    env.pop("MT_DATA_DIR", None)
    done = run_command(["bash", "-c", "set -euo pipefail; " + line], timeout=600, cwd=cwd, env=env)
    assert done.returncode == 0, f"{line}\n{done.stdout}\n{done.stderr}"
    return done.stdout + done.stderr


def test_the_tour_runs_as_written_and_shows_what_it_promises(workdir):
    lines = tour()
    assert [line.split()[0:2] for line in lines] == [
        ["mt", "prepare"], ["mt", "train"], ["echo", '"the'], ["mt", "evaluate"], ["mt", "attention"]
    ]  # fmt: skip
    out = [shell(line, workdir) for line in lines]
    assert "prepared src-tgt into data/prepared/toy.src-tgt" in out[0]
    assert "trained 600 steps" in out[1] and (workdir / "runs/toy/model.safetensors").is_file()
    sentence = re.search(r'echo "([^"]+)"', lines[2]).group(1)
    expected = " ".join(TRANSLATION[w] for w in reversed(sentence.split()))
    assert out[2].strip() == expected  # the model learned the words and the word order
    assert float(re.search(r"BLEU (\d+\.\d+)", out[3]).group(1)) > 80
    assert (workdir / "attention.png").read_bytes()[:4] == b"\x89PNG"
    readme = (ROOT / "README.md").read_text()
    assert expected in readme  # the README shows the translation this gives


def test_the_task_pages_toy_commands_run_as_written(workdir):
    if not (workdir / "runs/toy/model.safetensors").is_file():
        pytest.skip("needs the tour's model (test above)")
    commands = toy_commands()
    assert len(commands) >= 8  # the pages' toy examples were found
    for command in commands:
        shell(command, workdir)
    assert (workdir / "attention.html").is_file() and (workdir / "maps-cross.svg").is_file()
