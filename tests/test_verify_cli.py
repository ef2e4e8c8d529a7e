"""The ``npattn verify`` command: exit status, JSON, picture, reproducers, usage errors."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys

import pytest

import npattn
from npattn.tools import cli
from npattn.tools import verify as V

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project: docs, examples
# the folder holding the npattn under test (the project, or site-packages when installed),
# put on a child process's path so that it imports the same npattn (CI's second stage sets
# PYTHONSAFEPATH, so that a child's current folder, the checkout, does not come before it)
IMPORT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(npattn.__file__)))
KERNELS = os.path.join(ROOT, "examples", "verify", "kernels.py")
GOOD = [f"{KERNELS}:attention", "--backward", "attention_backward", "--returns-lse"]


def test_correct_kernel_exits_0_with_json_and_plot(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    status = cli.main(["verify", *GOOD, "--supports", "all", "--dtype", "float16",
                       "--json", str(js), "--plot", str(png), "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "passed: 47/47 cases pass" in out and "worst err" in out and "FAIL" not in out
    data = json.loads(js.read_text())
    assert data["ok"] and data["n_cases"] == 47 and data["config"]["dtype"] == "float16"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # a path without .png: the PNG is written there, the path the command prints (matplotlib
    # appended .png to it)
    bare = tmp_path / "picture"
    assert cli.main(["verify", *GOOD, "--supports", "causal", "--combos", "none", "--plot",
                     str(bare), "--no-progress"]) == 0
    assert bare.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not (tmp_path / "picture.png").exists()
    assert f"plot: {bare}" in capsys.readouterr().err


def test_mutant_exits_1_and_its_reproducer_reruns_the_case(capsys):
    target = f"{KERNELS}:bug_window_off_by_one"
    status = cli.main(["verify", target, "--backward", "attention_backward", "--returns-lse",
                       "--supports", "window,causal", "--dtype", "float64", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 1
    reruns = [line.split("rerun: ", 1)[1] for line in out.splitlines() if "rerun: " in line]
    assert reruns and all("--case" in r for r in reruns)
    assert not any("--budget-factor" in r or "--combos" in r for r in reruns), reruns[0]
    argv = shlex.split(reruns[0])
    assert argv[:2] == ["npattn", "verify"]
    assert cli.main(argv[1:] + ["--no-progress"]) == 1
    again = capsys.readouterr().out
    case = argv[argv.index("--case") + 1]
    assert "0/1 cases pass" in again and case in again and "window" in case


def test_mask_grad_and_lse_grad_flags_reach_the_check_and_the_reproducer(capsys):
    flags = ["--supports", "mask_float,sinks", "--combos", "none", "--dtype", "float64",
             "--mask-grad", "--lse-grad", "--no-progress", "--json", "-"]
    assert cli.main(["verify", *GOOD, *flags]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["config"]["mask_grad"] is True and data["config"]["lse_grad"] is True
    assert all("dmask" in c["tensors"] for c in data["cases"] if "mask_float" in c["options"])
    target = f"{KERNELS}:bug_dlse_ignored"
    argv = ["verify", target, "--backward", "attention_backward", "--returns-lse", *flags[:-2]]
    assert cli.main(argv) == 1
    out = capsys.readouterr().out
    rerun = next(line.split("rerun: ", 1)[1] for line in out.splitlines() if "rerun: " in line)
    assert "--mask-grad --lse-grad" in rerun and "+ dlse" in out
    assert cli.main(shlex.split(rerun)[1:] + ["--no-progress"]) == 1
    # without --lse-grad the mistake cannot be seen
    assert cli.main([a for a in argv if a != "--lse-grad"]) == 0
    capsys.readouterr()
    assert V.main([f"{KERNELS}:attention", "--lse-grad"]) == 2  # no --returns-lse, no backward
    assert "--lse-grad: passes dlse to the gradients" in capsys.readouterr().err


def test_json_to_stdout_and_list(capsys):
    assert cli.main(["verify", *GOOD, "--supports", "gqa", "--json", "-", "--no-progress",
                     "--case", "gqa-65x129"]) == 0
    captured = capsys.readouterr()
    data = json.loads(captured.out)
    assert [c["name"] for c in data["cases"]] == ["gqa-65x129"]
    assert "worst err" in captured.err
    assert cli.main(["verify", *GOOD, "--supports", "gqa,causal", "--list"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("causal+gqa-") for line in listed) and len(listed) > 10


def test_json_to_a_file_is_the_report_ending_with_a_newline(tmp_path, capsys):
    """--json PATH writes the report's JSON there as a text file: one newline at its end."""
    js = tmp_path / "r.json"
    assert cli.main(["verify", *GOOD, "--supports", "gqa", "--json", str(js), "--no-progress",
                     "--case", "gqa-65x129"]) == 0
    text = js.read_text()
    assert text.endswith("}\n") and not text.endswith("\n\n"), text[-20:]
    data = json.loads(text)
    assert data["ok"] and [c["name"] for c in data["cases"]] == ["gqa-65x129"]
    assert "worst err" in capsys.readouterr().out


def test_module_target(tmp_path, monkeypatch, capsys):
    (tmp_path / "my_kernels.py").write_text(
        "from npattn import functional as F\n"
        "def attn(q, k, v, **kw):\n"
        "    return F.sdpa_forward(q, k, v, **kw)[0]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cli.main(["verify", "my_kernels:attn", "--dtype", "float64", "--supports", "causal",
                     "--combos", "none", "--no-progress"]) == 0
    assert "(no gradients" in capsys.readouterr().out


def test_a_backward_from_a_file_of_the_same_name_is_that_files(tmp_path, capsys):
    """--backward from another file named kernels.py: that file's function runs (the first file's
    module was reused by name, and a backward that raises passed)."""
    (tmp_path / "kernels.py").write_text("def attention_backward(dout, saved, dlse=None):\n"
                                         "    raise RuntimeError('the other file')\n")
    argv = ["verify", f"{KERNELS}:attention", "--returns-lse", "--supports", "causal", "--combos",
            "none", "--dtype", "float64", "--no-progress",
            "--backward", f"{tmp_path / 'kernels.py'}:attention_backward"]
    assert cli.main(argv) == 1
    assert "RuntimeError: the other file" in capsys.readouterr().out


def test_the_json_config_names_callables_as_the_user_gave_them(tmp_path, monkeypatch):
    """config.backward of a file target was the name the file is loaded under
    (npattn_verify_target_kernels_<hash>:attention_backward), and the adapter was not reported."""
    (tmp_path / "adapters.py").write_text("def same(options):\n    return dict(options)\n")
    monkeypatch.chdir(ROOT)
    target = os.path.join("examples", "verify", "kernels.py") + ":attention"
    common = ["verify", target, "--backward", "attention_backward", "--returns-lse",
              "--supports", "causal", "--combos", "none", "--dtype", "float64", "--no-progress"]
    js = tmp_path / "r.json"
    assert cli.main([*common, "--adapter", f"{tmp_path / 'adapters.py'}:same",
                     "--json", str(js)]) == 0
    config = json.loads(js.read_text())["config"]
    assert config["target"] == target
    assert config["backward"] == os.path.join("examples", "verify", "kernels.py") + ":attention_backward"
    assert config["adapter"] == f"{tmp_path / 'adapters.py'}:same"
    # a JSON mapping is reported as the mapping; no adapter as null
    assert cli.main([*common, "--adapter", '{"is_causal": "is_causal"}', "--json", str(js)]) == 0
    assert json.loads(js.read_text())["config"]["adapter"] == {"is_causal": "is_causal"}
    assert cli.main([*common, "--json", str(js)]) == 0
    assert json.loads(js.read_text())["config"]["adapter"] is None


@pytest.mark.parametrize("argv, message", [
    ([f"{KERNELS}:nope"], f"target: {KERNELS!r} has no attribute 'nope'"),
    ([f"{KERNELS}:attention", "--backward", "nope"], f"--backward: {KERNELS!r} has no"),
    (["no_such_module_xyz:attn"], "cannot import 'no_such_module_xyz'"),
    (["attention"], "expected module:attribute"),
    ([f"{KERNELS}:attention", "--supports", "causal,sliding"], "--supports"),
    # a repeated entry was taken silently
    ([f"{KERNELS}:attention", "--supports", "causal,window, causal"],
     "--supports: expected each entry once, got 'causal' more than once"),
    ([f"{KERNELS}:attention", "--head-dims", "64,32,64"],
     "--head-dims: expected each entry once, got 64 more than once"),
    ([f"{KERNELS}:attention", "--case", "nope"], "--case: expected a case name"),  # the flag, not the keyword
    ([f"{KERNELS}:attention", "--budget-factor", "-1"], "--budget-factor: expected a finite number >= 1"),
    ([f"{KERNELS}:attention", "--head-dims", "0"], "--head-dims: expected ints from 1 to"),
    ([f"{KERNELS}:attention", "--supports", "dv_ne_dk", "--head-dims", "64"],
     "--head-dims: expected two widths or more with --supports dv_ne_dk"),
    ([f"{KERNELS}:attention", "--backend", "torch", "--autograd", "jax"],
     "--autograd: needs --backend jax, got --backend torch"),
    ([f"{KERNELS}:attention", "--adapter", "{not json"], "--adapter: expected a JSON mapping"),
    # a JSON list was looked up as a name in the target's module ("has no attribute '[1]'")
    ([f"{KERNELS}:attention", "--adapter", '["mask"]'],
     "--adapter: expected a JSON mapping, got a JSON list: '[\"mask\"]'"),
    ([f"{KERNELS}:attention", "--seed", "-1"], "--seed: expected an int >= 0, got -1"),
    # --list checks the flags as a run does (a seed or budget factor it took would not run)
    ([f"{KERNELS}:attention", "--seed", "-1", "--list"], "--seed: expected an int >= 0, got -1"),
    ([f"{KERNELS}:attention", "--budget-factor", "0.5", "--list"],
     "--budget-factor: expected a finite number >= 1, got '0.5'"),
    # output paths are checked before the panel runs (not after it, in a traceback)
    ([f"{KERNELS}:attention", "--json", "/nonexistent-npattn/x.json"], "--json: the directory"),
    ([f"{KERNELS}:attention", "--json", "."], "--json: expected a file path, got the directory"),
    ([f"{KERNELS}:attention", "--plot", "/nonexistent-npattn/x.png"], "--plot: the directory"),
    ([f"{KERNELS}:attention", "--plot", "-"], "--plot: expected a file path, got '-'"),
    # one path for two outputs: the PNG overwrote the JSON
    ([f"{KERNELS}:attention", "--json", "same.out", "--plot", "same.out"],
     "--json and --plot: expected two different outputs, got 'same.out' for both"),
    # a head width whose float64 truth does not fit (a MemoryError traceback)
    ([f"{KERNELS}:attention", "--head-dims", "100000000"], "--head-dims: expected ints from 1 to"),
])
def test_usage_errors_exit_2(argv, message, capsys):
    if "--plot" in argv:  # without matplotlib --plot is refused for that first
        pytest.importorskip("matplotlib")
    assert cli.main(["verify", *argv, "--no-progress"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.skipif(not pathlib.Path("/proc/self").is_dir(), reason="needs Linux's /proc")
@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_a_path_the_file_system_refuses_is_a_usage_error(option, capsys):
    """No file can be made in /proc, though os.access says yes to root: exit 2 before the panel
    (it ran the panel, printed the table, then ended in a FileNotFoundError traceback, exit 1)."""
    if option == "--plot":  # without matplotlib --plot is refused for that first
        pytest.importorskip("matplotlib")
    path = "/proc/npattn-verify-output.x"
    assert cli.main(["verify", f"{KERNELS}:attention", option, path, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{option}: {path!r} cannot be written" in err and "Traceback" not in err


def test_a_backend_that_is_not_installed_names_the_flag(capsys):
    import importlib.util

    missing = [lib for lib in ("cupy", "jax", "torch") if importlib.util.find_spec(lib) is None]
    if not missing:
        pytest.skip("cupy, jax and torch are all installed")
    lib = missing[0]
    assert cli.main(["verify", f"{KERNELS}:attention", "--backend", lib, "--no-progress"]) == 2
    assert f"--backend {lib}: ModuleNotFoundError" in capsys.readouterr().err


def test_the_path_check_leaves_files_as_they_were(tmp_path):
    from npattn.tools.outputs import output_error

    old = tmp_path / "old.json"
    old.write_text("kept")
    new = tmp_path / "new.json"
    assert output_error("--json", str(old)) is None and output_error("--json", str(new)) is None
    assert old.read_text() == "kept" and not new.exists()


def test_a_device_the_backend_cannot_use_is_a_usage_error(tmp_path, capsys):
    """--device nonsense with torch: exit 2 naming device, before any case (every case failed as
    'fn raised', exit 1)."""
    pytest.importorskip("torch")
    (tmp_path / "tk.py").write_text("import torch\n"
                                    "def sdpa(q, k, v, mask=None, is_causal=False):\n"
                                    "    return torch.nn.functional.scaled_dot_product_attention(\n"
                                    "        q, k, v, attn_mask=mask, is_causal=is_causal)\n")
    assert cli.main(["verify", f"{tmp_path / 'tk.py'}:sdpa", "--backend", "torch", "--autograd",
                     "torch", "--supports", "causal", "--device", "nonsense", "--no-progress"]) == 2
    assert "--device: expected a device that --backend torch can use, got 'nonsense'" in \
        capsys.readouterr().err


def test_a_jax_device_is_named_by_platform_and_index(tmp_path, capsys):
    """--device cpu with --backend jax exited 2 ('--device: expected a device that --backend
    jax can use, got 'cpu' (ValueError: `jax.device_put` only accepts ...)'): jax.device_put
    takes no strings. Now cpu and cpu:0 put the kernel's arrays on jax.devices('cpu')[0] (the
    kernel refuses any other), and a name of no device exits 2 naming --device, what it takes,
    the devices jax reports and what was typed, before any case."""
    jax = pytest.importorskip("jax")
    (tmp_path / "jk.py").write_text(
        "import jax\n"
        "def attention(q, k, v, mask=None, is_causal=False):\n"
        "    for t in (q, k, v) + (() if mask is None else (mask,)):\n"
        "        assert t.devices() == {jax.devices('cpu')[0]}, t.devices()\n"
        "    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)\n")
    base = ["verify", f"{tmp_path / 'jk.py'}:attention", "--backend", "jax", "--layout", "bthd",
            "--supports", "causal,mask_bool", "--case", "causal-128x65", "--case",
            "mask_bool-65x129", "--no-progress"]
    for device in ("cpu", "cpu:0"):
        assert cli.main([*base, "--device", device]) == 0, capsys.readouterr()
        assert "2/2 cases pass" in capsys.readouterr().out
    wrong = [f"cpu:{len(jax.devices('cpu'))}", "cpu:x"]
    wrong += [p for p in ("gpu", "tpu") if p not in {d.platform for d in jax.devices()}]
    for device in wrong:
        assert cli.main([*base, "--device", device]) == 2
        err = capsys.readouterr().err
        head = ("npattn verify: --device: expected 'PLATFORM' or 'PLATFORM:N' naming one of the "
                "devices jax reports (")
        assert err.startswith(head) and err.count("\n") == 1, err
        assert "cpu:0" in err[len(head):].split(")", 1)[0], err
        assert f", got {device!r}" in err and "jax.Device" not in err, err
    # the help says so
    with pytest.raises(SystemExit):
        V.build_parser().parse_args(["--help"])
    assert "a jax PLATFORM or PLATFORM:N" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("argv, flag, received", [
    # 'npattn verify: --supports: supports: expected ...': the flag, then the keyword
    (["--supports", "caual"], "--supports", "'caual'"),
    # 'all' among names was told as a name it does not know
    (["--supports", "all,causal"], "--supports", "'all' with others in 'all,causal'"),
    # an empty entry was skipped: a typing slip ran a panel without the option meant
    (["--supports", "causal,,gqa"], "--supports", "'causal,,gqa', whose entry 2 of 3 is empty"),
    # '--head-dims: ... got (0,)': the tuple verify made of it, not what was typed
    (["--head-dims", "0"], "--head-dims", "'0'"),
    (["--head-dims", "64,0"], "--head-dims", "'0' in '64,0'"),
    (["--head-dims", "100000000"], "--head-dims", "'100000000'"),
    (["--head-dims", "64", "--supports", "dv_ne_dk"], "--head-dims", "'64'"),
    (["--head-dims", "x"], "--head-dims", "'x'"),
    # '--budget-factor: ... got 0.0' for 0
    (["--budget-factor", "0"], "--budget-factor", "'0'"),
    (["--budget-factor", "0.5"], "--budget-factor", "'0.5'"),
    (["--budget-factor", "1e400"], "--budget-factor", "'1e400'"),
    (["--budget-factor", "x"], "--budget-factor", "'x'"),
    (["--device", "cuda"], "--device", "'cuda'"),
    (["--case", "nope"], "--case", "'nope'"),
    (["--adapter", "[1]"], "--adapter", "a JSON list: '[1]'"),
    (["--seed", "-1"], "--seed", "-1"),
])
def test_a_bad_value_is_told_once_by_its_flag_as_typed(argv, flag, received, capsys):
    """Each flag's bad value: 'npattn verify: FLAG: expected ..., got VALUE', the flag once (not
    followed by verify's keyword) and the value as the user typed it."""
    assert cli.main(["verify", f"{KERNELS}:attention", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    head = f"npattn verify: {flag}: "
    assert err.startswith(head) and err.count("\n") == 1, err
    rest = err[len(head):]
    keyword = flag.lstrip("-").replace("-", "_")
    assert rest.startswith("expected ") and not rest.startswith((f"{keyword}:", f"{flag}:")), err
    assert f", got {received}" in rest, err
    if flag in ("--head-dims", "--budget-factor", "--seed"):  # these end with the value
        assert rest.endswith(f", got {received}\n"), err


def test_a_case_named_twice_is_refused_and_an_unknown_one_points_to_list(capsys):
    """--case NAME twice ran once, where --supports and --head-dims refuse a repeat; --case of
    an unknown name said 'names of the panel's cases or Case objects' (Python's words) with
    the first six names by alphabet."""
    base = ["verify", f"{KERNELS}:attention", "--supports", "causal,window", "--no-progress"]
    assert cli.main([*base, "--case", "base-1x65", "--case", "base-1x65"]) == 2
    assert capsys.readouterr().err == ("npattn verify: --case: expected each case once, got "
                                       "'base-1x65' more than once\n")
    assert cli.main([*base, "--case", "window-65x12"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("npattn verify: --case: expected a case name of this panel, got "
                          "'window-65x12' (did you mean 'window-65x129'"), err
    assert "Case objects" not in err and "run with --list in place of --case" in err
    # which lists the names of that panel, as many as the message says
    assert cli.main([*base, "--list"]) == 0
    names = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert "window-65x129" in names and f"to list its {len(names)} cases)" in err


def test_the_help_says_each_flags_values_and_default(capsys):
    """--seed had no help at all; --layout, --align, --device, --supports, --backward,
    --autograd, --adapter, --case, --json and --plot did not say their default."""
    with pytest.raises(SystemExit):
        V.build_parser().parse_args(["--help"])
    text = capsys.readouterr().out
    options = text.split("\noptions:\n", 1)[1]
    entries = re.split(r"\n(?=  -)", options.strip("\n"))
    assert len(entries) > 20
    for entry in entries:
        head, _, rest = entry.strip().partition("  ")
        if head.startswith("-h"):
            continue
        takes_value = " " in head or "{" in head  # "--seed N", "--layout {bhsd,...}"
        assert rest.strip(), f"{head}: no help"
        if takes_value:
            assert "default" in entry, f"{head}: its default is not said: {entry}"


def test_argparse_errors_exit_2(capsys):
    assert V.main([f"{KERNELS}:attention", "--layout", "bhds"]) == 2
    assert V.main(["--help"]) == 0 and "usage: npattn verify" in capsys.readouterr().out
    assert V.main([f"{KERNELS}:attention", "--backward", "x", "--autograd", "torch"]) == 2
    assert "not allowed with" in capsys.readouterr().err


def test_python_m_npattn_verify_in_a_pipe():
    env = dict(os.environ, PYTHONPATH=IMPORT_ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-m", "npattn", "verify", f"{KERNELS}:bug_gqa_no_sum",
                           "--backward", "attention_backward", "--returns-lse", "--supports",
                           "gqa", "--dtype", "float64", "--combos", "none"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "group of query heads" in proc.stdout and "FAILED" in proc.stdout
    assert "%|" not in proc.stderr  # no progress bar into a pipe


def test_npattn_help_lists_verify(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert "verify" in capsys.readouterr().out


def test_a_target_that_exits_never_passes(tmp_path, capsys):
    """sys.exit at the file's import or inside the kernel ended verify with status 0 and no
    report: a usage error (2) at import, a failing case (1) with a hint in a call."""
    at_import = tmp_path / "exits_at_import.py"
    at_import.write_text("import sys\ndef f(q, k, v, **kw):\n    return q\nsys.exit(0)\n")
    assert cli.main(["verify", f"{at_import}:f", "--no-progress"]) == 2
    assert "importing" in capsys.readouterr().err
    in_call = tmp_path / "exits_in_call.py"
    in_call.write_text("import sys\ndef f(q, k, v, **kw):\n    sys.exit(0)\n")
    assert cli.main(["verify", f"{in_call}:f", "--case", "base-1x65", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "SystemExit" in out and "a kernel must return or raise, not exit" in out


def test_a_kernel_of_the_wrong_signature_is_told_so(tmp_path, capsys):
    (tmp_path / "two_args.py").write_text("def f(q, k):\n    return q\n")
    assert cli.main(["verify", f"{tmp_path / 'two_args.py'}:f", "--case", "base-1x65",
                     "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "takes 2 positional arguments" in out and "fn's signature does not take the call" in out
    # the same TypeError raised inside the kernel's own code is the kernel's, not its signature's
    (tmp_path / "inner.py").write_text("def helper(a):\n    return a\n"
                                       "def f(q, k, v, **kw):\n    return helper(q, k)\n")
    assert cli.main(["verify", f"{tmp_path / 'inner.py'}:f", "--case", "base-1x65",
                     "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "helper() takes 1 positional argument" in out and "fn's signature" not in out


def test_a_return_verify_cannot_read_is_not_said_to_be_raised_by_the_kernel(tmp_path, capsys):
    """A kernel that returns a tuple without --returns-lse: the case names what it returned,
    without an 'at:' frame of verify's own code (it showed verifier.py in a private function)
    and without "fn raised" (the kernel raised nothing)."""
    (tmp_path / "tup.py").write_text("def f(q, k, v, **kw):\n    return q, q, q, q\n")
    assert cli.main(["verify", f"{tmp_path / 'tup.py'}:f", "--case", "base-1x65",
                     "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "got a tuple of 4" in out and "not what verify reads" in out
    assert "    at: " not in out and "verifier.py" not in out and "fn raised" not in out


def test_usage_errors_read_as_the_others_without_a_class_name(tmp_path, capsys):
    """An argument verify refuses read 'npattn verify: TypeError: --adapter: ...'; now as every
    other usage error, 'npattn verify: --adapter: ...', exit 2."""
    (tmp_path / "adapters.py").write_text("NUMBER = 3\n")
    for argv, head in (
            (["--adapter", f"{tmp_path / 'adapters.py'}:NUMBER"], "--adapter: expected None, a mapping"),
            (["--adapter", '{"nope": "x"}'], "--adapter: expected keys from npattn's keywords"),
            (["--backend", "torch", "--autograd", "jax"], "--autograd: needs --backend jax")):
        assert cli.main(["verify", f"{KERNELS}:attention", *argv, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"npattn verify: {head}"), err
        assert "Error:" not in err, err


def test_a_file_target_is_named_as_the_user_gave_it(tmp_path, monkeypatch, capsys):
    """An absolute target with a typo in the attribute was named relative to the current folder
    ('../../../tmp/.../k.py' has no attribute); now absolute stays absolute, relative relative,
    for the target and for a bare --backward / --adapter of its module."""
    (tmp_path / "sub").mkdir()
    kernel = tmp_path / "sub" / "k.py"
    kernel.write_text("def f(q, k, v, **kw):\n    return q\n")
    monkeypatch.chdir(tmp_path / "sub")
    for given in (str(kernel), os.path.join("..", "sub", "k.py")):
        for argv, head in (([f"{given}:nope"], "target"),
                           ([f"{given}:f", "--backward", "nope"], "--backward"),
                           ([f"{given}:f", "--adapter", "nope"], "--adapter")):
            assert cli.main(["verify", *argv, "--no-progress"]) == 2
            err = capsys.readouterr().err
            assert f"npattn verify: {head}: {given!r} has no attribute 'nope'" in err, err
    (tmp_path / "sub" / "c.py").write_text("x = 3\n")
    assert cli.main(["verify", "c.py:x", "--no-progress"]) == 2  # not a function: named target
    err = capsys.readouterr().err
    assert "npattn verify: target: expected a callable fn(q, k, v, **options), got int" in err, err
    missing = str(tmp_path / "nonexistent_dir" / "kernel.py")
    assert cli.main(["verify", f"{missing}:f", "--no-progress"]) == 2
    assert f"target: no such file {missing!r}" in capsys.readouterr().err


def test_messages_name_the_flags_not_the_keywords(tmp_path, capsys):
    """Verify's own messages name the flag a CLI user types: 'needs returns_lse=True' was shown
    in a case, 'lse_grad: True needs returns_lse=True' before the panel, and 'give backward= or
    autograd=' in the summary; the Python API keeps the keywords (tests/test_verify.py)."""
    (tmp_path / "pair.py").write_text("def f(q, k, v, **kw):\n    return q, q[..., 0]\n")
    target = f"{tmp_path / 'pair.py'}:f"
    assert cli.main(["verify", target, "--case", "base-1x65", "--no-progress"]) == 1
    out = capsys.readouterr().out
    assert "a kernel that returns (out, lse) needs --returns-lse" in out
    assert "(no gradients: give --backward or --autograd)" in out
    assert "returns_lse" not in out and "backward=" not in out
    for argv, message in (
            (["--lse-grad", "--backward", "f"], "--lse-grad: needs --returns-lse (dlse"),
            (["--lse-grad", "--returns-lse"],
             "--lse-grad: passes dlse to the gradients, which needs --backward or --autograd"),
            (["--mask-grad", "--backward", "f"],
             "--mask-grad: checks the dmask of float masks, but --supports does not declare "
             "'mask_float' (--supports '')"),
            (["--mask-grad", "--supports", "mask_float"],
             "--mask-grad: checks the gradient of the mask, which needs gradients (give "
             "--backward or --autograd)")):
        assert cli.main(["verify", target, *argv, "--no-progress"]) == 2
        err = capsys.readouterr().err
        assert message in err and "_lse" not in err and "_grad" not in err, err


def test_json_dash_holds_the_json_alone_when_the_kernel_prints(tmp_path, capsys):
    """What the kernel's file prints (at import, in each call) went to standard output before
    the JSON, which then did not parse."""
    (tmp_path / "noisy.py").write_text(
        "print('loading the noisy kernel')\n"
        "from npattn import functional as F\n"
        "def attn(q, k, v, **kw):\n"
        "    print('called with', q.shape)\n"
        "    return F.sdpa_forward(q, k, v, **kw)[0]\n")
    assert cli.main(["verify", f"{tmp_path / 'noisy.py'}:attn", "--case", "base-1x65",
                     "--dtype", "float64", "--json", "-", "--no-progress"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ok"] is True
    assert "loading the noisy kernel" in captured.err and "called with" in captured.err


def test_a_module_target_in_the_current_folder_without_it_on_sys_path(tmp_path, monkeypatch,
                                                                       capsys):
    """The installed npattn script has its own folder on sys.path, not the current one
    (python -m has ''): module:function of a module in the current folder did not import."""
    (tmp_path / "cwd_kernels.py").write_text(
        "from npattn import functional as F\n"
        "def attn(q, k, v, **kw):\n"
        "    return F.sdpa_forward(q, k, v, **kw)[0]\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    before = list(sys.path)
    assert cli.main(["verify", "cwd_kernels:attn", "--case", "base-1x65", "--dtype", "float64",
                     "--no-progress"]) == 0
    assert "passed" in capsys.readouterr().out
    assert sys.path == before  # the folder was on it while the command ran, not after


class _Report:
    """What the command reads of ``npattn.verify``'s report."""

    def __init__(self, ok):
        self.ok = ok

    def format(self):
        return "the table"

    def to_json(self):
        return json.dumps({"ok": self.ok})


def _called_verify(monkeypatch, argv, ok=True):
    """The status of ``npattn verify ARGV`` and the keywords it called ``npattn.verify`` with
    (a stand-in that runs no case)."""
    from npattn import verifier

    seen = {}

    def stand_in(fn, **kwargs):
        seen.update(kwargs, fn=fn)
        return _Report(ok)

    monkeypatch.setattr(verifier, "verify", stand_in)
    status = cli.main(["verify", *argv, "--no-progress"])
    return status, seen


def test_every_flag_reaches_verify_and_the_rerun_line(monkeypatch, capsys):
    """Each flag's value is the keyword verify runs with, and the rerun line of a failing case
    parses back to the same flags (a flag it drops reruns another case than the one that
    failed: another seed draws other inputs, another alignment another diagonal)."""
    argv = [f"{KERNELS}:attention", "--layout", "bshd", "--dtype", "float64", "--supports",
            "window,causal,dv_ne_dk", "--backend", "torch", "--device", "cpu", "--align",
            "bottom_right", "--backward", "attention_backward", "--returns-lse", "--mask-grad",
            "--lse-grad", "--adapter", '{"mask": "attn mask"}', "--seed", "5", "--head-dims",
            "16,32", "--budget-factor", "3", "--combos", "none"]
    status, seen = _called_verify(monkeypatch, argv, ok=False)
    assert status == 1
    assert capsys.readouterr().out == "the table\n"
    assert seen["fn"].__name__ == "attention" and seen["backward"].__name__ == "attention_backward"
    expected = {"layout": "bshd", "dtype": "float64", "supports": ("causal", "dv_ne_dk", "window"),
                "backend": "torch", "device": "cpu", "align": "bottom_right", "autograd": None,
                "returns_lse": True, "mask_grad": True, "lse_grad": True,
                "adapter": {"mask": "attn mask"}, "seed": 5, "head_dims": (16, 32),
                "budget_factor": 3.0, "combos": False, "cases": None}
    assert {k: seen[k] for k in expected} == expected
    rerun = shlex.split(seen["command"].replace("{case}", "window-65x129"))
    assert rerun[:2] == ["npattn", "verify"]
    parser = V.build_parser()
    again, first = vars(parser.parse_args(rerun[2:])), vars(parser.parse_args(argv))
    assert float(again.pop("budget_factor")) == float(first.pop("budget_factor"))
    assert again == {**first, "case": ["window-65x129"]}


def test_verify_runs_with_the_defaults_the_help_says(monkeypatch, capsys):
    """Without flags: layout bhsd, dtype float32, no options, numpy, the library's device,
    alignment top_left, seed 0, budget factor 2, pairs of options, the panel's head widths
    and every case (the defaults --help gives); exit 0 for a report that passes."""
    status, seen = _called_verify(monkeypatch, [f"{KERNELS}:attention"])
    assert status == 0
    expected = {"layout": "bhsd", "dtype": "float32", "supports": (), "backend": "numpy",
                "device": None, "align": "top_left", "autograd": None, "backward": None,
                "returns_lse": False, "mask_grad": None, "lse_grad": False, "adapter": None,
                "seed": 0, "head_dims": None, "budget_factor": 2.0, "combos": True, "cases": None}
    assert {k: seen[k] for k in expected} == expected
    help_text = " ".join(V.build_parser().format_help().split())
    for said in ("(B, H, L, D; the default)", "(default float32)", "(default numpy)",
                 "(default top_left", "(default 0)", "(default 2)", "(pairs, the default)"):
        assert said in help_text, said


def test_list_takes_case_and_combos(capsys):
    """--list with --case lists those cases alone; with --combos none, no case of several
    options (whose names join the options with '+')."""
    base = ["verify", f"{KERNELS}:attention", "--supports", "causal,window", "--list"]
    assert cli.main([*base, "--case", "window-65x129", "--case", "base-1x65"]) == 0
    listed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in listed] == ["window-65x129", "base-1x65"]
    assert cli.main(base) == 0
    pairs = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert any("+" in name for name in pairs)
    assert cli.main([*base, "--combos", "none"]) == 0
    alone = [line.split()[0] for line in capsys.readouterr().out.splitlines()]
    assert alone and not any("+" in name for name in alone)
    assert set(alone) < set(pairs)


def test_the_widest_head_the_help_gives_is_taken(capsys):
    """--head-dims takes ints from 1 to 16384 (docs/verify.md): both ends are in, 16385 out."""
    base = ["verify", f"{KERNELS}:attention", "--combos", "none", "--list"]
    assert cli.main([*base, "--head-dims", "1,16384"]) == 0
    widths = {int(line.split("Dh=")[1].split()[0]) for line in capsys.readouterr().out.splitlines()}
    assert widths == {1, 16384}
    assert cli.main([*base, "--head-dims", "16385"]) == 2
    assert "--head-dims: expected ints from 1 to 16384, got '16385'" in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_any_case(monkeypatch, capsys):
    """--plot where matplotlib is missing: exit 2 naming --plot before the panel runs (not a
    traceback from the picture after every case has run)."""
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    status, seen = _called_verify(monkeypatch, [f"{KERNELS}:attention", "--plot", "x.png"])
    assert status == 2 and seen == {}
    assert capsys.readouterr().err == ("npattn verify: --plot needs matplotlib: pip install "
                                       "matplotlib, or '.[plot]' from the repository root\n")


def test_a_target_whose_import_failed_is_imported_again_next_time(tmp_path, capsys):
    """A file whose import fails is not kept: fixed, the next run in the same process imports
    it anew (not the half-made module of the failed import)."""
    kernel = tmp_path / "fixed_later.py"
    kernel.write_text("raise RuntimeError('not yet')\n")
    argv = ["verify", f"{kernel}:attn", "--case", "base-1x65", "--dtype", "float64",
            "--no-progress"]
    assert cli.main(argv) == 2
    assert "RuntimeError: not yet" in capsys.readouterr().err
    kernel.write_text("from npattn import functional as F\n"
                      "def attn(q, k, v, **kw):\n"
                      "    return F.sdpa_forward(q, k, v, **kw)[0]\n")
    assert cli.main(argv) == 0
    assert "1/1 cases pass" in capsys.readouterr().out


def test_json_dash_exits_1_when_a_case_fails(tmp_path, capsys):
    (tmp_path / "off.py").write_text(
        "from npattn import functional as F\n"
        "def attn(q, k, v, **kw):\n"
        "    return F.sdpa_forward(q, k, v, **kw)[0] * 1.01\n")
    assert cli.main(["verify", f"{tmp_path / 'off.py'}:attn", "--case", "base-1x65",
                     "--dtype", "float64", "--json", "-", "--no-progress"]) == 1
    captured = capsys.readouterr()
    assert json.loads(captured.out)["ok"] is False and "FAILED" in captured.err


def test_a_target_that_is_not_callable_is_told_as_the_target(tmp_path, capsys):
    (tmp_path / "notfn.py").write_text("attn = 3\n")
    assert cli.main(["verify", f"{tmp_path / 'notfn.py'}:attn", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("npattn verify: target: expected a callable fn(q, k, v, **options), "
                          "got int"), err


def test_a_budget_factor_of_one_is_taken(capsys):
    """1 is the smallest --budget-factor (as accurate as npattn), as verify takes it."""
    status = cli.main(["verify", *GOOD, "--dtype", "float64", "--case", "base-1x65",
                       "--budget-factor", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert status in (0, 1) and "budget 1.0 x npattn" in out, out


def test_mask_grad_without_mask_float_names_the_supports_as_typed(capsys):
    """The refusal names --supports with its value as the command line takes it."""
    status = cli.main(["verify", *GOOD, "--mask-grad", "--supports", "causal,window", "--no-progress"])
    err = capsys.readouterr().err
    assert status == 2 and err.rstrip().endswith("(--supports causal,window)"), err


def test_a_file_target_imports_its_sibling_modules(tmp_path, capsys):
    """A kernel file's folder is on sys.path while it loads: its own imports of the files
    beside it resolve, as they do when it runs as a script."""
    (tmp_path / "npattn_test_sibling_module.py").write_text(
        "from npattn import functional as F\n\n\n"
        "def forward(q, k, v, **options):\n"
        "    return F.sdpa_forward(q, k, v, **options)[0]\n")
    (tmp_path / "kernel_with_sibling.py").write_text(
        "from npattn_test_sibling_module import forward\n\n\n"
        "def attention(q, k, v, **options):\n"
        "    return forward(q, k, v, **options)\n")
    status = cli.main(["verify", f"{tmp_path}/kernel_with_sibling.py:attention", "--dtype", "float64",
                       "--case", "base-1x65", "--no-progress"])
    captured = capsys.readouterr()
    assert status == 0, captured.out + captured.err


def test_load_object_names_a_loaded_file_by_its_path():
    """A missing bare attribute of a module loaded from a file is told in the file's path,
    not the name the module was loaded under."""
    fn = V.load_object(f"{KERNELS}:attention")
    module = sys.modules[fn.__module__]
    with pytest.raises(V.UsageError) as info:
        V.load_object("nope", base=module, what="--backward")
    assert str(info.value) == f"--backward: {os.path.abspath(KERNELS)!r} has no attribute 'nope'"


def test_a_target_path_without_py_is_read_as_a_file(capsys):
    """A target with a folder in it is a file, .py or not: one that is missing is told as no
    such file, not as a module that did not import."""
    assert cli.main(["verify", "no/such/kernel:attention", "--no-progress"]) == 2
    assert capsys.readouterr().err == "npattn verify: target: no such file 'no/such/kernel'\n"


VARLEN = '''\
from npattn import compat


def attention(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
              is_causal=False, align=None, window=None, enable_gqa=False):
    ws = (-1, -1) if window is None else tuple(-1 if w is None else w for w in window)
    (out, lse, _), pullback = compat.vjp(
        compat.flash_attn_varlen_func, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, causal=is_causal, window_size=ws, return_attn_probs=True)
    return out{scale}, lse, pullback


def backward(dout, pullback):
    return pullback(dout)[:3]
'''


def test_layout_thd_checks_a_varlen_kernel_and_reruns_its_cases(tmp_path, capsys):
    """--layout thd calls the kernel on the packed sequences (npattn.compat's varlen kernel
    passes, the same kernel with out off by 1 % fails, and its rerun line keeps --layout thd);
    a mask declared with it exits 2, the refusal naming --supports and --layout thd."""
    (tmp_path / "varlen.py").write_text(VARLEN.format(scale=""))
    (tmp_path / "off.py").write_text(VARLEN.format(scale=" * 1.01"))
    flags = ["--layout", "thd", "--dtype", "float64", "--returns-lse", "--backward", "backward",
             "--align", "bottom_right", "--supports", "causal_bottom_right,window,gqa",
             "--no-progress"]
    assert cli.main(["verify", f"{tmp_path / 'varlen.py'}:attention", *flags]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out and "; thd float64 on numpy" in out, out
    assert cli.main(["verify", f"{tmp_path / 'off.py'}:attention", *flags]) == 1
    out = capsys.readouterr().out
    rerun = next(line.split("rerun: ", 1)[1] for line in out.splitlines() if "rerun: " in line)
    assert "--layout thd" in rerun
    assert cli.main(shlex.split(rerun)[1:] + ["--no-progress"]) == 1
    assert "0/1 cases pass" in capsys.readouterr().out
    # --list names each case's packed sequences: the first shorter by Lq // 4 queries and
    # half as many keys, the second of the case's lengths
    assert cli.main(["verify", f"{tmp_path / 'varlen.py'}:attention", *flags, "--list",
                     "--case", "causal_bottom_right-65x129"]) == 0
    assert capsys.readouterr().out.rstrip().endswith(
        "Lq=65 Lk=129 Dh=16 Dv=16 sequences (Lq, Lk) (49, 121), (65, 129)")
    for extra in ([], ["--list"]):  # refused before the panel is listed, too
        argv = ["verify", f"{tmp_path / 'varlen.py'}:attention", "--layout", "thd",
                "--supports", "causal,mask_float", *extra]
        assert cli.main(argv) == 2
        assert capsys.readouterr().err == (
            "npattn verify: --supports: expected options that --layout thd can pass, not "
            "'mask_bool', 'mask_float' or 'segments' (a varlen kernel takes its sequences packed "
            "one after another, each attending its own keys, with no mask nor segment ids), got "
            "'mask_float'\n")
