"""The worker's run spec: file and flags, unknown keys named, method parameters validated;
the CLI prints one line and exits non-zero on a bad spec."""

from __future__ import annotations

import json

import pytest

from devices.errors import SpecError
from devices.spec import parse_param, resolve_spec
from devices.worker import main


def write(tmp_path, text: str, name: str = "run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_file_and_flags_merge_flags_winning(tmp_path):
    path = write(
        tmp_path,
        "rank: 0\npeers: [a:1, b:2]\nmodel: vit-tiny\nmethod: trace-b\n"
        "params: {K: 16, buffers: true}\nout: o\nbatch: 4\n",
    )
    spec = resolve_spec(path, {"batch": 2, "rank": None}, ["buffers=false", "level_k=auto"])
    assert spec.batch == 2 and spec.rank == 0
    assert spec.params == {"K": 16, "buffers": False, "level_k": "auto"}
    assert spec.addresses == [("a", 1), ("b", 2)] and spec.devices == 2


def test_json_spec_and_peers_as_a_string(tmp_path):
    path = write(
        tmp_path,
        json.dumps({"rank": 1, "peers": "h:1, h:2, h:3", "model": "vit-tiny", "out": "o"}),
        "run.json",
    )
    assert resolve_spec(path, {}).peers == ["h:1", "h:2", "h:3"]


def test_unknown_key_is_named_with_a_hint(tmp_path):
    path = write(tmp_path, "rank: 0\npeers: [a:1]\nmodel: vit-tiny\nout: o\ninferenses: 3\n")
    with pytest.raises(
        SpecError,
        match=r"unknown key 'inferenses' \(did you mean "
        r"'inferences'\?\)",
    ):
        resolve_spec(path, {})


@pytest.mark.parametrize(
    ("overrides", "params", "message"),
    [
        ({"rank": 2}, [], "rank 2 out of range for 2 peers"),
        ({"peers": "a:1,nonsense"}, [], "peer address 'nonsense' is not host:port"),
        ({"batch": 0}, [], "batch: Input should be greater than or equal to 1"),
        ({"method": "trace-b"}, ["K=16", "levels=3"], "unknown parameter 'levels'"),
        ({"method": "voltge"}, [], "did you mean 'voltage'"),
    ],
)
def test_bad_values_are_named(overrides, params, message):
    base = {"rank": 0, "peers": "a:1,b:2", "model": "vit-tiny", "out": "o"}
    with pytest.raises(SpecError, match=message):
        resolve_spec(None, {**base, **overrides}, params)


def test_missing_model_is_named():
    with pytest.raises(SpecError, match="model: Field required"):
        resolve_spec(None, {"rank": 0, "peers": "a:1", "out": "o"})


def test_param_values_are_yaml_scalars():
    assert parse_param("K=1024") == ("K", 1024)
    assert parse_param("buffers=false") == ("buffers", False)
    assert parse_param("level_k=auto") == ("level_k", "auto")
    with pytest.raises(SpecError, match="expected key=value"):
        parse_param("K")


def test_cli_prints_one_line_and_exits_non_zero(tmp_path, capsys):
    status = main(
        [
            "--rank",
            "0",
            "--peers",
            "127.0.0.1:1,127.0.0.1:2",
            "--model",
            "vit-tiny",
            "--out",
            str(tmp_path),
            "--method",
            "astra",
            "--param",
            "K=1",
        ]
    )
    stderr = capsys.readouterr().err
    assert status == 1
    assert stderr.count("\n") == 1 and "Traceback" not in stderr
    assert stderr.startswith("worker 0: method 'astra': K must be an integer in 2..65536")
