"""Profiles in files: `HardwareProfile.from_file`, `load(path.toml)`, the TOML writer and the template
(`trainplan.hardware_profiles.profile_file`), `trainplan profiles --template`, and each bad file's one-line error."""

from __future__ import annotations

import dataclasses
import json
import tomllib

import pytest

import trainplan.planner.cli.main as cli
from trainplan.errors import OutputPathError, TrainplanError
from trainplan.hardware_profiles import HardwareProfile, load
from trainplan.hardware_profiles.profile_file import TEMPLATE_HEADER, profile_toml, template_toml, write_profile_file

SHIPPED = ["a100", "h100", "h200", "mi300a", "mi300x"]


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_profile_round_trips_through_a_file(name, tmp_path):
    profile = load(name)
    path = write_profile_file(profile, tmp_path / f"{name}.toml")
    assert HardwareProfile.from_file(path) == profile
    assert load(str(path)) == profile
    assert not list(tmp_path.glob("*.tmp"))


def test_round_trip_keeps_odd_strings_aliases_and_optimizer_rates(tmp_path):
    profile = load("h100").with_calibration(
        aliases=("my gpu", "x.y"), optimizer_s_per_param={"8": 1.25e-9, "32": 3e-10}, op_overhead_s=7.5e-06,
        source='quotes " and \\ backslash, tab\t, unicode µs, newline\nsecond line',
        sources={"op_overhead_s": "measured: 7.5 µs \"per op\""})
    path = write_profile_file(profile, tmp_path / "odd.toml", header="two\nlines")
    text = path.read_text()
    assert text.startswith("# two\n# lines\n")
    back = HardwareProfile.from_file(path)
    assert back == profile
    assert back.optimizer_s_per_param == {"8": 1.25e-9, "32": 3e-10}


def test_template_is_the_profile_under_a_header():
    text = template_toml(load("h200"))
    assert text.startswith("# A trainplan hardware profile")
    assert TEMPLATE_HEADER.splitlines()[-1] in text
    assert HardwareProfile.from_dict(tomllib.loads(text)) == load("h200")
    raw = tomllib.loads(profile_toml(load("h200")))
    assert raw["sources"]["peak_flops_per_s.bf16"] and raw["peak_flops_per_s"]["bf16"] == 989.4e12


def test_cli_profiles_template_prints_a_loadable_file(capsys, tmp_path):
    assert cli.main(["profiles", "--template", "h100"]) == 0
    text = capsys.readouterr().out
    (tmp_path / "my-gpu.toml").write_text(text.replace('name = "h100"', 'name = "my-gpu"'))
    mine = load(str(tmp_path / "my-gpu.toml"))
    assert mine.name == "my-gpu"
    assert dataclasses.replace(mine, name="h100") == load("h100")


def test_load_reads_a_path_ending_in_toml_any_case(tmp_path):
    path = write_profile_file(load("a100"), tmp_path / "Card.TOML")
    assert load(f" {path} ") == load("a100")


def _bad(tmp_path, text: str | bytes):
    path = tmp_path / "bad.toml"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(TrainplanError) as info:
        HardwareProfile.from_file(path)
    msg = str(info.value)
    assert msg.startswith(f"hardware profile file {str(path)!r}") and "\n" not in msg.strip()
    return msg


def test_missing_file_and_folder(tmp_path):
    for path in (tmp_path / "nope.toml", tmp_path):
        with pytest.raises(TrainplanError, match="does not exist or is not a file.*--template h100"):
            HardwareProfile.from_file(path)
    with pytest.raises(TrainplanError, match="does not exist"):
        load(str(tmp_path / "nope.toml"))


def test_bad_toml_names_the_line(tmp_path):
    msg = _bad(tmp_path, 'name = "x"\nhbm_bytes = = 3\n')
    assert "is not valid TOML" in msg and "line 2" in msg


def test_not_utf8(tmp_path):
    assert "cannot be read" in _bad(tmp_path, b"name = '\xff\xfe'\n")


def _text(**edits) -> str:
    """h100's file with top-level keys set (None: removed), written without the profile's checks."""
    raw = tomllib.loads(profile_toml(load("h100")))
    for key, value in edits.items():
        if value is None:
            raw.pop(key)
        else:
            raw[key] = value
    return _dump(raw)


def _dump(raw: dict) -> str:
    lines, tables = [], []
    for k, v in raw.items():
        if isinstance(v, dict):
            tables.append(f"[{k}]\n" + "\n".join(f"{json.dumps(kk)} = {json.dumps(vv)}" for kk, vv in v.items()))
        else:
            lines.append(f"{k} = {json.dumps(v)}")
    return "\n".join(lines) + "\n" + "\n".join(tables) + "\n"


def test_unknown_key_lists_the_valid_ones(tmp_path):
    msg = _bad(tmp_path, _text(hbm_gib=80))
    assert "unknown key(s) hbm_gib; valid keys are name, aliases" in msg and "memory_reserve_bytes" in msg


def test_missing_key_is_named(tmp_path):
    assert "missing key(s) hbm_bytes" in _bad(tmp_path, _text(hbm_bytes=None))


@pytest.mark.parametrize(("key", "value", "want"), [
    ("memory_efficiency", 1.5, "': memory_efficiency=1.5 must be a finite number in (0, 1]"),
    ("hbm_bytes", "80GB", "': hbm_bytes='80GB' must be a finite number > 0"),
    ("device_type", "tpu", "device_type='tpu' must be cpu, cuda, mps or xpu"),
    ("matmul_efficiency", [[1e9, 0.5], [1e8, 0.6]], "op_flops strictly increasing"),
    ("devices_per_node", True, "devices_per_node=True must be a whole number >= 1"),
    ("peak_flops_per_s", {"BF16": 1e12}, "peak_flops_per_s key 'BF16' must be a string matching"),
])
def test_invalid_value_names_it_and_what_is_valid(tmp_path, key, value, want):
    assert want in _bad(tmp_path, _text(**{key: value}))


def test_numbers_need_a_source(tmp_path):
    raw = tomllib.loads(profile_toml(load("h100")))
    del raw["sources"]["network_efficiency"], raw["sources"]["peak_flops_per_s.bf16"]
    msg = _bad(tmp_path, _dump(raw))
    assert "no source for network_efficiency, peak_flops_per_s.bf16" in msg and "[sources]" in msg


def test_write_errors_name_the_path(tmp_path):
    with pytest.raises(OutputPathError, match="no/such/folder/x.toml"):
        write_profile_file(load("h100"), tmp_path / "no" / "such" / "folder" / "x.toml")
    with pytest.raises(OutputPathError, match="it is a folder"):
        write_profile_file(load("h100"), tmp_path)


def test_the_documented_example_profile_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "docs" / "example-l40s.toml"
    profile = load(str(path))
    assert profile.name == "l40s" and profile.peak("bf16") == 362.05e12 and profile.missing_sources() == []


def test_host_memory_link_and_unified_memory(tmp_path, cpu_profile):
    """The offload keys: PCIe one way per GPU, the node's host memory, MI300A and cpu unified."""
    assert [load(n).host_link_bandwidth_bytes_per_s for n in ("a100", "a100-40gb", "h100", "h200", "mi300x")] == [
        32e9, 32e9, 64e9, 64e9, 64e9]
    assert load("a100-40gb").host_memory_bytes == 2**40 and load("h100").host_memory_bytes == 2 * 2**40
    assert not any(load(n).unified_memory for n in SHIPPED if n != "mi300a")
    mi300a = load("mi300a")
    assert mi300a.unified_memory and mi300a.host_memory_bytes == mi300a.devices_per_node * mi300a.hbm_bytes
    assert mi300a.host_link_bandwidth_bytes_per_s == mi300a.hbm_bandwidth_bytes_per_s / 2
    assert cpu_profile.unified_memory and cpu_profile.host_memory_bytes == cpu_profile.hbm_bytes
    assert cpu_profile.host_link_bandwidth_bytes_per_s == cpu_profile.hbm_bandwidth_bytes_per_s / 2
    assert cpu_profile.missing_sources() == []
    path = tmp_path / "mine.toml"  # unified_memory may be left out (false); the numbers may not
    path.write_text(_text(unified_memory=None))
    assert load(str(path)).unified_memory is False
    assert "missing key(s) host_memory_bytes" in _bad(tmp_path, _text(host_memory_bytes=None))
    assert "unified_memory=1 must be" in _bad(tmp_path, _text(unified_memory=1))
