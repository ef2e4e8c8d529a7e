"""The README's quickstart runs, and CI runs the README's test command."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _blocks(lang):
    return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def test_quickstart_runs(capsys):
    (quickstart,) = [b for b in _blocks("python") if "npattn.MultiHeadAttention" in b][:1]
    exec(compile(quickstart, "README quickstart", "exec"), {})
    assert capsys.readouterr().out.strip() == "(2, 5, 16) (2, 5, 5) (16, 16)"


def test_ci_runs_the_readme_test_command():
    section = README.split("## Running the tests", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", section, flags=re.S).group(1).strip()
    ci = (ROOT / ".ci" / "run").read_text()
    assert command in ci.splitlines(), f"{command!r} is not a line of .ci/run"
