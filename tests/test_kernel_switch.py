"""The CPU kernels' switch and state (jaxsmol/kernels/cpu_kernels.py `kernel_switch`, `state`) and `jaxsmol info`
(cli/info.py): JAXSMOL_KERNELS=auto|on|off (JAXSMOL_CPU_KERNELS, its old name, still read), a bad value
or `on` where the kernels cannot be built is one error line, a CPU they cannot run on is skipped before
compiling, a wheel's prebuilt library is loaded where one fits the CPU. (The wheel itself: tests/test_wheel.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from jaxsmol.kernels import choice, cpu_kernels
from jaxsmol.errors import JaxsmolError
from jaxsmol.cache.scheduler.many import generate


@pytest.mark.parametrize("env,expected", [
    ({}, ("auto", None)),
    ({"JAXSMOL_KERNELS": " Off "}, ("off", "JAXSMOL_KERNELS")),
    ({"JAXSMOL_KERNELS": "on"}, ("on", "JAXSMOL_KERNELS")),
    ({"JAXSMOL_KERNELS": "", "JAXSMOL_CPU_KERNELS": "0"}, ("off", "JAXSMOL_CPU_KERNELS")),  # the old name
    ({"JAXSMOL_KERNELS": "auto", "JAXSMOL_CPU_KERNELS": "off"}, ("auto", "JAXSMOL_KERNELS")),  # the new one wins
])
def test_the_switch_reads_the_variable_and_its_old_name(env, expected):
    assert cpu_kernels.kernel_switch(env) == expected


@pytest.mark.parametrize("name", ["JAXSMOL_KERNELS", "JAXSMOL_CPU_KERNELS"])
def test_a_bad_value_names_the_variable_and_the_values_allowed(name):
    with pytest.raises(JaxsmolError, match=f"{name} must be one of auto, on, off, got 'fast'"):
        cpu_kernels.kernel_switch({name: "fast"})


def test_the_kernels_need_x86_64_with_avx2_and_fma():
    assert cpu_kernels.unsupported_cpu("x86_64", {"avx2", "fma", "avx512f"}) is None
    assert cpu_kernels.unsupported_cpu("x86_64", None) is None  # flags unknown: left to the compiler
    assert "lacks AVX2" in cpu_kernels.unsupported_cpu("x86_64", {"sse4_2", "fma"})
    assert "aarch64" in cpu_kernels.unsupported_cpu("aarch64", {"asimd"})


def fresh_state(monkeypatch, env: dict) -> None:
    """Forget this process's kernel state (restored after the test) and set the environment for the next load."""
    monkeypatch.setattr(cpu_kernels, "_state", None)
    for name in ("JAXSMOL_KERNELS", "JAXSMOL_CPU_KERNELS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)


def test_an_arm_cpu_is_skipped_before_compiling_with_one_line(monkeypatch, capsys):
    fresh_state(monkeypatch, {})
    monkeypatch.setattr(cpu_kernels.platform, "machine", lambda: "aarch64")
    monkeypatch.setattr(cpu_kernels, "_build", lambda: pytest.fail("compiled on a CPU the kernels cannot run on"))
    assert not cpu_kernels.available() and cpu_kernels.vector_lanes() == 0
    state = cpu_kernels.state()
    assert (state.mode, state.in_use, state.library) == ("auto", False, None) and "aarch64" in state.reason
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and "CPU kernels are not available" in lines[0] and "aarch64" in lines[0]


def test_on_fails_with_one_error_where_they_cannot_be_built(monkeypatch, tmp_path, capsys):
    fresh_state(monkeypatch, {"JAXSMOL_KERNELS": "on", "CXX": str(tmp_path / "no-such-compiler"),
                              "JAXSMOL_HOME": str(tmp_path / "home")})
    with pytest.raises(JaxsmolError, match="JAXSMOL_KERNELS=on, but the CPU kernels are not available: .*no-such-comp"):
        cpu_kernels.available()
    assert capsys.readouterr().err == ""  # the error is the one line, not also auto's warning


def test_a_missing_source_is_named(monkeypatch, tmp_path):
    """A broken install says which file is missing."""
    monkeypatch.setattr(choice, "SOURCES", (*choice.SOURCES, tmp_path / "cpu_missing.cc"))
    with pytest.raises(RuntimeError, match="kernel sources missing from .*: cpu_missing.cc"):
        cpu_kernels._build()


def test_the_best_prebuilt_variant_present_loads_else_the_kernels_are_compiled(monkeypatch, tmp_path):
    """_open: a wheel's library of the best variant the CPU runs among those it holds; none held (an
    editable install) or none the CPU runs: compiled for this CPU. (Stubs: nothing is compiled or loaded.)"""
    from jaxsmol.kernels import variants

    built = tmp_path / "kernels" / "cpu_kernels-KEY.so"
    monkeypatch.setattr(choice, "PREBUILT", tmp_path)
    monkeypatch.setattr(cpu_kernels, "_build", lambda: (built, True))
    monkeypatch.setattr(cpu_kernels, "_register", lambda path: 16)
    vnni = variants.X86_64_V4 | {"avx512_vnni"}
    assert cpu_kernels._open(vnni) == (built, "compiled", None, 16)  # an editable install holds none
    for v in variants.VARIANTS:
        (tmp_path / v.library).touch()
    assert cpu_kernels._open(vnni) == (tmp_path / "cpu_kernels-avx512-vnni.so", "prebuilt", "avx512-vnni", 16)
    assert cpu_kernels._open(variants.X86_64_V3)[1:3] == ("prebuilt", "avx2")
    assert cpu_kernels._open(None)[1] == "compiled"  # the flags unknown
    (tmp_path / "cpu_kernels-avx512-vnni.so").unlink()
    assert cpu_kernels._open(vnni)[1:3] == ("prebuilt", "avx512")  # the best of those held


def test_a_prebuilt_library_the_loader_refuses_is_compiled_instead(monkeypatch, tmp_path):
    """A wheel's library that does not load (an older glibc than its tag says): compiled for this CPU; where
    that fails too, the reason names both."""
    from jaxsmol.kernels import variants

    def register(path):
        if path.parent == tmp_path:
            raise OSError("version `GLIBC_2.99' not found")
        return 8

    monkeypatch.setattr(choice, "PREBUILT", tmp_path)
    monkeypatch.setattr(cpu_kernels, "_register", register)
    (tmp_path / "cpu_kernels-avx2.so").touch()
    monkeypatch.setattr(cpu_kernels, "_build", lambda: (tmp_path / "kernels" / "built.so", False))
    assert cpu_kernels._open(variants.X86_64_V3) == (tmp_path / "kernels" / "built.so", "cache", None, 8)
    monkeypatch.setattr(cpu_kernels, "_build", lambda: (_ for _ in ()).throw(RuntimeError("cannot run c++")))
    with pytest.raises(RuntimeError, match=r"the prebuilt cpu_kernels-avx2.so does not load \(version `GLIBC_2.99' "
                                           r"not found\); cannot run c\+\+"):
        cpu_kernels._open(variants.X86_64_V3)


def test_off_is_silent_and_the_engine_runs_xla(monkeypatch, capsys, tiny_cfg):
    from jaxsmol.runtime.engine import Engine
    from jaxsmol.model.params import init_random
    from jaxsmol.runtime.sampling import SamplingParams

    fresh_state(monkeypatch, {"JAXSMOL_CPU_KERNELS": "off"})
    engine = Engine(tiny_cfg, init_random(tiny_cfg), None, ctx=256)
    assert not engine.cfg.cpu_kernels and not cpu_kernels.is_packed(engine.params.unembed)
    assert len(generate(engine, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True)).output_ids) == 3
    assert cpu_kernels.state().reason == "switched off (JAXSMOL_CPU_KERNELS=off): XLA's ops only"
    assert capsys.readouterr().err == ""


def run_cli(*args, **env):
    return subprocess.run([sys.executable, "-m", "jaxsmol.cli.main", *map(str, args)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "JAX_PLATFORMS": "cpu", **env})


def test_generate_with_on_and_no_compiler_is_one_error_line(tmp_path, tiny_model_dir):
    r = run_cli("generate", "--model", tiny_model_dir, "--ids", 1, 2, 3, "--max-tokens", 2,
                JAXSMOL_KERNELS="on", CXX=str(tmp_path / "no-such-compiler"), JAXSMOL_HOME=str(tmp_path))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.splitlines() == [r.stderr.strip()] and r.stderr.startswith("error: JAXSMOL_KERNELS=on, but")


def test_info_reports_the_kernels_and_the_directories(tmp_path):
    """--json: one object, the kernels built here (the suite needs a compiler); the text: one row each."""
    from jaxsmol.checkpoint.default_model import DEFAULT_MODEL_NAME

    env = {"JAXSMOL_HOME": str(tmp_path), "JAXSMOL_COMPILE_CACHE": str(tmp_path / "programs"),
           "JAXSMOL_KERNELS_DIR": str(tmp_path / "kernels")}
    home = tmp_path / "kernels"  # a library built before, copied in: the state says it came from the cache
    home.mkdir()
    library = cpu_kernels.state().library
    (home / os.path.basename(library)).write_bytes(open(library, "rb").read())
    r = run_cli("info", "--load", "--json", JAXSMOL_KERNELS="on", **env)
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["kernels"] == {"mode": "on", "switch": "JAXSMOL_KERNELS", "in_use": True, "source": "cache",
                               "isa": cpu_kernels.ISAS[cpu_kernels.vector_lanes()], "lanes": cpu_kernels.vector_lanes(),
                               "library": str(home / os.path.basename(library)), "reason": None, "loaded": True}
    # without --load, from files alone: the same library chosen, nothing loaded
    expected = json.loads(run_cli("info", "--json", JAXSMOL_KERNELS="on", **env).stdout)
    assert expected["kernels"] == {**info["kernels"], "loaded": False} and expected["devices"] is None
    assert {k: v for k, v in expected.items() if k not in ("kernels", "devices", "loaded", "model")} == {
        k: v for k, v in info.items() if k not in ("kernels", "devices", "loaded", "model")}
    assert info["backend"] == "cpu" and info["devices"] and info["jax"] and info["jaxlib"]
    assert info["model"]["dir"] == str(tmp_path / "models" / DEFAULT_MODEL_NAME) and info["model"]["imported"] is False
    assert info["model"]["runs"].startswith("q4_1")  # the bundled file as it is, where the kernels run
    assert info["matmul"]["auto"] == "int8" and "--matmul exact" in info["matmul"]["why"]
    assert info["speculate"]["auto"] == "cache" and "--speculate none" in info["speculate"]["why"]
    assert info["data_dir"] == str(tmp_path) and info["compile_cache_dir"] == str(tmp_path / "programs")
    text = run_cli("info", "--load", JAXSMOL_KERNELS="off", **env)
    assert text.returncode == 0 and text.stderr == ""
    lines = text.stdout.splitlines()
    assert [line.split("  ")[0] for line in lines] == ["jaxsmol", "python", "jax / jaxlib", "backend", "devices",
                                                       "kernels", "model", "bundled model", "runs", "matmul",
                                                       "speculate", "weights", "data directory", "compile cache"]
    off = r"kernels +not in use \(mode off\): switched off \(JAXSMOL_KERNELS=off\): XLA's ops only"
    assert re.fullmatch(off, lines[5])
    assert lines[6].endswith("(not imported yet)") and lines[12].endswith(f"  {tmp_path}")
    assert lines[8].startswith("runs") and "float32" in lines[8]  # XLA's path: the float32 values
    assert re.match(r"matmul +exact for quantized weights by default: the CPU kernels do not run", lines[9])
    assert re.match(r"speculate +none by default: the CPU kernels do not run", lines[10])
    assert lines[11].endswith("(once the model is imported)")


def test_the_expected_state_is_read_from_files_alone(monkeypatch, tmp_path):
    """choice.expected() (`jaxsmol info` without --load): a wheel's best variant; else a library built before;
    else one to compile where a compiler is, or not in use, naming the missing compiler."""
    from jaxsmol.kernels import variants

    monkeypatch.setattr(choice, "_cpu_flags", lambda: set(variants.X86_64_V3))
    monkeypatch.setattr(choice, "PREBUILT", tmp_path / "prebuilt")
    monkeypatch.setenv("JAXSMOL_KERNELS_DIR", str(tmp_path / "kernels"))
    monkeypatch.delenv("JAXSMOL_KERNELS", raising=False)
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    none = choice.expected()
    assert (none.in_use, none.loaded) == (False, False) and "no-such-compiler" in none.reason
    monkeypatch.setenv("CXX", "sh")  # a program on PATH stands for the compiler: nothing is run
    to_compile = choice.expected()
    assert (to_compile.in_use, to_compile.source, to_compile.isa, to_compile.lanes) == (True, "to compile", "avx2", 8)
    Path(to_compile.library).parent.mkdir(parents=True)
    Path(to_compile.library).touch()
    assert choice.expected().source == "cache"
    (tmp_path / "prebuilt").mkdir()
    for v in variants.VARIANTS:
        (tmp_path / "prebuilt" / v.library).touch()
    assert (choice.expected().source, choice.expected().isa) == ("prebuilt", "avx2")
    monkeypatch.setenv("JAXSMOL_KERNELS", "off")
    assert not choice.expected().in_use
