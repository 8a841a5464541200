"""The worker's run spec: one typed file, unknown keys named, method parameters validated,
the runs' inferences interleaved; the CLI prints one line and exits non-zero on a bad spec."""

from __future__ import annotations

import json

import pytest

from devices.errors import SpecError
from devices.spec import MethodRun, RunSpec, load_spec, parse_spec
from devices.worker import main

BASE = {
    "rank": 0,
    "peers": "a:1,b:2",
    "model": "vit-tiny",
    "out": "o",
    "runs": [{"id": "x", "method": "voltage"}],
}


def write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_written_spec_reads_back_equal(tmp_path):
    spec = RunSpec(
        rank=1,
        peers=["h:1", "h:2"],
        model="vit-tiny",
        runs=[MethodRun(id="t", method="trace-b", params={"K": 16, "level_k": "auto"})],
        out=tmp_path / "out",
        clock_skew_s=2.5,
    )
    loaded = load_spec(spec.write(tmp_path / "spec.json"))
    assert loaded == spec
    assert loaded.runs[0].params == {"K": 16, "level_k": "auto"}


def test_yaml_spec_and_peers_as_a_string(tmp_path):
    path = write(
        tmp_path,
        "rank: 1\npeers: h:1, h:2, h:3\nmodel: vit-tiny\nout: o\n"
        "runs: [{id: a, method: astra, params: {K: 16}}]\n",
    )
    spec = load_spec(path)
    assert spec.peers == ["h:1", "h:2", "h:3"] and spec.addresses[2] == ("h", 3)


def test_runs_interleave_round_robin():
    spec = parse_spec(
        {
            **BASE,
            "runs": [
                {"id": "a", "inferences": 3},
                {"id": "b", "inferences": 1},
                {"id": "c", "inferences": 2},
            ],
        }
    )
    assert list(spec.schedule()) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1), (0, 2)]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"inferenses": 3}, r"unknown key 'inferenses'"),
        (
            {"runs": [{"id": "x", "inferenses": 3}]},
            r"unknown key 'runs.0.inferenses' \(did you mean 'inferences'\?\)",
        ),
        ({"rank": 2}, "rank 2 out of range for 2 peers"),
        ({"peers": "a:1,nonsense"}, "peer address 'nonsense' is not host:port"),
        ({"batch": 0}, "batch: Input should be greater than or equal to 1"),
        ({"runs": []}, "runs: List should have at least 1 item"),
        ({"runs": [{"id": "x"}, {"id": "x"}]}, r"ids must differ, \['x'\] repeated"),
        (
            {"runs": [{"id": "t", "method": "trace-b", "params": {"K": 16, "levels": 3}}]},
            "run 't': .*unknown parameter 'levels'",
        ),
        ({"runs": [{"id": "v", "method": "voltge"}]}, "did you mean 'voltage'"),
        (
            {"runs": [{"id": "n", "method": "trace-nb", "params": {"placement": "2 B"}}]},
            "run 'n': method 'trace-nb': placement '2 B' is a case of 'trace-b'",
        ),
    ],
)
def test_bad_values_are_named(change, message):
    with pytest.raises(SpecError, match=message):
        parse_spec({**BASE, **change})


def test_missing_model_is_named():
    with pytest.raises(SpecError, match="model: Field required"):
        parse_spec({key: value for key, value in BASE.items() if key != "model"})


def test_unreadable_file_is_named(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "absent.json")
    with pytest.raises(SpecError, match="expected a mapping of keys, got list"):
        load_spec(write(tmp_path, "[1, 2]"))


def test_cli_prints_one_line_and_exits_non_zero(tmp_path, capsys):
    spec = {
        **BASE,
        "out": str(tmp_path),
        "runs": [{"id": "a", "method": "astra", "params": {"K": 1}}],
    }
    path = write(tmp_path, json.dumps(spec), "spec.json")
    status = main([str(path)])
    stderr = capsys.readouterr().err
    assert status == 1
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert stderr.startswith("worker 0: run 'a': method 'astra': K must be an integer in 2..65536")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot be read (FileNotFoundError)"),
        ("not hex", "expected hex digits"),
        ("00ff", "2 bytes, at least 16 needed (32 hex digits)"),
    ],
    ids=["missing", "not-hex", "short"],
)
def test_a_bad_secret_file_is_named_without_its_content(tmp_path, content, problem):
    from devices.spec import read_secret

    path = tmp_path / "run.key"
    if content is not None:
        path.write_text(content)
    with pytest.raises(SpecError) as raised:
        read_secret(path)
    assert str(raised.value) == f"secret_file {path}: {problem}"
    assert read_secret(write(tmp_path, "ab" * 16 + "\n", "good.key")) == bytes([0xAB] * 16)
