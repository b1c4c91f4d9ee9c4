"""The CPU a measurement names (specstack/machine.py): the first CPU's model name with its family and
model, so that a bare virtual-machine name ("AMD EPYC") still tells a Zen 4 from a Zen 5."""
from __future__ import annotations

from specstack.machine import cpu_model

BLOCK = "processor\t: {i}\nvendor_id\t: AuthenticAMD\ncpu family\t: {family}\nmodel\t\t: {model}\nmodel name\t: AMD EPYC\n\n"


def test_the_first_cpus_name_family_and_model(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text(BLOCK.format(i=0, family=26, model=2) + BLOCK.format(i=1, family=25, model=17))
    assert cpu_model(info) == "AMD EPYC (family 26 model 2)"
    info.write_text(BLOCK.format(i=0, family=25, model=17))
    assert cpu_model(info) == "AMD EPYC (family 25 model 17)"


def test_a_cpuinfo_without_family_gives_the_name_and_none_a_fallback(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\n\n")
    assert cpu_model(info) == "Some CPU"
    assert cpu_model(tmp_path / "missing")  # the platform's name for it, never empty
